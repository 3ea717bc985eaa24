"""The GEMMs overlapped with their sequence-parallel collective (megafp8.collective_gemm),
against the same product computed whole, over 2, 3 and 4 gloo ranks (3: a ring whose rank 1
has blocks on both sides of its own)."""
import pytest
import torch
import torch.distributed as dist

from megafp8 import collective_gemm

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

    # Column-parallel: this rank's rows of x gathered and multiplied, the callback once, after the gather.
    product = torch.empty(size * ROWS, N, dtype=torch.float64)
    calls = []
    gathered = collective_gemm.gathered_gemm(x.chunk(size)[rank].contiguous(), group, mm(weight), product,
                                             after_gather=lambda: calls.append(len(calls)))
    out["gathered"] = torch.equal(gathered, x)
    out["gathered_gemm_error"] = ((product - x @ weight.t()).abs().max() / (x @ weight.t()).abs().max()).item()
    out["after_gather_calls"] = calls

    # FP8 travels as bytes: the gathered input is the same FP8 values.
    fp8 = x.float().to(torch.float8_e4m3fn)
    scratch = torch.empty(size * ROWS, K)
    gathered = collective_gemm.gathered_gemm(fp8.chunk(size)[rank].contiguous(), group,
                                             lambda rows, o: o.copy_(rows.float()), scratch)
    out["fp8_gathered"] = torch.equal(gathered.float(), fp8.float())

    # Row-parallel: rank r holds columns r of x and of the weight; the sum over ranks, this rank's rows.
    x_r, w_r = x.chunk(size, dim=1)[rank].contiguous(), weight.chunk(size, dim=1)[rank].contiguous()
    mine = collective_gemm.gemm_reduce_scatter(x_r, group, mm(w_r), N, torch.float64)
    expected = (x @ weight.t()).chunk(size)[rank]
    out["reduce_scatter_error"] = ((mine - expected).abs().max() / expected.abs().max()).item()
    out["reduce_scatter_shape"] = tuple(mine.shape)
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
        assert result["after_gather_calls"] == [0]
        assert result["reduce_scatter_error"] < 1e-14, result
        assert result["reduce_scatter_shape"] == (ROWS, N)
        assert "cannot reduce-scatter" in result["bad_rows"]
