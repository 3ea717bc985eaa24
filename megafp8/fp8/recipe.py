"""FP8 recipes: how scales are chosen. Validated on construction; errors name the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from megafp8.messages import check_integer

from .activation_kernels import KINDS as ACTIVATIONS
from .formats import Format

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
TRAINING_FORMATS = (Format.HYBRID, Format.E4M3)


class OverrideLinearPrecision(NamedTuple):
    """Which of a linear layer's three GEMMs run in high precision instead of FP8."""

    fprop: bool = False
    dgrad: bool = False
    wgrad: bool = False


def _coerce_format(owner: str, value) -> Format:
    if isinstance(value, str):
        try:
            value = Format(value.lower())
        except ValueError:
            pass
    if value not in TRAINING_FORMATS:
        raise ValueError(
            f"{owner}.fp8_format must be Format.HYBRID or Format.E4M3 (or 'hybrid'/'e4m3'), got "
            f"{value!r}; E5M2 is only the gradient half of HYBRID"
        )
    return value


class Recipe:
    """What every FP8 recipe tells the layers and the scaling code (megafp8.fp8.scaling), so
    neither asks which recipe it has: a new recipe is a subclass, and its scale rule a branch
    in scaling.cast.

    - `fp8_format`: E4M3 forward, E5M2 (HYBRID) or E4M3 gradients; `margin`: scales divided by 2**margin.
    - `delayed`: casts take a scale fitted to the amaxes of earlier passes, kept in a history of
      `amax_history_len` entries and recomputed every `interval` passes (else from the tensor itself).
    - `reduce_amax`: those amaxes are MAX-reduced over the amax-reduction group once per pass.
    - `granularity`: what a scale covers: "tensor", or (megafp8.fp8.fine_grained) "row", a row
      of a GEMM operand along the dimension the GEMM sums over, or "block", a block of one.
    - `override_linear_precision`: which GEMMs (fprop, dgrad, wgrad) stay in high precision.
    - `fused_activations`: the MLP activations (megafp8.fp8.activation_kernels.KINDS) whose
      output and gradient the recipe's casts compute as they read, never stored in high
      precision, where the layers fuse neighbours (megafp8.fp8.fused). Empty under current
      scaling, whose scale needs the whole tensor first.
    """

    delayed = False
    reduce_amax = False
    granularity = "tensor"
    override_linear_precision = OverrideLinearPrecision()
    fused_activations: tuple[str, ...] = ()


def _checked_override(owner: str, override) -> OverrideLinearPrecision:
    if (
        not isinstance(override, (tuple, list))
        or len(override) != 3
        or not all(isinstance(flag, bool) for flag in override)
    ):
        raise ValueError(
            f"{owner}.override_linear_precision must be three booleans (fprop, dgrad, wgrad), "
            f"got {override!r}"
        )
    return OverrideLinearPrecision(*override)


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Scale each tensor from the amaxes of earlier passes (Transformer Engine's timing).

    A cast uses the scale computed before it; the amax it observes enters `amax_history[0]`
    (the history rolls) at the end of the pass, and every `interval`-th update recomputes
    `scale = fp8_max / amax / 2**margin`, where amax is the history's maximum ("max") or its
    newest entry ("most_recent"). With `reduce_amax`, the amaxes of one pass are MAX-reduced
    over the fp8_autocast's amax_reduction_group in a single collective.
    `override_linear_precision` = (fprop, dgrad, wgrad): True runs that GEMM in high precision.
    """

    margin: int = 0
    interval: int = 1
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    override_linear_precision: OverrideLinearPrecision = OverrideLinearPrecision()
    reduce_amax: bool = True

    delayed = True
    fused_activations = ACTIVATIONS  # the scale is known before the tensor: one read computes it

    def __post_init__(self):
        owner = type(self).__name__
        check_integer(f"{owner}.margin", self.margin, minimum=0)
        check_integer(f"{owner}.interval", self.interval)
        check_integer(f"{owner}.amax_history_len", self.amax_history_len)
        object.__setattr__(self, "fp8_format", _coerce_format(owner, self.fp8_format))
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"{owner}.amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}, "
                f"got {self.amax_compute_algo!r}"
            )
        object.__setattr__(
            self,
            "override_linear_precision",
            _checked_override(owner, self.override_linear_precision),
        )
        if not isinstance(self.reduce_amax, bool):
            raise ValueError(f"{owner}.reduce_amax must be True or False, got {self.reduce_amax!r}")


@dataclass(frozen=True)
class CurrentScaling(Recipe):
    """Scale each tensor from its own amax, computed just before the cast (no history).

    Costs one extra read of each tensor, but cannot be surprised by a sudden outlier; the
    low-risk recipe that torchao's and Colossal-AI's FP8 results rely on. Weights are still
    cast once per optimizer step.
    """

    fp8_format: Format = Format.HYBRID
    margin: int = 0

    def __post_init__(self):
        owner = type(self).__name__
        object.__setattr__(self, "fp8_format", _coerce_format(owner, self.fp8_format))
        check_integer(f"{owner}.margin", self.margin, minimum=0)


@dataclass(frozen=True)
class FineGrainedScaling(Recipe):
    """What the per-row and per-block recipes share (megafp8.fp8.fine_grained): each cast fits a
    scale to each of its rows or blocks (no history); `power_of_two_scales` rounds each down to a
    power of two (dequantizing is then exact in any precision);
    `override_linear_precision=(False, False, True)` keeps the weight gradient in high precision.
    `fused_activations`: each recipe's default is where the fusion was measured to pay (below).
    """

    fp8_format: Format = Format.E4M3
    margin: int = 0
    override_linear_precision: OverrideLinearPrecision = OverrideLinearPrecision()
    power_of_two_scales: bool = False
    fused_activations: tuple[str, ...] = ()

    def __post_init__(self):
        owner = type(self).__name__
        object.__setattr__(self, "fp8_format", _coerce_format(owner, self.fp8_format))
        check_integer(f"{owner}.margin", self.margin, minimum=0)
        object.__setattr__(
            self,
            "override_linear_precision",
            _checked_override(owner, self.override_linear_precision),
        )
        if not isinstance(self.power_of_two_scales, bool):
            raise ValueError(
                f"{owner}.power_of_two_scales must be True or False, got {self.power_of_two_scales!r}"
            )
        fused = self.fused_activations
        if isinstance(fused, str) or not all(kind in ACTIVATIONS for kind in fused):
            raise ValueError(
                f"{owner}.fused_activations must be a tuple of activations from {ACTIVATIONS}, "
                f"got {fused!r}"
            )
        object.__setattr__(self, "fused_activations", tuple(fused))


@dataclass(frozen=True)
class RowwiseScaling(FineGrainedScaling):
    """Scale each row of a GEMM operand from its own amax, along the dimension the GEMM sums
    over (torchao's rowwise recipe): the forward's input per token, its weight per output
    channel; the input gradient's GEMM takes the output gradient per token and the weight per
    input channel; the weight gradient's takes both per channel, summed over the tokens. An
    outlier then costs only its own row's precision. Every operand is cast once for each GEMM it
    enters. E4M3 for every operand and power-of-two scales by default, as torchao's rowwise
    (the per-row scales keep the gradients in range); with a high-precision weight gradient,
    torchao's rowwise_with_gw_hp.
    """

    power_of_two_scales: bool = True
    # No activation: a rowwise cast reads each tile three times (the amax pass, the cast, its
    # transpose), and computing an activation three times costs more than the stores and reads
    # it saves (benchmarks/RESULTS.md, "Fine-grained scaling")
    fused_activations: tuple[str, ...] = ()

    granularity = "row"


@dataclass(frozen=True)
class BlockwiseScaling(FineGrainedScaling):
    """Scale activations and gradients per 1 x 128 block and weights per 128 x 128 block, along
    the dimension each GEMM sums over (DeepSeek-V3's fine-grained recipe): an outlier costs only
    its own block's precision. The weight's square blocks serve both of its GEMMs, transposed
    for dgrad. E4M3 for every operand and fp32 scales by default, as DeepSeek-V3 trains. On
    Hopper the GEMMs are cuBLAS's blockwise-scaled ones, elsewhere an emulation from the
    dequantized operands (fp32 products and sums); every dimension a linear multiplies over must
    be a multiple of 128, else it runs in high precision (Fp8Linear warns).
    """

    # SwiGLU: a blockwise cast reads each tile twice (it and its transpose), and SwiGLU's one
    # exponential twice costs less than storing its output and reading it back; GELU's erf or
    # tanh does not (benchmarks/RESULTS.md, "Fine-grained scaling")
    fused_activations: tuple[str, ...] = ("swiglu",)

    granularity = "block"


# --fp8-recipe's names, each recipe with its defaults
RECIPES_BY_NAME = {
    "delayed": DelayedScaling,
    "current": CurrentScaling,
    "rowwise": RowwiseScaling,
    "blockwise": BlockwiseScaling,
}
