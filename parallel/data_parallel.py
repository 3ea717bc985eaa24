"""Data parallelism: contiguous gradient buffers (fp32 by default) whose buckets are reduced
over the data-parallel group while backward is still running.

Every trainable parameter gets `param.main_grad`, a view into one buffer. After each
backward of a parameter its (bf16) `.grad` is added into `main_grad` and freed, so gradients
accumulate in fp32 across micro-batches. A bf16 buffer (`dtype`, Megatron's
`--main-grads-dtype bf16`) halves its memory and the reduction's bytes, and accumulates and
reduces in bf16. A layer may instead write its weight gradient into `main_grad` itself, in the
buffer's dtype straight from the GEMM (Megatron's gradient-accumulation fusion,
megafp8.fp8.linear): it then gives autograd no gradient for that weight.

`param.main_grad_empty`, kept here, says that `main_grad` holds no gradient of this step yet:
its first writer overwrites it instead of adding. So `zero(lazy=True)` need not clear the
buffer at all (an FP8 weight gradient overwrites its `main_grad` anyway; clearing 4 bytes per
parameter took 1.6% of a 7B-shaped step); `finish()` zeroes whatever no one wrote.

The buffer is cut into buckets of about `bucket_size` elements, laid out in reverse parameter
order (roughly the order backward produces them); on the micro-batch that ends a step, a
bucket's collective starts as soon as its last parameter's gradient is in, overlapping the rest
of backward.

With `shard=True` (the distributed optimizer) each bucket is padded to a multiple of the group
size and reduce-scattered: rank r ends up owning the summed gradient of the r-th equal slice of
every bucket (`owned_ranges`); the rest of its buffer holds its own unreduced gradients. Without
it, buckets are all-reduced. Gradients are averaged (the sum divided by the group size), so
dp = N equals dp = 1 with the same global batch.

A parameter given in `own_bucket` gets a bucket to itself. The tied embedding needs one: its
copies on the first and last pipeline stage are summed element by element after the reduction,
so each dp rank must own the same slice of both copies, whatever else each stage holds.
Parameters given in `bucket_apart` share buckets only with each other: FP8 primary weights,
whose buckets the distributed optimizer all-gathers as FP8 bytes and the others' as bf16.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from megafp8.collectives import group_size, rank_in, reduce_scatter_into
from megafp8.fp8.formats import FP8_DTYPES
from megafp8.main_grad import accumulate_into_main_grad
from megafp8.messages import check_integer

DEFAULT_BUCKET_SIZE = 40_000_000


class _Bucket:
    def __init__(self, params, start, end):
        self.params, self.start, self.end = params, start, end
        self.pending = set(params)
        self.handle = None


# What a gradient buffer may hold its gradients in
MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16)


class GradientBuffer:
    """The `main_grad` buffer of `params` (fp32, or `dtype`), with bucketed, overlapped reduction
    over `group`."""

    def __init__(
        self,
        params,
        group=None,
        bucket_size=DEFAULT_BUCKET_SIZE,
        shard=False,
        overlap=True,
        own_bucket=(),
        dtype=torch.float32,
        bucket_apart=(),
    ):
        if dtype not in MAIN_GRAD_DTYPES:
            raise ValueError(
                f"gradients in {dtype}: a gradient buffer holds one of {MAIN_GRAD_DTYPES}"
            )
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters")
        check_integer("bucket_size (elements)", bucket_size)
        self.group, self.shard, self.overlap = group, shard, overlap
        self.size = group_size(group)
        device = self.params[0].device
        alone = {id(p) for p in own_bucket}
        apart = {id(p) for p in bucket_apart}
        # Buckets of whole parameters, in reverse order (roughly the order backward produces
        # them); one bucket filling for the parameters apart, one for the others.
        members, current, size = [], {False: [], True: []}, {False: 0, True: 0}

        def close(kind):
            if current[kind]:
                members.append(current[kind])
                current[kind], size[kind] = [], 0

        for p in reversed(self.params):
            kind = id(p) in apart
            if id(p) in alone:
                close(kind)
            current[kind].append(p)
            size[kind] += p.numel()
            if id(p) in alone or size[kind] >= bucket_size:
                close(kind)
        close(False)
        close(True)
        self.buckets, layout, offset = [], {}, 0
        for params_of_bucket in members:
            start = offset
            for p in params_of_bucket:
                layout[p] = offset
                offset += p.numel()
            if shard:  # padded so that it splits evenly over the group
                offset = start + -(-(offset - start) // self.size) * self.size
            self.buckets.append(_Bucket(params_of_bucket, start, offset))
        self.numel = offset
        self.data = torch.zeros(self.numel, dtype=dtype, device=device)
        self.bucket_of = {}
        for bucket in self.buckets:
            for p in bucket.params:
                p.main_grad = self.data[layout[p] : layout[p] + p.numel()].view_as(p)
                p.main_grad_offset = layout[p]
                p.main_grad_empty = True
                self.bucket_of[p] = bucket
        self._sync = True
        self._lazy = False  # the empty main_grads hold stale values, not zeros
        # The hooks live in C++ on the parameters, out of the garbage collector's sight: a bound
        # method there would keep this buffer, and through it the parameters, alive for good.
        this = weakref.ref(self)

        def grad_ready(param):
            buffer = this()
            if buffer is not None:
                buffer._grad_ready(param)

        self._hooks = [p.register_post_accumulate_grad_hook(grad_ready) for p in self.params]

    # -- the step's life cycle ------------------------------------------------------------

    def set_sync(self, sync: bool):
        """True on the micro-batch that ends a step: its backward launches the reductions."""
        self._sync = sync

    def _grad_ready(self, param):
        if param.grad is not None:  # else the layer has written main_grad itself
            if param.grad.dtype in FP8_DTYPES:
                raise RuntimeError(
                    "an FP8 primary weight's gradient reached autograd, which cast it to FP8: "
                    "its layer hands it to main_grad only with gradient-accumulation fusion on "
                    "(Fp8Linear.fuse_wgrad_accumulation)"
                )
            accumulate_into_main_grad(param, param.grad)
            param.grad = None
        self.mark_ready((param,))

    def mark_ready(self, params):
        """`params`' gradients of this backward are in their main_grad (added by the hook above,
        or inside a CUDA graph): on the step's last micro-batch, launch each bucket they complete."""
        if not (self._sync and self.overlap and self.size > 1):
            return
        for param in params:
            bucket = self.bucket_of[param]
            bucket.pending.discard(param)
            if not bucket.pending:
                self._launch(bucket)

    def _launch(self, bucket):
        self._zero_empty(bucket.params)
        flat = self.data[bucket.start : bucket.end]
        flat.div_(self.size)
        if self.shard:
            bucket.handle = reduce_scatter_into(
                flat[self.owned_slice(bucket)], flat, self.group, async_op=True
            )
        else:
            bucket.handle = dist.all_reduce(flat, group=self.group, async_op=True)

    def finish(self):
        """Wait for every bucket's reduction (launching those backward did not start). Every
        main_grad holds this step's gradient from here on (zeros where nothing was written)."""
        if self.size == 1:
            self._zero_empty(self.params)
        else:
            for bucket in self.buckets:
                if bucket.handle is None:
                    self._launch(bucket)
                bucket.handle.wait()
        for bucket in self.buckets:
            bucket.handle = None
            bucket.pending = set(bucket.params)

    def zero(self, lazy: bool = False):
        """Start a step's gradients: every main_grad empty. `lazy` leaves the old values in the
        buffer (its first writer overwrites each main_grad, `finish()` zeroes the rest): then
        main_grad may be read only after `finish()` and written only through
        `accumulate_into_main_grad` or a layer that honours `main_grad_empty`."""
        if not lazy:
            self.data.zero_()
        self._lazy = lazy
        for p in self.params:
            p.main_grad_empty = True

    def _zero_empty(self, params):
        if self._lazy:
            empty = [p.main_grad for p in params if p.main_grad_empty]
            if empty:
                torch._foreach_zero_(empty)
        for p in params:
            p.main_grad_empty = False

    def remove_hooks(self):
        for hook in self._hooks:
            hook.remove()

    # -- which part this rank owns (distributed optimizer) -----------------------------------

    def owned_slice(self, bucket) -> slice:
        """This rank's slice of `bucket`, relative to the bucket's start."""
        rank = rank_in(self.group)
        length = (
            (bucket.end - bucket.start) // self.size if self.shard else bucket.end - bucket.start
        )
        start = rank * length if self.shard else 0
        return slice(start, start + length)

    def owned_ranges(self):
        """(param, start, end) element ranges of the flattened parameters this rank owns."""
        ranges = []
        for bucket in self.buckets:
            mine = self.owned_slice(bucket)
            lo, hi = bucket.start + mine.start, bucket.start + mine.stop
            for p in bucket.params:
                start = max(lo, p.main_grad_offset) - p.main_grad_offset
                end = min(hi, p.main_grad_offset + p.numel()) - p.main_grad_offset
                if start < end:
                    ranges.append((p, start, end))
        return ranges
