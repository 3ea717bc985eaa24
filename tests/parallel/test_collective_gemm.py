"""The GEMMs overlapped with their sequence-parallel collective (megafp8.collective_gemm),
against the same product computed whole, over 2, 3 and 4 gloo ranks (3: a ring whose rank 1
has blocks on both sides of its own); on two GPUs, their copy-engine transfers
(megafp8.symmetric_memory) against NCCL's."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megafp8 import collective_gemm, symmetric_memory

from ..multiprocess import run_on_ranks

ROWS, K, N = 8, 24, 16  # rows per rank


def mm(weight):
    def gemm(rows, out):
        torch.mm(rows, weight.t(), out=out)

    return gemm


def body(rank, size):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size * ROWS, K, generator=g, dtype=torch.float64)
    weight = torch.randn(N, K, generator=g, dtype=torch.float64)
    out = {}

    # Column-parallel: this rank's rows of x gathered and multiplied.
    product = torch.empty(size * ROWS, N, dtype=torch.float64)
    gathered = collective_gemm.gathered_gemm(
        x.chunk(size)[rank].contiguous(), group, mm(weight), product
    )
    out["gathered"] = torch.equal(gathered, x)
    out["gathered_gemm_error"] = (
        (product - x @ weight.t()).abs().max() / (x @ weight.t()).abs().max()
    ).item()
    product.zero_()
    # The same, with the rows' transpose gathered as columns beside it.
    columns = collective_gemm.gathered_gemm_and_columns(
        x.chunk(size)[rank].contiguous(),
        x.chunk(size)[rank].t().contiguous(),
        group,
        mm(weight),
        product,
    )
    out["columns"] = torch.equal(columns.wait(), x.t())
    out["with_columns_error"] = (
        (product - x @ weight.t()).abs().max() / (x @ weight.t()).abs().max()
    ).item()
    product.zero_()
    out["not_kept"] = collective_gemm.gathered_gemm(
        x.chunk(size)[rank].contiguous(), group, mm(weight), product, keep_gathered=False
    )
    out["not_kept_error"] = (
        (product - x @ weight.t()).abs().max() / (x @ weight.t()).abs().max()
    ).item()

    # FP8 travels as bytes: the gathered input is the same FP8 values.
    fp8 = x.float().to(torch.float8_e4m3fn)
    scratch = torch.empty(size * ROWS, K)
    gathered = collective_gemm.gathered_gemm(
        fp8.chunk(size)[rank].contiguous(), group, lambda rows, o: o.copy_(rows.float()), scratch
    )
    out["fp8_gathered"] = torch.equal(gathered.float(), fp8.float())

    # Row-parallel: rank r holds columns r of x and of the weight; the sum over ranks, this rank's rows.
    x_r, w_r = x.chunk(size, dim=1)[rank].contiguous(), weight.chunk(size, dim=1)[rank].contiguous()
    mine = collective_gemm.gemm_reduce_scatter(x_r, group, mm(w_r), N, torch.float64)
    expected = (x @ weight.t()).chunk(size)[rank]
    out["reduce_scatter_error"] = ((mine - expected).abs().max() / expected.abs().max()).item()
    out["reduce_scatter_shape"] = tuple(mine.shape)
    # a bias in the GEMM of this rank's block alone
    bias = torch.randn(N, generator=g, dtype=torch.float64)

    def with_bias(rows, o):
        torch.addmm(bias, rows, w_r.t(), out=o)

    mine = collective_gemm.gemm_reduce_scatter(
        x_r, group, mm(w_r), N, torch.float64, own_gemm=with_bias
    )
    out["bias_error"] = ((mine - expected - bias).abs().max() / expected.abs().max()).item()
    later = collective_gemm.gemm_then_reduce_scatter(x_r, group, mm(w_r), N, torch.float64)
    out["then_reduce_scatter_error"] = (
        (later.wait() - expected).abs().max() / expected.abs().max()
    ).item()
    try:
        collective_gemm.gemm_reduce_scatter(x_r[:-1], group, mm(w_r), N, torch.float64)
    except ValueError as error:
        out["bad_rows"] = str(error)
    return out


@pytest.mark.parametrize("size", [2, 3, 4])
def test_overlapped_gemms_equal_the_whole_product(size):
    for result in run_on_ranks(body, size):
        assert result["gathered"] and result["fp8_gathered"], result
        assert result["gathered_gemm_error"] < 1e-14, result
        assert result["columns"] and result["with_columns_error"] < 1e-14, result
        assert result["not_kept"] is None and result["not_kept_error"] < 1e-14, result
        assert result["reduce_scatter_error"] < 1e-14, result
        assert result["then_reduce_scatter_error"] < 1e-14, result
        assert result["reduce_scatter_shape"] == (ROWS, N)
        assert result["bias_error"] < 1e-14, result
        assert "cannot reduce-scatter" in result["bad_rows"]


def unavailable_body(rank, size):
    group = dist.group.WORLD
    reason = symmetric_memory.unavailable_reason(group)
    try:
        symmetric_memory.use_copy_engines(group)
        refused = None
    except RuntimeError as error:
        refused = str(error)
    try:
        symmetric_memory.use_copy_engines(group, timeout_s=0)
        no_timeout = None
    except ValueError as error:
        no_timeout = str(error)
    columns = collective_gemm.all_gather_columns(torch.full((3, 2), float(rank)), group).wait()
    return reason, refused, no_timeout, symmetric_memory.workspace(group), columns


def test_copy_engines_are_refused_with_the_reason_where_the_group_cannot_use_them():
    """gloo on the CPU: no symmetric memory; the overlap keeps its NCCL/gloo transfers."""
    for reason, refused, no_timeout, workspace, columns in run_on_ranks(unavailable_body, 2):
        assert "CUDA GPUs and the NCCL backend" in reason and "gloo" in reason
        assert refused == f"copy-engine transfers are not available: {reason}"
        assert "a barrier timeout of 0 s never ends a wait" in no_timeout
        assert workspace is None
        assert torch.equal(columns, torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 3))


def copy_engine_body(rank, size):
    """Each overlapped transfer on NCCL and on copy engines, eager and replayed from a CUDA graph
    (twice, with new inputs): bit for bit alike. The reduce-scatter also alone in a graph
    replayed twice in a row (no gather before it joins the copy stream)."""
    group, device = dist.group.WORLD, torch.device("cuda", rank)
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.empty(ROWS * 16, K * 8, device=device, dtype=torch.bfloat16)
    weight = torch.randn(N * 8, K * 8, generator=g, device=device, dtype=torch.bfloat16)
    bias = torch.randn(N * 8, generator=g, device=device, dtype=torch.bfloat16)

    def gemm(rows, out):
        return torch.mm(rows, weight.t(), out=out)

    def reduce_scatter():
        return collective_gemm.gemm_reduce_scatter(
            x.repeat(size, 1),
            group,
            gemm,
            weight.shape[0],
            torch.bfloat16,
            own_gemm=lambda rows, out: torch.addmm(bias, rows, weight.t(), out=out),
        )

    def transfers():
        product = torch.empty(
            size * x.shape[0], weight.shape[0], device=device, dtype=torch.bfloat16
        )
        gathered = collective_gemm.gathered_gemm(x, group, gemm, product)
        alone = torch.empty_like(product)
        collective_gemm.gathered_gemm(x, group, gemm, alone, keep_gathered=False)
        mine = reduce_scatter()
        later = collective_gemm.gemm_then_reduce_scatter(
            x.repeat(size, 1), group, gemm, weight.shape[0], torch.bfloat16
        )
        columns = collective_gemm.all_gather_columns(x.t().contiguous(), group).wait()
        beside = torch.empty_like(product)
        both = collective_gemm.gathered_gemm_and_columns(
            x, x.t().contiguous(), group, gemm, beside
        ).wait()
        return product, gathered, alone, mine, later.wait(), columns, beside, both

    results = []
    for inputs in range(2):
        x.copy_(torch.randn(x.shape, generator=g, device=device))
        nccl = [t.clone() for t in transfers()]
        symmetric_memory.use_copy_engines(group)
        try:
            eager = [t.clone() for t in transfers()]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = transfers()
                symmetric_memory.join_copy_streams()
            graph.replay()
            replayed = [t.clone() for t in static]
            # a capture whose first transfer is the reduce-scatter, replayed twice in a row
            alone = torch.cuda.CUDAGraph()
            with torch.cuda.graph(alone):
                lone = reduce_scatter()
                symmetric_memory.join_copy_streams()
            alone.replay()
            alone.replay()
            replayed.append(lone.clone())
            eager.append(eager[3])
            nccl.append(nccl[3])
        finally:
            symmetric_memory.stop_using_copy_engines()
        torch.cuda.synchronize()
        results.append(
            [torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(nccl, eager, replayed)]
        )
    # GEMMs leave the carveout's SMs free while the group's blocks travel on copy engines
    try:
        symmetric_memory.use_copy_engines(group, sm_carveout=100_000)
    except ValueError as error:
        results.append(str(error))
    symmetric_memory.use_copy_engines(group, sm_carveout=2)
    results.append(torch._C._get_sm_carveout_experimental())
    symmetric_memory.stop_using_copy_engines()
    results.append(torch._C._get_sm_carveout_experimental())
    return results


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_copy_engine_transfers_equal_nccl_eager_and_in_cuda_graphs():
    for result in run_on_ranks(copy_engine_body, 2, backend="nccl"):
        assert result[:2] == [[True] * 9] * 2, result
        assert "an SM carveout of 100000 leaves the GEMMs no SMs" in result[2], result
        assert result[3:] == [2, None], result


# Scripts of two GPU processes (torchrun), each with the group's copy-engine workspace as `space`
# and a barrier timeout of `timeout_s`; a rank whose GPU trapped cannot tear its process group
# down, so every rank leaves with os._exit.
_COPY_ENGINE_SCRIPT = """
import os, torch, torch.distributed as dist
from megafp8 import symmetric_memory
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
group = dist.group.WORLD
symmetric_memory.use_copy_engines(group, timeout_s={timeout_s})
space = symmetric_memory.workspace(group)
{body}
os._exit(0)
"""


def run_on_two_gpus(tmp_path, body: str, timeout_s: float) -> str:
    """`body` run by both ranks after the script's set-up; their stdout and stderr."""
    script = tmp_path / "copy_engines.py"
    script.write_text(_COPY_ENGINE_SCRIPT.format(timeout_s=timeout_s, body=body.strip()))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    return done.stdout + done.stderr


# Rank 1 never joins the gather: rank 0's barrier must give up after its timeout, say so, and end
# the process with a CUDA error instead of waiting forever.
_ABSENT_PEER = """
local = torch.ones(4, 8, device="cuda")
out = local.new_empty(8, 8)
space.all_gather_into(out, local).wait()  # both ranks: the workspace grows (collective), once
torch.cuda.synchronize()
dist.barrier()
if rank == 0:
    try:
        space.all_gather_into(out, local).wait()
        torch.cuda.synchronize()
        print("no error", flush=True)
    except RuntimeError as error:
        print(f"rank 0 stopped: {error}", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_copy_engine_barrier_without_its_peer_times_out(tmp_path):
    out = run_on_two_gpus(tmp_path, _ABSENT_PEER, timeout_s=2)
    assert "CUDASymmetricMemory::barrier: rank 0 failed" in out, out
    assert "rank 0 stopped:" in out and "no error" not in out, out


# The workspace's second growth while rank 0's compute stream, the legacy default stream, still
# runs a second of queued work: torch (<= 2.11) zeroes the new signal pads on that stream, behind
# the work, while rank 1 signals into them as soon as the rendezvous returns. A zeroing after the
# signal would erase it and stop both ranks at the barrier timeout (as tp 2 runs stopped in their
# first step); both gathers must complete, right.
_BUSY_GROWTH = """
small = torch.full((4, 8), float(rank + 1), device="cuda")
space.all_gather_into(small.new_empty(8, 8), small).wait()  # the first growth
torch.cuda.synchronize()
dist.barrier()
local = torch.full((4096, 1024), float(rank + 1), device="cuda")
out = local.new_empty(8192, 1024)
if rank == 0:
    torch.cuda._sleep(2 * 10**9)  # about a second
try:
    gathered = space.all_gather_into(out, local).wait()  # the second growth
    torch.cuda.synchronize()
    right = bool((gathered[:4096] == 1).all() and (gathered[4096:] == 2).all())
    print(f"rank {rank}: gathered {right}", flush=True)
except RuntimeError as error:
    print(f"rank {rank} stopped: {error}", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_workspace_growing_behind_queued_compute_loses_no_signal(tmp_path):
    out = run_on_two_gpus(tmp_path, _BUSY_GROWTH, timeout_s=10)
    assert "rank 0: gathered True" in out and "rank 1: gathered True" in out, out
