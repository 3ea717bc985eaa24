"""FP8 formats: which torch dtype each tensor role is cast to, and its largest finite value."""

from __future__ import annotations

import enum

import torch

E4M3_DTYPE = torch.float8_e4m3fn
E5M2_DTYPE = torch.float8_e5m2
FP8_DTYPES = (E4M3_DTYPE, E5M2_DTYPE)


class Format(enum.Enum):
    """The FP8 format of a recipe, as in Transformer Engine.

    E4M3 (max 448) has one more mantissa bit; E5M2 (max 57344) more range. HYBRID uses E4M3
    for the forward pass (activations, weights) and E5M2 for gradients, whose range is wider.
    E5M2 alone names the gradient half of HYBRID; recipes accept only HYBRID or E4M3.
    """

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HYBRID = "hybrid"

    @property
    def forward_dtype(self) -> torch.dtype:
        return E5M2_DTYPE if self is Format.E5M2 else E4M3_DTYPE

    @property
    def backward_dtype(self) -> torch.dtype:
        return E4M3_DTYPE if self is Format.E4M3 else E5M2_DTYPE


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 for E4M3, 57344 for E5M2."""
    return float(torch.finfo(dtype).max)
