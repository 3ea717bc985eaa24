"""rope_kernel: RoPE in one Triton kernel each way, against the rotation in fp64 and against
apply_rotary's torch form; in Triton's interpreter (a fresh process) and on a GPU."""

import importlib.util

import pytest
import torch
from megafp8.models.rope import apply_rotary, apply_rotary_torch, rotary_tables

from ..interpreter import cubin_for_an_h100, run_interpreted_checks

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
# of the result
ROUNDING = {
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
    torch.float32: 2.0**-23,
}
FP32 = 2.0**-22  # the fp32 arithmetic's error, relative to the terms' magnitude


def broadcast(x, table):
    return table[:, :, None, :] if table.dim() == 3 else table[: x.shape[0], None, None, :]


def rotation_fp64(x, cos, sin):
    """x * cos + rotate_half(x) * sin in fp64; tables [seq, head_dim] or [seq, batch, head_dim]."""
    xd = x.double()
    first, second = xd.chunk(2, dim=-1)
    return (
        xd * broadcast(x, cos).double()
        + torch.cat([-second, first], dim=-1) * broadcast(x, sin).double()
    )


def magnitude(v, cos, sin):
    """|v| * |cos| + |v's halves swapped| * |sin|: what the fp32 arithmetic's error scales with."""
    a = v.detach().double().abs().cpu()
    first, second = a.chunk(2, dim=-1)
    cos, sin = (broadcast(a, t).double().abs().cpu() for t in (cos, sin))
    return a * cos + torch.cat([second, first], dim=-1) * sin


def qkv_view(seq, batch, heads, head_dim, dtype, device, seed):
    """q as QKVParallelLinear.split_heads gives it without GQA: a strided view of the packed output."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(seq, batch, heads, 3, head_dim, generator=g).to(dtype).to(device)
    return packed[..., 0, :]


def check(
    rotate, seq, batch, heads, head_dim, dtype, device, per_token=False, seed=0, strided=True
):
    """`rotate`'s output and gradient against the fp64 rotation (within a rounding of x's dtype)
    and against the torch form (the same bytes almost everywhere, never more than a rounding off)."""
    cos, sin = rotary_tables(seq + 5, head_dim, 10000.0)
    if per_token:  # positions restarting at document boundaries, a table row per token
        g = torch.Generator().manual_seed(seed + 1)
        positions = torch.randint(0, seq + 5, (seq, batch), generator=g)
        cos, sin = cos[positions], sin[positions]
    cos, sin = cos.to(device), sin.to(device)
    x = (
        qkv_view(seq, batch, heads, head_dim, dtype, device, seed)
        if strided
        else torch.randn(seq, batch, heads, head_dim, generator=torch.Generator().manual_seed(seed))
        .to(dtype)
        .to(device)
    )
    grad = torch.randn(
        seq, batch, heads, head_dim, generator=torch.Generator().manual_seed(seed + 2)
    ).to(dtype)
    grad = grad.to(device)
    fused_x = x.detach().clone().requires_grad_(True)
    out = rotate(fused_x, cos, sin)
    out.backward(grad)
    torch_x = x.detach().clone().requires_grad_(True)
    torch_out = apply_rotary_torch(torch_x, cos, sin)
    torch_out.backward(grad)
    ref_x = x.detach().double().cpu().requires_grad_(True)
    ref = rotation_fp64(ref_x, cos.cpu(), sin.cpu())
    ref.backward(grad.double().cpu())
    what = (seq, batch, heads, head_dim, dtype, per_token, strided)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous(), what
    for got, expected, from_torch, v in (
        (out, ref, torch_out, x),
        (fused_x.grad, ref_x.grad, torch_x.grad, grad),
    ):
        got, from_torch = got.detach().cpu().double(), from_torch.detach().cpu().double()
        bound = ROUNDING[dtype] * expected.abs() + FP32 * magnitude(v, cos, sin)
        assert ((got - expected).abs() <= bound).all(), what
        assert ((got - from_torch).abs() <= 2 * bound).all(), what
        assert (got == from_torch).double().mean() >= 0.99, what


def interpreted_checks():
    from megafp8.models.rope_kernel import rotary_triton

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        check(rotary_triton, 7, 2, 3, 64, dtype, "cpu")
    check(rotary_triton, 5, 3, 19, 32, torch.bfloat16, "cpu")  # a partial block of heads
    # half 40: partial columns
    check(rotary_triton, 6, 2, 4, 80, torch.bfloat16, "cpu", per_token=True)
    check(rotary_triton, 4, 1, 2, 128, torch.bfloat16, "cpu", strided=False)


@needs_triton
def test_the_kernel_in_the_triton_interpreter():
    run_interpreted_checks(__name__)


def test_off_cuda_apply_rotary_is_the_torch_form():
    x = torch.randn(5, 2, 3, 16, dtype=torch.bfloat16)
    cos, sin = rotary_tables(8, 16, 10000.0)
    assert torch.equal(apply_rotary(x, cos, sin), apply_rotary_torch(x, cos, sin))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 16, 12, 64), (4096, 2, 32, 128), (37, 3, 19, 80)])
@pytest.mark.parametrize("per_token", [False, True])
def test_the_kernel_on_a_gpu(shape, per_token):
    # dispatches to the kernel
    check(apply_rotary, *shape, torch.bfloat16, "cuda", per_token=per_token)


@needs_triton
@pytest.mark.parametrize("transposed", [False, True])
def test_the_kernel_compiles_for_an_h100(transposed):
    import triton.language as tl
    from megafp8.models import rope_kernel

    signature = {
        "x_ptr": "*bf16",
        "out_ptr": "*bf16",
        "cos_ptr": "*fp32",
        "sin_ptr": "*fp32",
        **{
            name: "i32"
            for name in (
                "batch",
                "heads",
                "stride_xs",
                "stride_xb",
                "stride_xh",
                "stride_cs",
                "stride_cb",
            )
        },
        **{name: "constexpr" for name in ("HALF", "BLOCK_D", "BLOCK_H", "TRANSPOSED", "OUT_DTYPE")},
    }
    constants = {
        "HALF": 40,
        "BLOCK_D": 64,
        "BLOCK_H": rope_kernel.BLOCK_HEADS,
        "TRANSPOSED": transposed,
        "OUT_DTYPE": tl.bfloat16,
    }
    assert cubin_for_an_h100(rope_kernel._rotary_kernel, signature, constants)
