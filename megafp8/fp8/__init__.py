"""The FP8 compute core: formats, recipes, scaling state, quantization, FP8 GEMM, Fp8Linear.

Knows nothing of parallelism or models: process groups come in as arguments.
"""
from .autocast import fp8_autocast, fp8_recompute
from .formats import Format, fp8_max
from .gemm import fp8_gemm
from .linear import Fp8Linear
from .quantize import Fp8Tensor, quantize, scale_from_amax
from .recipe import CurrentScaling, DelayedScaling, OverrideLinearPrecision
from .scaling import ScalingState

__all__ = [
    "CurrentScaling",
    "DelayedScaling",
    "Format",
    "Fp8Linear",
    "Fp8Tensor",
    "OverrideLinearPrecision",
    "ScalingState",
    "fp8_autocast",
    "fp8_recompute",
    "fp8_gemm",
    "fp8_max",
    "quantize",
    "scale_from_amax",
]
