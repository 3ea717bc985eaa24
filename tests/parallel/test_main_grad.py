"""Adding a bf16 or fp16 gradient into an fp32 main_grad (megafp8.main_grad.add_into): the Triton
kernel, in Triton's interpreter on the CPU and on a GPU, gives torch's sum to the bit, for views at
any alignment and lengths that end inside a block; elsewhere torch adds."""

import importlib.util

import pytest
import torch

from megafp8 import main_grad

from ..interpreter import cubin_for_an_h100, run_interpreted_checks

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

# lengths: one element, a partial block, a whole one, several and a partial one
LENGTHS = (1, 37, main_grad.BLOCK, 3 * main_grad.BLOCK + 5)


def operands(n, dtype, device, shift_total=0, shift_addend=0, seed=0):
    """An fp32 total and a `dtype` addend of `n` elements, each a view `shift_*` elements into its
    storage (misaligned for a shift of 1), of values over many binades."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    total = torch.randn(n + shift_total, generator=g) * torch.exp2(
        torch.randint(-12, 12, (1,), generator=g).float()
    )
    addend = torch.randn(n + shift_addend, generator=g) * torch.exp2(
        torch.randint(-12, 12, (n + shift_addend,), generator=g).float()
    )
    total = total.to(device)[shift_total:]
    addend = addend.to(dtype).to(device)[shift_addend:]
    return total, addend


def check(device):
    for dtype in (torch.bfloat16, torch.float16):
        for n in LENGTHS:
            for shifts in ((0, 0), (1, 0), (0, 1), (3, 5)):
                total, addend = operands(n, dtype, device, *shifts, seed=n)
                assert main_grad._by_kernel(total, addend), (dtype, n, shifts)
                expected = total + addend
                main_grad.add_into(total, addend)
                assert torch.equal(total, expected), (dtype, n, shifts)
    # the kernel loaded on spare tensors leaves the operands as they were
    total, addend = operands(100, torch.bfloat16, device, 1, 0)
    before = total.clone()
    main_grad.prepare_add_into(total, addend)
    assert torch.equal(total, before)


def interpreted_checks():
    check("cpu")


@needs_triton
def test_the_kernel_in_the_triton_interpreter():
    run_interpreted_checks(__name__)


def test_off_cuda_torch_adds():
    total, addend = operands(1000, torch.bfloat16, "cpu")
    expected = total + addend
    assert not main_grad._by_kernel(total, addend)
    main_grad.add_into(total, addend)
    assert torch.equal(total, expected)


def test_what_the_kernel_does_not_take_torch_adds():
    # same dtypes, a bf16 total, a strided addend: torch's add, the same sum
    for total, addend in (
        (torch.randn(64), torch.randn(64)),
        (torch.randn(64).bfloat16(), torch.randn(64).bfloat16()),
        (torch.randn(8, 8), torch.randn(8, 8).bfloat16().t()),
    ):
        expected = total + addend
        main_grad.add_into(total, addend)
        assert torch.equal(total, expected)


@pytest.mark.gpu
def test_the_kernel_on_a_gpu():
    check("cuda")
    total, addend = operands(50_331_648 + 3, torch.bfloat16, "cuda", 1, 0)  # an FFN weight's size
    expected = total + addend
    main_grad.add_into(total, addend)
    assert torch.equal(total, expected)


@needs_triton
@pytest.mark.parametrize("bf16", [True, False])
def test_the_kernel_compiles_for_an_h100(bf16):
    signature = {"total": "*fp32", "addend": "*i16", "n": "i32"}
    signature.update({name: "constexpr" for name in ("BF16", "WIDE", "BLOCK")})
    constants = {"BF16": bf16, "WIDE": False, "BLOCK": main_grad.BLOCK}
    assert cubin_for_an_h100(main_grad._add_kernel, signature, constants, num_warps=8)
