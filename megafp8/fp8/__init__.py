"""The FP8 compute core: formats, recipes, scaling state, quantization, FP8 GEMM, Fp8Linear,
and the health of a model's FP8 casts (scales, saturation, underflow).

Knows nothing of the parallel engines or the models: the process groups it communicates over
come in as arguments (fp8_autocast's amax-reduction group; Fp8Linear.fp8_linear's gather group,
over which a sequence-parallel input is all-gathered in FP8), and the collectives themselves
are megafp8.collectives.
"""

from .autocast import fp8_autocast, fp8_recompute
from .formats import Format, fp8_max
from .gemm import fp8_gemm
from .health import fp8_health
from .linear import Fp8Linear
from .quantize import quantize
from .recipe import (
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    OverrideLinearPrecision,
    Recipe,
    RowwiseScaling,
)
from .scaling import ScalingState
from .tensor import Fp8Tensor, scale_from_amax

__all__ = [
    "BlockwiseScaling",
    "CurrentScaling",
    "DelayedScaling",
    "Format",
    "Fp8Linear",
    "Fp8Tensor",
    "OverrideLinearPrecision",
    "Recipe",
    "RowwiseScaling",
    "ScalingState",
    "fp8_autocast",
    "fp8_recompute",
    "fp8_gemm",
    "fp8_health",
    "fp8_max",
    "quantize",
    "scale_from_amax",
]
