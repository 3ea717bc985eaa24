"""The tensor-parallel transfers of `--tp-comm-overlap` on the GPUs' copy engines, through
PyTorch's symmetric memory (the transport of Transformer Engine's userbuffers and of torch's
async tensor parallelism).

An NCCL kernel needs streaming multiprocessors, and a persistent FP8 GEMM holds all of them
until it ends: NCCL's all-gather beside a GEMM mostly runs after it. Here each rank puts its
block into a buffer every rank of the group can address, and the others copy it out with
cudaMemcpy over NVLink, which runs on copy engines and leaves the SMs to the GEMM. A one-block
barrier kernel (symmetric memory's signal pads) orders the writes and the reads. That kernel, and
the local copy of a rank's block into the shared buffer, still need an SM: beside a persistent
GEMM holding all of them they wait for it to end, so a carveout of a few SMs that cuBLAS GEMMs
leave free (`use_copy_engines`) lets the transfers start on time.

Every transfer runs on one copy stream, forked from the compute stream and joined back by the
handle's wait(), so it works inside CUDA graphs. A gather's closing barrier (its peers are done
reading) stays on the copy stream, off the compute stream's path: a CUDA graph capture must call
`join_copy_streams()` before it ends. A barrier kernel whose peer does not come within the
timeout prints which rank and channel it waited for and traps, so a run left waiting ends with a
CUDA error, as NCCL's timed-out collectives do. The workspace grows outside a capture and is
never freed while the process lives (captured graphs keep its address). Each rank of a group
must call the same transfers in the same order, as the overlapped layers do.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from .collectives import group_size, rank_in, side_by_side

_workspaces: dict = {}  # process group -> _Workspace, for the groups given to use_copy_engines
# some group moved its blocks on copy engines in this process (see used_in_this_process)
_used = False

# A peer that never arrives at a barrier: the waiting kernel traps after this long (the trainer
# passes --distributed-timeout-minutes; torch's default for collectives).
DEFAULT_BARRIER_TIMEOUT_S = 600.0

# SMs the trainer's GEMMs leave to the transfers' kernels (--tp-comm-sm-carveout): of 0, 2, 4, 8
# and 16, 2 gave GPT-1.3B at tp 2 on two H200s the most tokens/s (benchmarks/RESULTS.md)
DEFAULT_SM_CARVEOUT = 2


def unavailable_reason(group) -> str | None:
    """Why `group` cannot move its tensor-parallel blocks on copy engines, or None if it can."""
    if group_size(group) < 2:
        return "the group has a single rank"
    if not torch.cuda.is_available() or dist.get_backend(group) != "nccl":
        return f"copy engines need CUDA GPUs and the NCCL backend (this group runs {dist.get_backend(group)})"
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return f"torch {torch.__version__} has no symmetric memory"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if local % group_size(group):
        return (
            f"the group's {group_size(group)} ranks are not all on one node ({local} processes per node): "
            f"symmetric memory maps the peers' GPU memory, within a node"
        )
    return None


def use_copy_engines(
    group, sm_carveout: int = 0, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S
) -> None:
    """Move the overlapped blocks of `group` on copy engines from now on (see `unavailable_reason`).
    `sm_carveout`: cuBLAS GEMMs leave that many SMs free, where the transfers' barrier and local
    copy kernels run beside a GEMM that would otherwise hold every SM until it ends. `timeout_s`:
    a barrier kernel that waits longer for a peer stops the process with a CUDA error, after
    printing which rank it waited for on which channel (as NCCL's collectives time out)."""
    if not timeout_s > 0:
        raise ValueError(
            f"a barrier timeout of {timeout_s} s never ends a wait: give a positive one"
        )
    reason = unavailable_reason(group)
    if reason is not None:
        raise RuntimeError(f"copy-engine transfers are not available: {reason}")
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if not 0 <= sm_carveout < sms:
        raise ValueError(
            f"an SM carveout of {sm_carveout} leaves the GEMMs no SMs: this GPU has {sms}; "
            f"give fewer (0: GEMMs on every SM)"
        )
    global _used
    _workspaces.setdefault(group, _Workspace(group, timeout_s))
    _used = True
    if sm_carveout and not hasattr(torch._C, "_set_sm_carveout_experimental"):
        warnings.warn(
            f"torch {torch.__version__} cannot leave SMs free in cuBLAS GEMMs: they keep every SM",
            stacklevel=2,
        )
    elif sm_carveout:
        # torch's own knob (async tensor parallelism uses it), read by cuBLAS at each GEMM launch
        torch._C._set_sm_carveout_experimental(sm_carveout)


def stop_using_copy_engines() -> None:
    """Back to NCCL for every group (the workspaces stay allocated: graphs may hold them), GEMMs
    on every SM again."""
    _workspaces.clear()
    if getattr(torch._C, "_get_sm_carveout_experimental", lambda: None)() is not None:
        torch._C._set_sm_carveout_experimental(None)


def used_in_this_process() -> bool:
    """Whether this process has moved blocks on copy engines, stopped since or not: a CUDA error it
    meets may then follow a barrier kernel that gave up on its peer and trapped."""
    return _used


def join_copy_streams() -> None:
    """Order the current stream after every transfer the ongoing CUDA graph capture issued,
    closing barriers included: a capture calls this before it ends (it must join every stream it
    forked, and may wait on no other)."""
    for space in _workspaces.values():
        if space.forked_in_capture:
            torch.cuda.current_stream().wait_stream(space.stream)
            space.forked_in_capture = False


def workspace(group) -> _Workspace | None:
    """The copy-engine workspace of `group`, or None where its blocks travel through NCCL."""
    return _workspaces.get(group)


class _Pending:
    """A transfer on the copy stream; wait() orders the current stream after it and returns the
    result. It holds the tensors the transfer reads until then."""

    def __init__(self, done: torch.cuda.Event, result: torch.Tensor, keep=()):
        self.done, self.result, self.keep = done, result, keep

    def then(self, follow: Callable[[torch.Tensor], torch.Tensor]) -> _Pending:
        """The same transfer, whose wait() returns `follow(result)`."""
        return _Then(self, follow)

    def wait(self) -> torch.Tensor:
        torch.cuda.current_stream().wait_event(self.done)
        self.keep = ()
        return self.result


class _Then:
    def __init__(self, pending: _Pending, follow):
        self.pending, self.follow = pending, follow

    def wait(self) -> torch.Tensor:
        return self.follow(self.pending.wait())


class _Part(NamedTuple):
    """One tensor of a gather: `local` is sent, `place(rank, block)` puts each rank's bytes
    where they belong (this rank's only with `own_block`), the handle returns `follow(out)`."""

    local: torch.Tensor
    out: torch.Tensor
    place: Callable[[int, torch.Tensor], None]
    own_block: bool = True
    follow: Callable[[torch.Tensor], torch.Tensor] | None = None


class _Workspace:
    """One group's symmetric buffer: a gather region (written and read on the copy stream) and a
    scatter region (written by the compute stream's GEMMs, read by the peers' copy streams)."""

    def __init__(self, group, timeout_s: float):
        self.group, self.size, self.rank = group, group_size(group), rank_in(group)
        self.timeout_ms = max(int(timeout_s * 1000), 1)
        self.stream = torch.cuda.Stream()
        self.gather_bytes = self.scatter_bytes = 0
        self.handle = self.mine = self.peers = None
        self.forked_in_capture = False  # the copy stream has work of a capture not joined yet
        self._kept = []  # earlier buffers: graphs captured with them still address them

    def _reserve(self, gather_bytes: int = 0, scatter_bytes: int = 0) -> None:
        if gather_bytes <= self.gather_bytes and scatter_bytes <= self.scatter_bytes:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the copy-engine workspace must grow during a CUDA graph capture: run the same "
                "shapes eagerly first (--cuda-graph-warmup-steps), as the trainer does"
            )
        symmetric = importlib.import_module("torch.distributed._symmetric_memory")
        self.gather_bytes = _aligned(max(gather_bytes, self.gather_bytes))
        self.scatter_bytes = _aligned(max(scatter_bytes, self.scatter_bytes))
        if self.mine is not None:
            self._kept.append(self.mine)
        self.mine = symmetric.empty(
            self.gather_bytes + self.scatter_bytes,
            dtype=torch.uint8,
            device=torch.cuda.current_device(),
        )
        # torch up to 2.11 zeroes a new buffer's signal pads with a plain cudaMemset, on the
        # legacy default stream: the trainer's compute stream, and late behind the step's queued
        # work. A peer's barrier signals into this rank's pad as soon as the rendezvous returns;
        # zeroed after that, the signal is lost and both ranks wait, at different barriers, until
        # the timeout. So each rank's zeroing ends before the rendezvous, and the rendezvous's
        # upload of the peers' addresses, which the barrier kernels read, ends after it.
        torch.cuda.default_stream().synchronize()
        self.handle = symmetric.rendezvous(self.mine, self.group.group_name)  # collective
        torch.cuda.default_stream().synchronize()
        self.peers = [
            self.handle.get_buffer(rank, (self.mine.numel(),), torch.uint8)
            for rank in range(self.size)
        ]

    def _barrier(self, channel: int) -> None:
        """Every rank of the group has reached this point of its copy stream; a peer that does not
        come within the timeout stops this process with a CUDA error (torch's barrier kernel
        prints which rank and channel it waited for, then traps)."""
        self.handle.barrier(channel=channel, timeout_ms=self.timeout_ms)

    def _fork(self) -> torch.cuda.Stream:
        self.forked_in_capture |= torch.cuda.is_current_stream_capturing()
        self.stream.wait_stream(torch.cuda.current_stream())
        return self.stream

    def _order_after_copy_stream(self) -> None:
        """The current stream waits for everything queued on the copy stream. A capture that has
        not forked it has nothing to wait for (nor may it wait on work outside the capture): the
        graph replayed before it ended by joining the copy stream, and a capture starts on a
        synchronized device (torch.cuda.graph)."""
        if self.forked_in_capture or not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().wait_stream(self.stream)

    def _join(self) -> torch.cuda.Event:
        done = torch.cuda.Event()
        done.record(self.stream)
        return done

    def all_gather_into(
        self, out: torch.Tensor, local: torch.Tensor, own_block: bool = True
    ) -> _Pending:
        """Every rank's `local` into `out`'s dim-0 blocks in rank order, on the copy stream; the
        handle returns `out`. Without `own_block` this rank's block of `out` is left unwritten
        (for a caller that reads it from `local`)."""
        return self._gather([self._rows(out, local, own_block)])[0]

    def all_gather_columns(self, local: torch.Tensor) -> _Pending:
        """Every rank's 2-D `local` side by side along dim 1, in rank order, on the copy stream
        (the handle returns it). Each block lands in its own columns by a 2-D copy, so nothing
        is left to concatenate on the compute stream."""
        return self._gather([self._columns(local)])[0]

    def all_gather_rows_and_columns(
        self, out: torch.Tensor, local: torch.Tensor, columns: torch.Tensor
    ) -> tuple[_Pending, _Pending]:
        """`all_gather_into(out, local, own_block=False)` and `all_gather_columns(columns)` in one
        barrier round (a tensor and its transpose, both needed after one GEMM): the rows' handle
        is ready first, the columns are copied while the caller multiplies the rows."""
        rows, cols = self._gather([self._rows(out, local, False), self._columns(columns)])
        return rows, cols

    def _rows(self, out: torch.Tensor, local: torch.Tensor, own_block: bool) -> _Part:
        n, received = local.numel() * local.element_size(), _bytes(out)

        def place(rank: int, block: torch.Tensor) -> None:
            received[rank * n : (rank + 1) * n].copy_(block)

        return _Part(local, out, place, own_block)

    def _columns(self, local: torch.Tensor) -> _Part:
        local = local.contiguous()
        copy_2d = _memcpy_2d()
        if copy_2d is None:  # stacked, then concatenated on the compute stream
            stacked = local.new_empty((self.size, *local.shape))
            return self._rows(stacked, local, True)._replace(follow=side_by_side)
        rows, width = local.shape[0], local.shape[1] * local.element_size()
        out = local.new_empty((rows, self.size * local.shape[1]))

        def place(rank: int, block: torch.Tensor) -> None:
            pitch = self.size * width
            copy_2d(out.data_ptr() + rank * width, pitch, block.data_ptr(), width, width, rows)

        return _Part(local, out, place)

    def _gather(self, parts: list[_Part]) -> list[_Pending]:
        """The gathers' protocol: each part's `local` into this rank's gather region, then on the
        copy stream one barrier, for each part in turn every rank's block placed (the peers'
        bytes from their regions), one handle per part, and a closing barrier."""
        sizes = [part.local.numel() * part.local.element_size() for part in parts]
        starts = [sum(_aligned(size) for size in sizes[:i]) for i in range(len(parts))]
        self._reserve(gather_bytes=starts[-1] + sizes[-1])
        # This rank's blocks go into its region on the compute stream, before the caller's GEMM
        # starts: on the copy stream the copy ran beside that GEMM, on the few SMs it leaves
        # free, up to twenty times slower, and every peer's read of the blocks waited for it.
        # The region is written again once the peers have read it (the last closing barrier).
        self._order_after_copy_stream()
        for part, start, size in zip(parts, starts, sizes):
            self.peers[self.rank][start : start + size].copy_(_bytes(part.local))
        pending = []
        with torch.cuda.stream(self._fork()):
            self._barrier(0)  # every rank's blocks are in
            for part, start, size in zip(parts, starts, sizes):
                for step in range(1, self.size):
                    peer = (self.rank + step) % self.size
                    part.place(peer, self.peers[peer][start : start + size])
                if part.own_block:
                    part.place(self.rank, _bytes(part.local))
                handle = _Pending(self._join(), part.out, keep=(part.local,))
                pending.append(handle.then(part.follow) if part.follow else handle)
            # Every peer has read this rank's blocks before the copy stream writes the region
            # again; the compute stream need not wait for it.
            self._barrier(1)
        return pending

    def gemm_reduce_scatter(
        self, a: torch.Tensor, gemm, own_gemm, out_features: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """This rank's block of rows of `sum over ranks (a @ W)`: `gemm` writes the other ranks'
        blocks into the scatter region, each rank copies its own from every peer while it
        multiplies its own rows with `own_gemm`, and adds them."""
        rows = a.shape[0] // self.size
        region = self._scatter_region(a.shape[0], out_features, dtype)
        # the previous call's reads are done: its barrier was joined
        for step in range(1, self.size):
            peer = (self.rank + step) % self.size
            gemm(a[peer * rows : (peer + 1) * rows], region[peer * rows : (peer + 1) * rows])
        pulled = self._pull_partials(rows, out_features, dtype)
        out = torch.empty((rows, out_features), dtype=dtype, device=a.device)
        own_gemm(a[self.rank * rows : (self.rank + 1) * rows], out)
        return pulled.then(lambda received: _sum_into(out, received)).wait()

    def reduce_scatter_after(
        self, gemm, rows: int, out_features: int, dtype: torch.dtype
    ) -> _Pending:
        """A handle whose wait() returns this rank's block of rows of the sum over ranks of what
        `gemm(out)` writes into `out` (`rows` x `out_features`): the GEMM runs now, into the
        scatter region, and the peers' partial sums of this rank's block are copied while
        whatever the caller runs before wait() computes."""
        region = self._scatter_region(rows, out_features, dtype)
        gemm(region)  # the previous call's reads are done: its barrier was joined
        block = rows // self.size
        mine = region[self.rank * block : (self.rank + 1) * block]
        return self._pull_partials(block, out_features, dtype).then(
            lambda received: _sum_into(mine + received[0], received[1:])
        )

    def _scatter_region(self, rows: int, out_features: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's scatter region as a `rows` x `out_features` matrix of `dtype`, `rows` split
        in one block per rank."""
        if rows % self.size:
            raise ValueError(f"cannot reduce-scatter {rows} rows over {self.size} ranks")
        self._reserve(
            scatter_bytes=rows * out_features * torch.empty((), dtype=dtype).element_size()
        )
        return (
            self.peers[self.rank][self.gather_bytes : self.gather_bytes + self.scatter_bytes]
            .view(dtype)[: rows * out_features]
            .view(rows, out_features)
        )

    def _pull_partials(self, block_rows: int, out_features: int, dtype: torch.dtype) -> _Pending:
        """On the copy stream, once every rank's scatter region is written: this rank's block of
        each peer's region, (peers, block_rows, out_features). Its handle waits for the closing
        barrier too, after which the compute stream may write the region again."""
        block = block_rows * out_features * torch.empty((), dtype=dtype).element_size()
        received = torch.empty(
            (self.size - 1, block_rows, out_features),
            dtype=dtype,
            device=torch.cuda.current_device(),
        )
        with torch.cuda.stream(self._fork()):
            self._barrier(0)  # every rank's partial sums are in
            for step in range(1, self.size):
                peer = (self.rank - step) % self.size
                start = self.gather_bytes + self.rank * block
                _bytes(received[step - 1]).copy_(self.peers[peer][start : start + block])
            self._barrier(1)
            done = self._join()
        return _Pending(done, received)


def _sum_into(out: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
    for partial in partials:
        out += partial
    return out


_cudart = None  # the CUDA runtime library torch loaded (ctypes), once looked up; False: none found


def _memcpy_2d():
    """`copy_2d(dst, dst_pitch, src, src_pitch, width, rows)`: cudaMemcpy2DAsync of device
    addresses on the current stream (a copy engine's strided copy, which a CUDA graph captures),
    or None where torch's CUDA runtime library cannot be found (a static build)."""
    global _cudart
    if _cudart is None:
        _cudart = False
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "/libcudart.so" in line}
        except OSError:  # no /proc: the concatenation path
            paths = set()
        if paths:
            _cudart = ctypes.CDLL(sorted(paths)[0])
            _cudart.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t] * 2 + [
                ctypes.c_size_t,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
            _cudart.cudaMemcpy2DAsync.restype = ctypes.c_int
    if not _cudart:
        return None

    def copy_2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int):
        stream = torch.cuda.current_stream().cuda_stream
        status = _cudart.cudaMemcpy2DAsync(
            dst, dst_pitch, src, src_pitch, width, rows, _DEVICE_TO_DEVICE, stream
        )
        if status != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {status}")

    return copy_2d


_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


def _aligned(size: int) -> int:
    # regions start on 256-byte boundaries, as the GEMMs writing them expect
    return -(-size // 256) * 256


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)
