"""Fine-grained scaling: an Fp8Linear's GEMMs with scales finer than one per tensor, each fitted
at the cast to its own block of an operand (no history), along the dimension the GEMM sums over:

- rowwise (RowwiseScaling, torchao's rowwise): a scale per row of each operand, through
  `torch._scaled_mm`'s rowwise mode on the GPU (cuBLAS), emulated on the CPU;
- blockwise (BlockwiseScaling, DeepSeek-V3's recipe): activations and gradients a scale per
  1 x 128 block, weights per 128 x 128 block, through cuBLAS's blockwise scaling on Hopper GPUs;
  elsewhere the GEMM is emulated from the dequantized operands (fp32 products and sums), the
  reference the cuBLAS path is checked against.

For `y = x W^T` (x [M, K] tokens by input channels, W [N, K]):

    fprop   y  = x W^T      x per token (over K),           W per output channel (over K)
    dgrad   dx = dy W       dy per token (over N),          W per input channel (over N)
    wgrad   dW = dy^T x     dy per output channel (over M), x per input channel (over M)

so x and dy are each cast twice, once for each GEMM they enter, both casts from one read on CUDA
(megafp8.fp8.fine_grained_kernels); so is the weight under rowwise scaling, while its 128 x 128
blocks serve both of its GEMMs, transposed for dgrad. Under sequence parallelism each rank casts
its own tokens and the FP8 casts are gathered; the one collective a cast needs is a rowwise
column's amax, maxed over the ranks' tokens. With neighbour fusion (megafp8.fp8.linear.Fusion)
the MLP's activation, and in backward its gradient, are computed in those reads.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from megafp8 import collectives
from megafp8.main_grad import accumulate_into_main_grad, claim_empty_main_grad

from . import activation_kernels, fine_grained_kernels
from .autocast import Fp8Context
from .formats import fp8_max
from .fused import ActivationGradSource
from .tensor import ScaledFp8, power_of_two_below, saturates, scale_from_amax, underflows

# The blockwise recipe's block: 1 x 128 for activations and gradients, 128 x 128 for weights
BLOCK = 128


class OutputGradient(NamedTuple):
    """A linear's output gradient cast for its fine-grained backward by what follows the linear
    (megafp8.fp8.fused.GradHandoff): the row cast for dgrad, the transposed one for wgrad (None:
    the weight takes no gradient), the column sums for the bias (None: it takes none)."""

    rows: ScaledFp8
    columns: ScaledFp8 | None
    col_sum: torch.Tensor | None


class WeightCasts(NamedTuple):
    """A weight [N, K] cast for both GEMMs it enters: `rows` for fprop (its scales over K), and
    `columns`, the transpose [K, N], for dgrad (over N)."""

    rows: ScaledFp8
    columns: ScaledFp8


def quantize_blocks(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    block: tuple[int, int | None] = (1, None),
    margin: int = 0,
    saturation_out=None,
    power_of_two: bool = False,
    amax_group=None,
) -> ScaledFp8:
    """Cast the 2-D `x` to `fp8_dtype` with a scale per `block` (rows, columns; None columns: a
    whole row), each fitted to its block's amax (`fp8_max / amax / 2**margin`, 1 for a block of
    zeros or one holding inf/NaN; with `power_of_two`, the power of two at or below it),
    saturating. `saturation_out`, an int64 triple, takes (elements saturated, elements cast,
    nonzero elements flushed to zero) as megafp8.fp8.quantize counts them. `amax_group`: the
    blocks' amaxes are maxed over that group first (each rank holding a part of every row). The
    bytes are row-major (a transposed `x` is laid out first, in its own dtype)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blocks expects a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    block_rows, block_cols = block[0], block[1] or cols
    if rows % block_rows or cols % block_cols:
        raise ValueError(
            f"a tensor of shape {tuple(x.shape)} does not split into blocks of {block_rows} x "
            f"{block_cols}"
        )
    tiles = (
        x.contiguous().float().view(rows // block_rows, block_rows, cols // block_cols, block_cols)
    )
    amax = tiles.abs().amax(dim=(1, 3))
    if amax_group is not None:
        amax = collectives.max_over(amax, amax_group)
    scale = scale_from_amax(amax, fp8_dtype, margin)
    if power_of_two:
        scale = power_of_two_below(scale)
    scaled = (tiles * scale[:, None, :, None]).view(rows, cols)
    if saturation_out is not None:
        saturation_out[0] += saturates(scaled, fp8_dtype).sum()
        saturation_out[1] += x.numel()
        saturation_out[2] += underflows(scaled, fp8_dtype).sum()
    limit = fp8_max(fp8_dtype)
    return ScaledFp8(scaled.clamp_(-limit, limit).to(fp8_dtype), scale.reciprocal())


def quantize_rows(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    saturation_out=None,
    power_of_two: bool = False,
) -> ScaledFp8:
    """`quantize_blocks` with a scale per row."""
    return quantize_blocks(x, fp8_dtype, (1, None), margin, saturation_out, power_of_two)


def dequantize(q: ScaledFp8) -> torch.Tensor:
    """The fp32 values of `q`: each byte times its block's inverse scale."""
    rows, cols = q.data.shape
    grid_rows, grid_cols = q.scale_inv.shape
    tiles = q.data.float().view(grid_rows, rows // grid_rows, grid_cols, cols // grid_cols)
    return (tiles * q.scale_inv[:, None, :, None]).view(rows, cols)


def rowwise_gemm(
    a: ScaledFp8,
    b: ScaledFp8,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
    bias: torch.Tensor | None = None,
):
    """`dequantize(a) @ dequantize(b)^T (+ bias)` for `a` [M, K] and `b` [N, K], each scaled per
    row: [M, N] in `out_dtype`, through bf16, which cuBLAS's rowwise scaling writes. On CUDA
    through `torch._scaled_mm` (`fast_accum`: Hopper's faster, less precise FP8 accumulation, for
    the forward GEMM, as torchao's rowwise recipe runs it; `bias` added by the GEMM, where
    `takes_bias` says it can); elsewhere from the dequantized operands in fp32 (CPU `_scaled_mm`
    takes per-row scales from torch 2.13 on only)."""
    if a.data.is_cuda:
        y = torch._scaled_mm(
            a.data,
            b.data.t(),
            scale_a=a.scale_inv,
            scale_b=b.scale_inv.reshape(1, -1),
            bias=None if bias is None else bias.to(torch.bfloat16),
            out_dtype=torch.bfloat16,
            use_fast_accum=fast_accum,
        )
    else:
        y = _emulated(a, b, bias).to(torch.bfloat16)
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


def blockwise_gemm(
    a: ScaledFp8,
    b: ScaledFp8,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`dequantize(a) @ dequantize(b)^T (+ bias)` for `a` [M, K] scaled by 1 x 128 blocks and
    `b` [N, K] by 1 x 128 or 128 x 128 blocks: [M, N] in `out_dtype`. On a Hopper GPU through
    cuBLAS's blockwise scaling (`torch.nn.functional.scaled_mm`; bf16 or fp32 written), whose
    kernels sum each 128-deep block apart and add the blocks in fp32; `bias` added by the GEMM,
    where `takes_bias` says it can; `fast_accum` is taken for the rowwise GEMM's signature and
    changes nothing. Elsewhere emulated from the dequantized operands (fp32 products and sums),
    the reference the cuBLAS path is checked against."""
    if a.data.is_cuda and _cublas_blockwise(a.data.device):
        sa, recipe_a = _cublas_block_scales(a)
        sb, recipe_b = _cublas_block_scales(b)
        output_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
        y = F.scaled_mm(
            a.data,
            b.data.t(),
            sa,
            recipe_a,
            sb,
            recipe_b,
            bias=None if bias is None else bias.to(output_dtype),
            output_dtype=output_dtype,
        )
        return y if output_dtype == out_dtype else y.to(out_dtype)
    return _emulated(a, b, bias).to(out_dtype)


def _emulated(a: ScaledFp8, b: ScaledFp8, bias=None) -> torch.Tensor:
    """The fp32 product of the dequantized operands (+ bias)."""
    with torch.autocast(a.data.device.type, enabled=False):
        y = dequantize(a) @ dequantize(b).t()
        return y if bias is None else y + bias.float()


def gemm_into(granularity: str, a: ScaledFp8, b: ScaledFp8, out: torch.Tensor) -> None:
    """`dequantize(a) @ dequantize(b)^T` written into `out` (a weight's fp32 main_grad), with no
    bf16 output in between: `torch._scaled_mm` into it on CUDA (where `writes_into` says it can),
    emulated in fp32 elsewhere."""
    if not a.data.is_cuda:
        out.copy_(_emulated(a, b))
        return
    if granularity == "row":
        torch._scaled_mm(
            a.data,
            b.data.t(),
            scale_a=a.scale_inv,
            scale_b=b.scale_inv.reshape(1, -1),
            out_dtype=out.dtype,
            out=out,
        )
        return
    # blockwise scales go with their scaling types to the scaled-mm op F.scaled_mm calls, whose
    # `out` variant F.scaled_mm does not expose
    (sa, recipe_a), (sb, recipe_b) = _cublas_block_scales(a), _cublas_block_scales(b)
    torch.ops.aten._scaled_mm_v2.out(
        a.data,
        b.data.t(),
        [sa],
        [recipe_a.value],
        [],
        [sb],
        [recipe_b.value],
        [],
        None,
        out.dtype,
        out=out,
    )


def writes_into(granularity: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `gemm_into` can write a `dtype` result on `device`: always off CUDA; on CUDA where
    `torch._scaled_mm` takes this granularity's scales with that output (`_found`)."""
    return _found(("into", granularity, dtype), device)


def takes_bias(granularity: str, device: torch.device) -> bool:
    """Whether this granularity's forward GEMM adds a bias itself on `device` (in the GEMM
    library's epilogue; always in the CPU emulation): `_found`."""
    return _found(("bias", granularity, None), device)


_found_on: dict = {}


def _found(feature: tuple, device: torch.device) -> bool:
    """Whether the GEMMs take `feature` (what, granularity, dtype) on `device`: always off CUDA;
    on CUDA found once per device by a small product through it, checked against the emulation
    (a kernel that refuses it, or computes something else, says no). Not found during a CUDA
    graph capture (the eager steps before it find it)."""
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (*feature, index)
    if key not in _found_on:
        if torch.cuda.is_current_stream_capturing():
            return False
        _found_on[key] = _check(*feature, torch.device("cuda", index))
    return _found_on[key]


def _check(what: str, granularity: str, dtype, device: torch.device) -> bool:
    if granularity == "block" and not _cublas_blockwise(device):
        return False
    # the operands' blocks as the GEMM that takes the feature has them: the forward's weight
    # in 128 x 128 blocks (blockwise), wgrad's operands both along their rows
    generator = torch.Generator().manual_seed(0)
    block = SCHEMES[granularity].block
    b_block = (BLOCK, BLOCK) if what == "bias" and granularity == "block" else block
    a, b = (
        quantize_blocks(torch.randn(128, 256, generator=generator), torch.float8_e4m3fn, blocks)
        for blocks in (block, b_block)
    )
    bias = torch.randn(128, generator=generator).to(torch.bfloat16) if what == "bias" else None
    want = _emulated(a, b, bias).double()
    on_device = [ScaledFp8(*(t.to(device) for t in q)) for q in (a, b)]
    try:
        if what == "into":
            got = torch.empty(128, 128, dtype=dtype, device=device)
            gemm_into(granularity, *on_device, got)
        else:
            got = SCHEMES[granularity].gemm(*on_device, torch.bfloat16, bias=bias.to(device))
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return bool((got.cpu().double() - want).norm() / want.norm() < 2.0**-7)


_cublas_blockwise_devices: dict = {}


def _cublas_blockwise(device: torch.device) -> bool:
    """Whether cuBLAS runs blockwise-scaled GEMMs on `device`: an SM 9.0 GPU (the only one
    cuBLAS has the kernels for), CUDA 12.9 or newer, and a torch whose `_scaled_mm` takes
    blockwise scales (one with `F.scaled_mm`). Elsewhere the GEMMs are emulated, which is slower
    than bf16: said once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cublas_blockwise_devices:
        cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
        usable = (
            hasattr(F, "scaled_mm")
            and torch.cuda.get_device_capability(index) == (9, 0)
            and cuda >= (12, 9)
        )
        _cublas_blockwise_devices[index] = usable
        if not usable:
            warnings.warn(
                f"blockwise FP8 GEMMs run emulated in fp32 on {torch.cuda.get_device_name(index)} "
                f"(torch {torch.__version__}, CUDA {torch.version.cuda}): cuBLAS's blockwise "
                "scaling needs an SM 9.0 GPU (H100, H200), CUDA 12.9 and torch 2.10; use "
                "--fp8-recipe rowwise or delayed for speed",
                stacklevel=3,
            )
    return _cublas_blockwise_devices[index]


def _cublas_block_scales(q: ScaledFp8):
    """`q`'s inverse scales as cuBLAS takes them, with their scaling type: 1 x 128 scales
    [rows, cols / 128] outer-dim-major; 128 x 128 scales transposed, [cols / 128 rounded up
    to 4, rows / 128] with unit stride along the first axis. The fused casts write them so
    (megafp8.fp8.fine_grained_kernels); other layouts are copied into it here."""
    s = q.scale_inv
    if s.shape[0] == q.data.shape[0]:
        if s.stride(0) != 1:
            s = s.t().contiguous().t()
        return s, F.ScalingType.BlockWise1x128
    grid_rows, grid_cols = s.shape
    padded = -(-grid_cols // 4) * 4
    if s.stride() == (padded, 1):  # padded in place (fine_grained_kernels.padded_square_scales)
        s = s.as_strided((grid_rows, padded), (padded, 1))
    else:
        s = F.pad(s, (0, padded - grid_cols), value=1.0)
    return s.t(), F.ScalingType.BlockWise128x128


class _Scheme(NamedTuple):
    """How a granularity casts an activation or gradient along its rows (`block`: rows, columns
    of a scale's block; None columns: whole rows) and multiplies."""

    block: tuple
    gemm: object


SCHEMES = {
    "row": _Scheme((1, None), rowwise_gemm),
    "block": _Scheme((1, BLOCK), blockwise_gemm),
}


def fine_grained_linear(
    module,
    x: torch.Tensor,
    bias,
    context: Fp8Context,
    gather_group=None,
    scatter_group=None,
    fusion=None,
) -> torch.Tensor:
    """`x W^T + bias` for Fp8Linear `module` under a rowwise or blockwise `context`. With
    `gather_group`, `x` is this rank's dim-0 shard, all-gathered (in FP8 where the casts allow)
    before the GEMM; with `scatter_group`, the output is summed over the group and this rank
    keeps its dim-0 shard. `fusion` (megafp8.fp8.linear.Fusion; its norm is not taken): with an
    activation, `x` is the activation's input and the cast computes it; `grad_from`, the output
    gradient comes cast already (an OutputGradient)."""
    if module.fp8_primary_weight:
        raise ValueError(
            f"{module}: its weight is held in FP8 with a delayed scale (FP8 primary weights), "
            f"which {type(context.recipe).__name__} cannot use: keep high-precision weights"
        )
    if fusion is not None and fusion.norm is not None:
        raise ValueError("the fine-grained casts do not compute a norm: apply it first")
    return _FineGrainedLinear.apply(
        x, module.weight, bias, module, context, gather_group, scatter_group, fusion
    )


def quantize_pair(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    recipe,
    saturation_out=None,
    rows: bool = True,
    columns: bool = True,
    column_group=None,
    col_sum_out: torch.Tensor | None = None,
    activation: str | None = None,
    activation_input: torch.Tensor | None = None,
) -> tuple[ScaledFp8 | None, ScaledFp8 | None]:
    """The 2-D `x` [M, K] cast for the GEMMs it enters under the fine-grained `recipe`: along
    its rows ([M, K], scales over K) and, transposed, along its columns ([K, M], scales over M),
    each when asked. On CUDA one fused read (megafp8.fp8.fine_grained_kernels); else torch.
    `column_group`: `x` is this rank's rows of a tensor split over that group, and a column's
    scale (rowwise: the whole column's) is fitted to the amax over every rank's rows.
    `col_sum_out` (fp32 [K]) takes the sums of the cast tensor's columns (a linear layer's
    bias gradient). `activation`, `activation_input`: the cast is of an activation of `x`, or of
    its gradient at `activation_input` (`x` the gradient of its output), which the fused read
    computes and nothing stores (elsewhere the torch ops run first)."""
    blockwise = recipe.granularity == "block"
    fused = fine_grained_kernels.runs_on(x) and (rows or columns)
    if activation is not None and not (
        fused and fine_grained_kernels.fuses(activation, x, activation_input)
    ):
        x = (
            activation_kernels.activation_torch(x, activation)
            if activation_input is None
            else activation_kernels.activation_backward_torch(x, activation_input, activation)
        )
        activation = activation_input = None
    if fused:
        return fine_grained_kernels.quantize_pair(
            x,
            fp8_dtype,
            blockwise,
            recipe.margin,
            recipe.power_of_two_scales,
            rows,
            columns,
            saturation_out,
            column_group=column_group,
            col_sum_out=col_sum_out,
            activation=activation,
            activation_input=activation_input,
        )
    if col_sum_out is not None:
        torch.sum(x, dim=0, dtype=torch.float32, out=col_sum_out)
    block, margin, power_of_two = (
        SCHEMES[recipe.granularity].block,
        recipe.margin,
        recipe.power_of_two_scales,
    )
    return (
        quantize_blocks(x, fp8_dtype, block, margin, saturation_out, power_of_two)
        if rows
        else None,
        quantize_blocks(
            x.t(),
            fp8_dtype,
            block,
            margin,
            saturation_out,
            power_of_two,
            None if blockwise else column_group,  # a 128-token block is one rank's own
        )
        if columns
        else None,
    )


def cast_output_gradient(source, producer, context: Fp8Context) -> OutputGradient:
    """`source` (megafp8.fp8.fused: the 2-D output gradient of Fp8Linear `producer`, not computed
    yet) cast for `producer`'s backward under `context`, a fine-grained fp8_autocast: an
    activation's gradient computed in the cast's read, another source materialized first."""
    weight, bias = producer.weight, producer.bias
    if isinstance(source, ActivationGradSource):
        x, activation, activation_input = source.dout, source.kind, source.h
    else:
        x, activation, activation_input = source.materialize(), None, None
    col_sum = (
        x.new_empty(weight.shape[0], dtype=torch.float32)
        if bias is not None and bias.requires_grad
        else None
    )
    rows, columns = quantize_pair(
        x,
        context.recipe.fp8_format.backward_dtype,
        context.recipe,
        _counts(producer, "grad_output", context),
        columns=weight.requires_grad,
        col_sum_out=col_sum,
        activation=activation,
        activation_input=activation_input,
    )
    return OutputGradient(rows, columns, col_sum)


def _counts(module, role: str, context: Fp8Context):
    return module.fp8_scaling[role].cast_counts if context.collect_saturation else None


def cast_weight(module, context: Fp8Context, out: WeightCasts | None = None) -> WeightCasts:
    """`module`'s weight cast for both of its GEMMs, its scales noted for the health metrics.
    `out`: the layer's earlier cast under the same recipe, written again in place (a CUDA graph
    captured its addresses)."""
    recipe = context.recipe
    weight, dtype = module.weight.detach(), recipe.fp8_format.forward_dtype
    counts = _counts(module, "weight", context)
    fused = fine_grained_kernels.runs_on(weight)
    if recipe.granularity == "row" and fused:
        rows, columns = fine_grained_kernels.quantize_pair(
            weight, dtype, False, recipe.margin, recipe.power_of_two_scales, True, True, counts, out
        )
    elif fused:
        rows, columns = fine_grained_kernels.quantize_squares(
            weight, dtype, recipe.margin, recipe.power_of_two_scales, counts, out
        )
    else:
        if recipe.granularity == "row":
            rows, columns = quantize_pair(weight, dtype, recipe, counts)
        else:  # the square blocks serve dgrad transposed
            rows = quantize_blocks(
                weight, dtype, (BLOCK, BLOCK), recipe.margin, counts, recipe.power_of_two_scales
            )
            columns = ScaledFp8(rows.data.t().contiguous(), rows.scale_inv.t().contiguous())
        if out is not None:
            for kept, new in zip((*out.rows, *out.columns), (*rows, *columns)):
                kept.copy_(new)
            rows, columns = out
    _note_scale(module, "weight", rows, context)
    return WeightCasts(rows, columns)


def _note_scale(module, role: str, q: ScaledFp8, context: Fp8Context) -> None:
    # What the health metrics read of a role's scale: the smallest of its blocks' (the tightest),
    # noted where they are collected, as the saturation counts are.
    if context.collect_saturation:
        module.fp8_scaling[role].scale.copy_(q.scale_inv.max().reciprocal())


def _casts_locally(recipe, rows: int) -> bool:
    """Whether a rank's `rows` of a tensor split over ranks cast as the whole tensor's rows would:
    a row's scale (rowwise) needs no other rank's data, nor does a 1 x 128 block's; the transposed
    cast's 128-token blocks must not straddle two ranks."""
    return recipe.granularity == "row" or rows % BLOCK == 0


def _gather_rows(q: ScaledFp8, group) -> ScaledFp8:
    """Every rank's row cast, concatenated along the rows: bytes and inverse scales (these kept
    outer-dim-major, gathered as the columns of their transpose)."""
    return ScaledFp8(
        collectives.all_gather(q.data, group),
        collectives.all_gather_columns(q.scale_inv.t(), group).t(),
    )


def _gather_columns(q: ScaledFp8, group, whole_rows: bool) -> ScaledFp8:
    """Every rank's transposed cast [K, rows of the rank], concatenated along the columns: the
    bytes, and the 128-token blocks' inverse scales; a whole row's scale (rowwise, fitted over
    every rank's columns) is each rank's already."""
    scale_inv = q.scale_inv if whole_rows else collectives.all_gather(q.scale_inv.t(), group).t()
    return ScaledFp8(collectives.all_gather_columns(q.data, group), scale_inv)


class _FineGrainedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, context: Fp8Context, gather, scatter, fusion):
        recipe = context.recipe
        activation = fusion.activation if fusion is not None else None
        gemm = SCHEMES[recipe.granularity].gemm
        fprop_hp, dgrad_hp, wgrad_hp = recipe.override_linear_precision
        forward_dtype = recipe.fp8_format.forward_dtype
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 if activation is not None else None  # this rank's, for the activation's backward
        wgrad_fp8 = weight.requires_grad and not wgrad_hp
        dgrad_fp8 = x.requires_grad and not dgrad_hp
        # Gathered in FP8 where only FP8 GEMMs take the input: each rank casts its own rows, and
        # the wgrad's transposed cast is gathered again in the backward (as tensorwise's).
        fp8_gather = (
            gather is not None
            and not fprop_hp
            and (wgrad_fp8 or not weight.requires_grad)
            and _casts_locally(recipe, x2.shape[0])
        )
        if gather is not None and not fp8_gather:
            x2 = collectives.all_gather(x2, gather)
        cast = module.fine_grained_weight_cast(context) if not fprop_hp or dgrad_fp8 else None
        qx, x_columns = quantize_pair(
            x2,
            forward_dtype,
            recipe,
            _counts(module, "input", context),
            rows=not fprop_hp,
            columns=wgrad_fp8,
            column_group=gather if fp8_gather else None,
            activation=activation,
        )
        if fp8_gather:
            qx = _gather_rows(qx, gather)
        # the GEMM adds the bias where it can, unless the output is summed over ranks first
        fuse_bias = (
            bias is not None
            and scatter is None
            and not fprop_hp
            and takes_bias(recipe.granularity, x2.device)
        )
        if fprop_hp:
            y = F.linear(x2, weight.to(x2.dtype))
        else:
            _note_scale(module, "input", qx, context)
            # the forward with fast accumulation, as tensorwise's
            y = gemm(qx, cast.rows, x2.dtype, fast_accum=True, bias=bias if fuse_bias else None)
        if scatter is not None:
            y = collectives.reduce_scatter(y, scatter)
        if bias is not None and not fuse_bias:
            y = y + bias.to(y.dtype)
        # For backward: the input per input channel (transposed), the weight per input channel.
        x_saved = x_columns if wgrad_fp8 else x2
        w_saved = cast.columns if dgrad_fp8 else None
        ctx.save_for_backward(
            *(x_saved if wgrad_fp8 else (x_saved,)),
            *(w_saved if dgrad_fp8 else (weight,)),
            *((h,) if activation is not None else ()),
        )
        ctx.fp8, ctx.module, ctx.context = (dgrad_fp8, wgrad_fp8), module, context
        ctx.fusion = fusion
        ctx.gather, ctx.scatter, ctx.has_bias = gather, scatter, bias is not None
        ctx.fp8_gather = fp8_gather
        ctx.input_shape, ctx.weight_dtype = x.shape, weight.dtype
        return y.view(-1, *x.shape[1:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        dgrad_fp8, wgrad_fp8 = ctx.fp8
        saved = list(ctx.saved_tensors)
        x_saved = ScaledFp8(saved.pop(0), saved.pop(0)) if wgrad_fp8 else saved.pop(0)
        w_saved = ScaledFp8(saved.pop(0), saved.pop(0)) if dgrad_fp8 else saved.pop(0)
        h = saved.pop(0) if saved else None  # the fused activation's input
        module, context, fusion = ctx.module, ctx.context, ctx.fusion
        gemm = SCHEMES[context.recipe.granularity].gemm
        backward_dtype = context.recipe.fp8_format.backward_dtype
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1])
        rows_fp8, columns_fp8 = need_dx and dgrad_fp8, need_dw and wgrad_fp8
        # the output gradient cast by what follows this layer (its activation's backward)
        handed = (
            fusion.grad_from.take(dy)
            if fusion is not None and fusion.grad_from is not None
            else None
        )
        # the output's gradient gathered in FP8 where only FP8 GEMMs take it, as the input
        fp8_gather = (
            ctx.scatter is not None
            and (rows_fp8 or not need_dx)
            and (columns_fp8 or not need_dw)
            and _casts_locally(context.recipe, dy2.shape[0])
        )
        if handed is not None:
            if ctx.scatter is not None:
                raise RuntimeError(
                    "a linear whose output is reduce-scattered cannot take its output gradient "
                    "cast by the layer after it (grad_from)"
                )
            qdy, dy_columns = handed.rows, handed.columns
            db = handed.col_sum if need_db and ctx.has_bias else None
        else:
            # the bias joined this rank's rows after the scatter: its gradient sums those rows,
            # in the pair cast's read of them where that cast is of this rank's rows
            db = (
                dy2.new_empty(dy2.shape[-1], dtype=torch.float32)
                if need_db and ctx.has_bias
                else None
            )
            if ctx.scatter is not None and not fp8_gather:
                if db is not None:
                    torch.sum(dy2, dim=0, dtype=torch.float32, out=db)
                dy2 = collectives.all_gather(dy2.contiguous(), ctx.scatter)
            qdy, dy_columns = quantize_pair(
                dy2,
                backward_dtype,
                context.recipe,
                _counts(module, "grad_output", context),
                rows=rows_fp8,
                columns=columns_fp8,
                column_group=ctx.scatter if fp8_gather else None,
                col_sum_out=db if ctx.scatter is None or fp8_gather else None,
            )
        whole_rows = context.recipe.granularity == "row"
        if fp8_gather:
            qdy = _gather_rows(qdy, ctx.scatter) if rows_fp8 else None
            dy_columns = (
                _gather_columns(dy_columns, ctx.scatter, whole_rows) if columns_fp8 else None
            )
        if ctx.fp8_gather and need_dw:
            x_saved = _gather_columns(x_saved, ctx.gather, whole_rows)
        dx = dw = None
        if need_dx:
            if dgrad_fp8:
                _note_scale(module, "grad_output", qdy, context)
                dx = gemm(qdy, w_saved, dy.dtype)
            else:
                dx = dy2 @ w_saved.to(dy.dtype)
            if ctx.gather is not None:
                dx = collectives.reduce_scatter(dx, ctx.gather)
            if h is not None:
                dx = fusion.activation_backward(dx, h)
            dx = dx.view(ctx.input_shape[:-1] + dx.shape[-1:])
        if need_dw:
            granularity = context.recipe.granularity
            main_grad = (
                getattr(module.weight, "main_grad", None)
                if module.fuse_wgrad_accumulation
                else None
            )
            if (
                wgrad_fp8
                and main_grad is not None
                and module.weight.main_grad_empty
                and writes_into(granularity, main_grad.dtype, dy2.device)
            ):
                # the step's first gradient, written by the GEMM into main_grad
                gemm_into(granularity, dy_columns, x_saved, claim_empty_main_grad(module.weight))
            else:
                if wgrad_fp8:
                    dw = gemm(dy_columns, x_saved, dy.dtype)
                else:
                    dw = dy2.t() @ x_saved.to(dy.dtype)
                dw = _into_main_grad(module, module.weight, dw, ctx.weight_dtype)
        if db is not None:
            db = _into_main_grad(module, module.bias, db, ctx.weight_dtype)
        return dx, dw, db, None, None, None, None, None


def _into_main_grad(module, param, grad: torch.Tensor, dtype: torch.dtype):
    """With gradient-accumulation fusion, `grad` is added into the parameter's main_grad and
    autograd gets none; else it is autograd's, in the parameter's dtype."""
    if module.fuse_wgrad_accumulation and getattr(param, "main_grad", None) is not None:
        accumulate_into_main_grad(param, grad)
        return None
    return grad.to(dtype)
