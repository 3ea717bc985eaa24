"""Rotary position embeddings (RoPE), in the rotate-half convention of Llama and Hugging Face:
dimension i of the first half of each head pairs with dimension i of the second half."""

from __future__ import annotations

import math

import torch

from . import rope_kernel
from .config import RopeScaling


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """theta^(-2i/head_dim) for i < head_dim/2, with Llama 3's frequency scaling when given: long
    wavelengths (low frequencies) are slowed down by `factor`, short ones kept, and the band in
    between interpolated smoothly."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv.float()
    wavelength = 2 * math.pi / inv
    original = scaling.original_max_position_embeddings
    long_wavelength = original / scaling.low_freq_factor
    short_wavelength = original / scaling.high_freq_factor
    slowed = torch.where(wavelength > long_wavelength, inv / scaling.factor, inv)
    blend = (original / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - blend) * slowed / scaling.factor + blend * slowed
    between = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return torch.where(between, smoothed, slowed).float()


def rotary_tables(positions: int, head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """cos and sin tables [positions, head_dim] for `apply_rotary`."""
    angles = torch.outer(
        torch.arange(positions, dtype=torch.float32), inverse_frequencies(head_dim, theta, scaling)
    )
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [seq, batch, heads, head_dim] (computed in fp32) by the tables' first `seq`
    rows, or by tables already gathered per token ([seq, batch, head_dim], for positions that
    restart at document boundaries). On CUDA one Triton kernel each way (rope_kernel), else
    `apply_rotary_torch`, which torch.compile fuses by itself (so compiled layers take it too)."""
    if x.is_cuda and rope_kernel.available() and not torch.compiler.is_compiling():
        return rope_kernel.rotary_triton(x, cos, sin)
    return apply_rotary_torch(x, cos, sin)


def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in torch operations: the reference, and the path off CUDA."""
    if cos.dim() == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        cos, sin = cos[: x.shape[0], None, None, :], sin[: x.shape[0], None, None, :]
    xf = x.float()
    first, second = xf.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
