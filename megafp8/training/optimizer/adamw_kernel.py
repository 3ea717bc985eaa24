"""AdamW over every fp32 master in one launch that also writes the model's (bf16) weights: the
fused optimizer pass of MixedPrecisionAdamW on CUDA. The CPU steps with torch.optim.AdamW.

torch's fused AdamW updates masters and moments in one launch; the model's bf16 copy then takes
another pass over the masters (a launch per parameter), and clipping a pass over the gradients.
Here one kernel reads master, gradient and moments once and writes master, moments and the
model's copy once; the clipping factor scales each gradient as it is read.

The arithmetic is that of torch's fused CUDA kernel (ATen's fused_adam_utils.cuh, fp32), in its
order, so that masters and moments come out bit for bit the same:

    p = fma(-(lr * wd), p, p)                   decoupled weight decay: nvcc contracts torch's
                                                `p -= lr * wd * p` into this fma
    m = fma(beta1, m, fma(-beta1, g, g))
    v = fma(beta2, v, fma(-beta2, g * g, g * g))
    p = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

with IEEE division and square root (Triton's `/` and tl.sqrt are approximate), no other
multiply-add contracted (enable_fp_fusion=False), and beta^t from torch.pow on the device, the
powf torch's kernel calls (libdevice's pow is no part of the interpreter the CPU tests run).

Layout: a table of addresses (master, gradient, exp_avg, exp_avg_sq, output), decay flags,
step indices and lengths, one column per tensor; and a table of chunks, (tensor, chunk index), one
program per chunk of CHUNK elements, so a launch covers tensors of any mix of sizes. The tables
are built once; a step costs the step-count increment, one torch.pow and one launch per output
dtype (one in practice; one more for the weights it casts, after zeroing their amaxes). Whether
to step and the clipping factor are read from the device (`control`), so a step is queued
before the gradient norm is known on the host.

Lean states (Megatron's precision-aware optimizer, TE's FusedAdam options): the moments may be
kept in bf16 (rounded to nearest even after each update, computed in fp32), the gradients read
in bf16 (a bf16 `main_grad`), and with `store_param_remainders` the fp32 master is no tensor of
its own: the bf16 output holds its high 16 bits (the master rounded half away from zero in its
bits) and an int16 its remainder, so `(high << 16) + remainder` is the fp32 master, exactly.

The first moment may also be kept in FP8 (E4M3, MS-AMP's O2 choice), in blocks of MOMENT_BLOCK
elements, each with its own power-of-two scale: the block's largest magnitude lands in
(224, 448], and a scale that is a power of two makes the fp32 values a checkpoint holds quantize
back to the same values (`quantize_moment`, the same rule on the CPU).

Weights of FP8 linears may be given a `WeightCast`: their tensors are then stepped by a second
kernel, tile by tile, which also writes the new weight's FP8 cast (both layouts, with its amax
and inverse scale) from the value it has just rounded, exactly what the next forward would make
with that scale. The separate cast would read the weight again and launch once per layer. An
FP8 primary weight (Fp8Linear.make_weight_fp8) is its own cast: its output is the cast's bytes,
cast from the fp32 master itself, with no high-precision copy written.
"""

from __future__ import annotations

import torch

from megafp8.fp8.formats import FP8_DTYPES
from megafp8.fp8.tensor import saturation_bound, underflow_bound
from megafp8.triton_support import INTERPRETING

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: MixedPrecisionAdamW steps with torch.optim.AdamW.
    triton = None
else:
    from megafp8.fp8.triton_kernels import cast_outcomes, to_fp8, transpose_stored_tile

CHUNK = 16 * 1024  # elements per program
# Elements per loop iteration of a program; Triton's interpreter, whose cost is per operation
# and not per element, takes a whole chunk at once (16 times faster CPU tests).
BLOCK = CHUNK if INTERPRETING else 1024
# Elements per scale of an FP8 first moment (a divisor of BLOCK: a block never straddles two)
MOMENT_BLOCK = 128
NUM_WARPS = 4
# The pass that casts weights steps TILES tiles of [TILE_ROWS, TILE_COLS] per program: on an H100,
# 9.8 ms for 0.81B parameters against 10.0 for the plain pass and separate casts; 64 x 128 tiles
# (the quantize kernel's) spilled registers, at 141 ms (benchmarks/RESULTS.md).
TILE_ROWS, TILE_COLS, TILES = 32, 32, 4


def available(device: torch.device) -> bool:
    """Whether the kernel runs on tensors of `device`: CUDA with triton, or any device in
    Triton's interpreter (TRITON_INTERPRET=1, which the CPU tests use)."""
    return triton is not None and (device.type == "cuda" or INTERPRETING)


if triton is not None:

    @triton.jit
    def _step_constants(tensors, count, total, powers, t, lr, weight_decay):
        # Tensor t's (step size, sqrt of the second bias correction, decay factor, decayed).
        # powers: beta1^t of every tensor, then beta2^t.
        decayed = tl.load(tensors + 5 * count + t) != 0
        index = tl.load(tensors + 6 * count + t)
        bias_correction1 = 1.0 - tl.load(powers + index)
        bias_correction2_sqrt = tl.sqrt_rn(1.0 - tl.load(powers + total + index))
        return tl.div_rn(lr, bias_correction1), bias_correction2_sqrt, lr * weight_decay, decayed

    @triton.jit
    def _address(tensors, row, count, t, DTYPE: tl.constexpr):
        # Tensor t's address in `row` of the table, as a pointer to DTYPE (bf16 as its bits:
        # _load_float and _store_float convert them, the interpreter's casts truncate).
        address = tl.load(tensors + row * count + t)
        if DTYPE == tl.bfloat16:
            return address.to(tl.pointer_type(tl.uint16))
        else:
            return address.to(tl.pointer_type(DTYPE))

    @triton.jit
    def _load_float(pointer, offsets, mask, DTYPE: tl.constexpr):
        # fp32 values of the elements at `offsets` (0 where masked) of a DTYPE tensor
        if DTYPE == tl.bfloat16:
            bits = tl.load(pointer + offsets, mask=mask, other=0)
            return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return tl.load(pointer + offsets, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _store_float(pointer, offsets, x, mask, DTYPE: tl.constexpr):
        # x rounded to nearest even into a DTYPE tensor
        if DTYPE == tl.bfloat16:
            tl.store(pointer + offsets, _bfloat16_bits(x), mask=mask)
        else:
            tl.store(pointer + offsets, x.to(DTYPE), mask=mask)

    @triton.jit
    def _load_master(master, out, offsets, mask, REMAINDERS: tl.constexpr):
        # The fp32 masters at `offsets`: stored whole, or as the bf16 output's bits over the
        # int16 remainder.
        if REMAINDERS:
            high = tl.load(out + offsets, mask=mask, other=0).to(tl.uint32) << 16
            low = tl.load(master + offsets, mask=mask, other=0).to(tl.int32)
            return (high + low.to(tl.uint32, bitcast=True)).to(tl.float32, bitcast=True)
        else:
            return tl.load(master + offsets, mask=mask, other=0.0)

    @triton.jit
    def _store_weight(
        master, out, offsets, p, mask, OUT_DTYPE: tl.constexpr, REMAINDERS: tl.constexpr
    ):
        # The new masters `p` into the output (the model's dtype) and, with remainders, the
        # int16 that completes the output's bits to p's; returns the output's values (fp32).
        # An FP8 output is an FP8 primary weight: the cast kernel writes it, scaled, from p.
        if OUT_DTYPE == tl.float8e4nv or OUT_DTYPE == tl.float8e5:
            return p
        elif REMAINDERS:
            bits = p.to(tl.uint32, bitcast=True)
            high = (bits + 0x8000) >> 16  # half away from zero: bits - (high << 16) is an int16
            low = (bits - (high << 16)).to(tl.int32, bitcast=True)
            tl.store(master + offsets, low.to(tl.int16), mask=mask)
            tl.store(out + offsets, high.to(tl.uint16), mask=mask)
            return (high << 16).to(tl.float32, bitcast=True)
        elif OUT_DTYPE == tl.bfloat16:
            bits = _bfloat16_bits(p)
            tl.store(out + offsets, bits, mask=mask)
            return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            tl.store(out + offsets, p.to(OUT_DTYPE), mask=mask)
            return p.to(OUT_DTYPE).to(tl.float32)

    _MOMENT_BLOCK = tl.constexpr(MOMENT_BLOCK)
    _E4M3_MAX = tl.constexpr(448.0)

    @triton.jit
    def _load_moment(moment, scales, offsets, mask):
        # An FP8 first moment's fp32 values at `offsets`: each byte times its block's scale.
        q = tl.load(moment + offsets, mask=mask, other=0.0).to(tl.float32)
        return q * tl.load(scales + offsets // _MOMENT_BLOCK, mask=mask, other=1.0)

    @triton.jit
    def _store_moment(moment, scales, offsets, m, mask):
        # `m` (fp32, at `offsets`: whole blocks from a block's start) into the FP8 first moment,
        # each block scaled by the power of two that puts its largest magnitude in (224, 448].
        blocks: tl.constexpr = m.shape[0] // _MOMENT_BLOCK
        magnitude = tl.reshape(tl.where(mask, tl.abs(m), 0.0), (blocks, _MOMENT_BLOCK))
        # 448 / amax, its mantissa dropped; an all-zero block takes the largest scale
        ratio = tl.minimum(tl.div_rn(_E4M3_MAX, tl.max(magnitude, axis=1)), 2.0**126)
        scale = ((ratio.to(tl.int32, bitcast=True) >> 23) << 23).to(tl.float32, bitcast=True)
        scaled = tl.reshape(tl.reshape(m, (blocks, _MOMENT_BLOCK)) * scale[:, None], m.shape)
        tl.store(moment + offsets, to_fp8(scaled, tl.float8e4nv), mask=mask)
        first = tl.reshape(offsets, (blocks, _MOMENT_BLOCK))
        in_tensor = tl.max(tl.reshape(mask.to(tl.int32), (blocks, _MOMENT_BLOCK)), axis=1) > 0
        tl.store(
            scales + tl.min(first, axis=1) // _MOMENT_BLOCK, tl.div_rn(1.0, scale), mask=in_tensor
        )

    @triton.jit
    def _step_elements(
        tensors,
        count,
        t,
        offsets,
        mask,
        apply,
        grad_scale,
        beta1,
        beta2,
        eps,
        step_size,
        bias_correction2_sqrt,
        decay,
        decayed,
        OUT_DTYPE: tl.constexpr,
        GRAD_DTYPE: tl.constexpr,
        EXP_AVG_DTYPE: tl.constexpr,
        EXP_AVG_SQ_DTYPE: tl.constexpr,
        REMAINDERS: tl.constexpr,
    ):
        # AdamW on tensor t's elements at `offsets`, torch's fused CUDA arithmetic (see the
        # module's docstring), unless not `apply`; writes the new masters and their rounding to
        # the output, and returns the output's values (fp32).
        master = _address(tensors, 0, count, t, tl.int16 if REMAINDERS else tl.float32)
        out = _address(tensors, 4, count, t, OUT_DTYPE)
        p = _load_master(master, out, offsets, mask, REMAINDERS)
        if apply:
            grad = _address(tensors, 1, count, t, GRAD_DTYPE)
            exp_avg = _address(tensors, 2, count, t, EXP_AVG_DTYPE)
            exp_avg_sq = _address(tensors, 3, count, t, EXP_AVG_SQ_DTYPE)
            g = _load_float(grad, offsets, mask, GRAD_DTYPE) * grad_scale
            if EXP_AVG_DTYPE == tl.float8e4nv:
                exp_avg_scales = _address(tensors, 8, count, t, tl.float32)
                m = _load_moment(exp_avg, exp_avg_scales, offsets, mask)
            else:
                m = _load_float(exp_avg, offsets, mask, EXP_AVG_DTYPE)
            v = _load_float(exp_avg_sq, offsets, mask, EXP_AVG_SQ_DTYPE)
            if decayed:  # a branch, not a multiply by 0: -0.0 stays -0.0 as in torch
                p = tl.fma(-decay, p, p)
            m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
            g2 = g * g
            v = tl.fma(beta2, v, tl.fma(-beta2, g2, g2))
            denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
            p = p - tl.div_rn(step_size * m, denom)
            if not REMAINDERS:
                tl.store(master + offsets, p, mask=mask)
            if EXP_AVG_DTYPE == tl.float8e4nv:
                _store_moment(exp_avg, exp_avg_scales, offsets, m, mask)
            else:
                _store_float(exp_avg, offsets, m, mask, EXP_AVG_DTYPE)
            _store_float(exp_avg_sq, offsets, v, mask, EXP_AVG_SQ_DTYPE)
        return _store_weight(master, out, offsets, p, mask, OUT_DTYPE, REMAINDERS)

    @triton.jit
    def _adamw_kernel(
        tensors,
        chunks,
        powers,
        count,
        total,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        control,
        OUT_DTYPE: tl.constexpr,
        GRAD_DTYPE: tl.constexpr,
        EXP_AVG_DTYPE: tl.constexpr,
        EXP_AVG_SQ_DTYPE: tl.constexpr,
        REMAINDERS: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
        saturation_bound=0.0,
        flush_bound=0.0,
        COUNT: tl.constexpr = False,
        BOUND_INCLUSIVE: tl.constexpr = False,
    ):
        # tensors rows: master, grad, exp_avg, exp_avg_sq, out addresses, decayed, index in the
        # step counts, numel, the FP8 first moment's block scales (else 0); a column per tensor.
        # An FP8 output (a slice of an FP8 primary weight) is cast with a scale: then also the
        # addresses of its scale, amax, scale_inv and (with COUNT) saturation counts, as the cast
        # kernel's. chunks: (column, chunk index) per program.
        # control: the gradients' factor (clipping) and whether to step at all. A step not taken
        # still writes the outputs, the masters' rounding (what they hold already, or for the
        # distributed optimizer the all-gather input, which its caller gathers either way).
        grad_scale = tl.load(control)
        apply = tl.load(control + 1) != 0.0
        program = tl.program_id(0)
        t = tl.load(chunks + 2 * program)
        chunk = tl.load(chunks + 2 * program + 1)
        numel = tl.load(tensors + 7 * count + t)
        step_size, bias_correction2_sqrt, decay, decayed = _step_constants(
            tensors, count, total, powers, t, lr, weight_decay
        )
        start = chunk.to(tl.int64) * CHUNK
        FP8_OUT: tl.constexpr = OUT_DTYPE == tl.float8e4nv or OUT_DTYPE == tl.float8e5
        if FP8_OUT:
            out = _address(tensors, 4, count, t, OUT_DTYPE)
            scale = tl.load(tl.load(tensors + 9 * count + t).to(tl.pointer_type(tl.float32)))
        amax = 0.0
        saturated = 0
        flushed = 0
        for i in range(0, CHUNK, BLOCK):
            offsets = start + i + tl.arange(0, BLOCK)
            mask = offsets < numel
            weight = _step_elements(
                tensors,
                count,
                t,
                offsets,
                mask,
                apply,
                grad_scale,
                beta1,
                beta2,
                eps,
                step_size,
                bias_correction2_sqrt,
                decay,
                decayed,
                OUT_DTYPE,
                GRAD_DTYPE,
                EXP_AVG_DTYPE,
                EXP_AVG_SQ_DTYPE,
                REMAINDERS,
            )
            if FP8_OUT:  # the cast kernel's cast, of a flat slice: no transpose
                magnitude = tl.where(
                    mask, tl.where(weight == weight, tl.abs(weight), float("inf")), 0.0
                )
                amax = tl.maximum(amax, tl.max(magnitude, axis=0))
                if COUNT:
                    hits, small = cast_outcomes(
                        tl.where(mask, tl.abs(weight * scale), 0.0),
                        saturation_bound,
                        flush_bound,
                        BOUND_INCLUSIVE,
                    )
                    saturated += tl.sum(hits, axis=0)
                    flushed += tl.sum(small, axis=0)
                tl.store(out + offsets, to_fp8(weight * scale, OUT_DTYPE), mask=mask)
        if FP8_OUT:
            tl.atomic_max(tl.load(tensors + 10 * count + t).to(tl.pointer_type(tl.float32)), amax)
            if COUNT:
                counts = tl.load(tensors + 12 * count + t).to(tl.pointer_type(tl.int64))
                tl.atomic_add(counts, saturated.to(tl.int64))
                tl.atomic_add(counts + 1, tl.minimum(numel - start, CHUNK).to(tl.int64))
                tl.atomic_add(counts + 2, flushed.to(tl.int64))
            if chunk == 0:
                scale_inv = tl.load(tensors + 11 * count + t).to(tl.pointer_type(tl.float32))
                tl.store(scale_inv, tl.div_rn(1.0, scale))

    @triton.jit
    def _adamw_cast_kernel(
        tensors,
        chunks,
        powers,
        count,
        total,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        control,
        OUT_DTYPE: tl.constexpr,
        GRAD_DTYPE: tl.constexpr,
        EXP_AVG_DTYPE: tl.constexpr,
        EXP_AVG_SQ_DTYPE: tl.constexpr,
        REMAINDERS: tl.constexpr,
        FP8_DTYPE: tl.constexpr,
        TILE_ROWS: tl.constexpr,
        TILE_COLS: tl.constexpr,
        TILES: tl.constexpr,
        saturation_bound=0.0,
        flush_bound=0.0,
        COUNT: tl.constexpr = False,
        BOUND_INCLUSIVE: tl.constexpr = False,
    ):
        # _adamw_kernel's step of 2-D weights, TILES consecutive [TILE_ROWS, TILE_COLS] tiles
        # (in row-major order of tiles) per program, that also casts the new weight to FP8 as
        # triton_kernels._quantize_kernel would cast the model's copy (the value just rounded to
        # OUT_DTYPE). tensors rows: _adamw_kernel's first seven, then rows, cols (multiples of
        # 16, as FP8 GEMMs need), and the addresses of the WeightCast's data, data_t, scale, amax
        # and scale_inv (and with COUNT its counts: quantize's saturation counts, on the product
        # the cast takes). chunks: (column, index of the program's first tile / TILES).
        grad_scale = tl.load(control)
        apply = tl.load(control + 1) != 0.0
        program = tl.program_id(0)
        t = tl.load(chunks + 2 * program)
        first_tile = tl.load(chunks + 2 * program + 1) * TILES
        M = tl.multiple_of(tl.load(tensors + 7 * count + t), 16)
        N = tl.multiple_of(tl.load(tensors + 8 * count + t), 16)
        data = _address(tensors, 9, count, t, FP8_DTYPE)
        data_t = _address(tensors, 10, count, t, FP8_DTYPE)
        scale = tl.load(tl.load(tensors + 11 * count + t).to(tl.pointer_type(tl.float32)))
        amax_ptr = tl.load(tensors + 12 * count + t).to(tl.pointer_type(tl.float32))
        scale_inv_ptr = tl.load(tensors + 13 * count + t).to(tl.pointer_type(tl.float32))
        step_size, bias_correction2_sqrt, decay, decayed = _step_constants(
            tensors, count, total, powers, t, lr, weight_decay
        )
        tiles_per_row = tl.cdiv(N, TILE_COLS)
        amax = 0.0
        saturated = 0
        cast = 0
        flushed = 0
        for i in range(TILES):
            tile = first_tile + i  # past the last row: all masked
            rows = (tile // tiles_per_row) * TILE_ROWS + tl.arange(0, TILE_ROWS)
            cols = tl.max_contiguous(
                tl.multiple_of(
                    (tile % tiles_per_row) * TILE_COLS + tl.arange(0, TILE_COLS), TILE_COLS
                ),
                TILE_COLS,
            )
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
            weight = _step_elements(
                tensors,
                count,
                t,
                offsets,
                mask,
                apply,
                grad_scale,
                beta1,
                beta2,
                eps,
                step_size,
                bias_correction2_sqrt,
                decay,
                decayed,
                OUT_DTYPE,
                GRAD_DTYPE,
                EXP_AVG_DTYPE,
                EXP_AVG_SQ_DTYPE,
                REMAINDERS,
            )
            # The cast: amax (a NaN counts as +inf), then the bytes and their transpose.
            magnitude = tl.where(
                mask, tl.where(weight == weight, tl.abs(weight), float("inf")), 0.0
            )
            amax = tl.maximum(amax, tl.max(tl.max(magnitude, axis=1), axis=0))
            if COUNT:
                hits, small = cast_outcomes(
                    tl.where(mask, tl.abs(weight * scale), 0.0),
                    saturation_bound,
                    flush_bound,
                    BOUND_INCLUSIVE,
                )
                saturated += tl.sum(tl.sum(hits, axis=1), axis=0)
                cast += tl.sum(tl.sum(mask.to(tl.int32), axis=1), axis=0)
                flushed += tl.sum(tl.sum(small, axis=1), axis=0)
            tl.store(data + offsets, to_fp8(weight * scale, FP8_DTYPE), mask=mask)
            mask_t = (cols[:, None] < N) & (rows[None, :] < M)
            transpose_stored_tile(data, data_t, rows[None, :], cols[:, None], mask_t, M, N)
        tl.atomic_max(amax_ptr, amax)
        if COUNT:
            counts = tl.load(tensors + 14 * count + t).to(tl.pointer_type(tl.int64))
            tl.atomic_add(counts, saturated.to(tl.int64))
            tl.atomic_add(counts + 1, cast.to(tl.int64))
            tl.atomic_add(counts + 2, flushed.to(tl.int64))
        if first_tile == 0:
            tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))

    @triton.jit
    def _bfloat16_bits(x):
        # Round to nearest even on the bits: what cvt.rn.bf16.f32 and torch's copy_ do for every
        # non-NaN value, written out because the interpreter's cast truncates.
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)


class MultiTensorAdamW:
    """AdamW over a fixed set of 1-D tensors: masters[i] with grads[i], exp_avgs[i],
    exp_avg_sqs[i], its step count steps[i] (one fp32 tensor holds them all) and outs[i], a
    contiguous tensor as long as masters[i] that receives the new master in its own dtype.
    `decayed[i]` says whether `weight_decay` applies to it. `casts[i]`, when given and not None,
    is a WeightCast (megafp8.fp8.tensor) of outs[i] viewed as its `data`'s [rows, cols] (outs in
    bf16 or fp32, or an FP8 primary weight's bytes: then outs[i] is the cast's `data`); or, for
    an FP8 output that is a flat slice of an FP8 primary weight (the distributed optimizer's),
    one whose `data` is outs[i] and `data_t` None: the slice is cast with the weight's scale
    and its amax maxed into the weight's (no transpose).
    Masters are fp32, or int16 remainders of bf16 outs (the module's docstring); gradients and
    moments fp32 or bf16, one dtype for each kind; first moments also FP8 E4M3, each with
    `exp_avg_scales[i]`, the fp32 inverse scale of each of its MOMENT_BLOCK-element blocks.
    Addresses are read once, here: the tensors must stay where they are (build another after
    replacing any)."""

    def __init__(
        self,
        masters,
        grads,
        exp_avgs,
        exp_avg_sqs,
        steps,
        outs,
        decayed,
        *,
        betas,
        eps,
        weight_decay,
        casts: list | None = None,
        exp_avg_scales: list | None = None,
    ):
        self.steps, self.count = steps, len(masters)
        self._written = [*masters, *exp_avgs, *exp_avg_sqs, *outs]
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        casts = casts if casts is not None else [None] * len(masters)
        for out, cast in zip(outs, casts):
            fp8_primary = out.dtype in FP8_DTYPES
            if fp8_primary and (cast is None or cast.data.data_ptr() != out.data_ptr()):
                raise ValueError(
                    "an FP8 output is an FP8 primary weight: give its WeightCast, whose data it is"
                )
            if cast is not None and cast.data_t is None and not fp8_primary:
                raise ValueError(
                    "a WeightCast without data_t casts a slice of an FP8 primary weight: its "
                    "output is the slice's FP8 bytes"
                )
            if cast is not None and (
                out.dtype not in (torch.bfloat16, torch.float32, cast.data.dtype)
                or cast.data.numel() != out.numel()
            ):
                raise ValueError(
                    f"a WeightCast of shape {tuple(cast.data.shape)} for a weight of "
                    f"{out.numel()} {out.dtype} elements: needs bf16 or fp32 (or the cast's own "
                    f"bytes), as many elements"
                )
        kinds = {}
        for kind, tensors, allowed in (
            ("master", masters, (torch.float32, torch.int16)),
            ("gradient", grads, (torch.float32, torch.bfloat16)),
            ("exp_avg", exp_avgs, (torch.float32, torch.bfloat16, torch.float8_e4m3fn)),
            ("exp_avg_sq", exp_avg_sqs, (torch.float32, torch.bfloat16)),
        ):
            dtypes = {t.dtype for t in tensors}
            if len(dtypes) != 1 or not dtypes <= set(allowed):
                raise ValueError(
                    f"{kind}s of dtypes {sorted(map(str, dtypes))}: give one of {allowed}"
                )
            kinds[kind] = dtypes.pop()
        # a cast of a 2-D weight, by the kernel that steps tiles
        tiled = [i for i, cast in enumerate(casts) if cast is not None and cast.data_t is not None]
        fp8_moments = kinds["exp_avg"] == torch.float8_e4m3fn
        if fp8_moments != (exp_avg_scales is not None) or (fp8_moments and tiled):
            raise ValueError(
                "FP8 first moments come with their block scales (exp_avg_scales), and step in the "
                "plain pass: give no casts of whole weights"
            )
        remainders = kinds["master"] == torch.int16
        if remainders and any(out.dtype != torch.bfloat16 for out in outs):
            raise ValueError(
                "int16 master remainders complete bf16 outputs: every out must be bf16"
            )
        state_dtypes = dict(
            GRAD_DTYPE=_triton_dtype(kinds["gradient"]),
            EXP_AVG_DTYPE=_triton_dtype(kinds["exp_avg"]),
            EXP_AVG_SQ_DTYPE=_triton_dtype(kinds["exp_avg_sq"]),
            REMAINDERS=remainders,
        )
        self._amaxes = [cast.amax for cast in casts if cast is not None]
        self._counts = [
            cast.counts for cast in casts if cast is not None and cast.counts is not None
        ]
        device = masters[0].device
        self._betas_column = torch.tensor(betas, dtype=torch.float32, device=device)[:, None]

        def table(members, *extra_rows):
            columns = [
                [t[i].data_ptr() for i in members]
                for t in (masters, grads, exp_avgs, exp_avg_sqs, outs)
            ]
            columns += [[int(decayed[i]) for i in members], members, *extra_rows]
            return torch.tensor(columns, dtype=torch.int64).to(device)

        def chunk_table(per_tensor):
            per_tensor = torch.tensor(per_tensor)
            column = torch.repeat_interleave(torch.arange(len(per_tensor)), per_tensor)
            first_chunk = torch.cumsum(per_tensor, 0) - per_tensor
            index = torch.arange(len(column)) - first_chunk[column]
            return torch.stack([column, index], dim=1).to(torch.int32).to(device), len(column)

        # (kernel, its dtype arguments, address table, chunk table, number of programs)
        self.launches = []
        plain = [i for i, cast in enumerate(casts) if cast is None or cast.data_t is None]
        scales = (
            [0] * len(masters) if exp_avg_scales is None else [s.data_ptr() for s in exp_avg_scales]
        )

        def plain_kind(i):  # a launch per kind: output dtype, counted
            return outs[i].dtype, casts[i] is not None and casts[i].counts is not None

        for dtype, counted in dict.fromkeys(plain_kind(i) for i in plain):
            members = [i for i in plain if plain_kind(i) == (dtype, counted)]
            chunks, programs = chunk_table([-(-masters[i].numel() // CHUNK) for i in members])
            rows = [[masters[i].numel() for i in members], [scales[i] for i in members]]
            fp8_options = {}
            if dtype in FP8_DTYPES:  # slices of FP8 primary weights: their casts' addresses
                rows += [
                    [getattr(casts[i], field).data_ptr() for i in members]
                    for field in ("scale", "amax", "scale_inv", *(("counts",) if counted else ()))
                ]
                bound, inclusive = saturation_bound(dtype)
                fp8_options = dict(
                    saturation_bound=bound,
                    flush_bound=underflow_bound(dtype),
                    COUNT=counted,
                    BOUND_INCLUSIVE=inclusive,
                )
            self.launches.append(
                (
                    _adamw_kernel,
                    dict(
                        OUT_DTYPE=_triton_dtype(dtype),
                        **state_dtypes,
                        BLOCK=BLOCK,
                        CHUNK=CHUNK,
                        **fp8_options,
                    ),
                    table(members, *rows),
                    chunks,
                    programs,
                )
            )

        def kind(i):  # a launch per kind: output dtype, cast dtype, counted
            return outs[i].dtype, casts[i].data.dtype, casts[i].counts is not None

        for dtypes in dict.fromkeys(kind(i) for i in tiled):
            members = [i for i in tiled if kind(i) == dtypes]
            shapes = [casts[i].data.shape for i in members]
            tiles = [-(-rows // TILE_ROWS) * -(-cols // TILE_COLS) for rows, cols in shapes]
            chunks, programs = chunk_table([-(-n // TILES) for n in tiles])
            # a row per WeightCast field given
            addresses = zip(*([t.data_ptr() for t in casts[i] if t is not None] for i in members))
            bound, inclusive = saturation_bound(dtypes[1])
            self.launches.append(
                (
                    _adamw_cast_kernel,
                    dict(
                        OUT_DTYPE=_triton_dtype(dtypes[0]),
                        **state_dtypes,
                        FP8_DTYPE=_triton_dtype(dtypes[1]),
                        TILE_ROWS=TILE_ROWS,
                        TILE_COLS=TILE_COLS,
                        TILES=TILES,
                        saturation_bound=bound,
                        flush_bound=underflow_bound(dtypes[1]),
                        COUNT=dtypes[2],
                        BOUND_INCLUSIVE=inclusive,
                    ),
                    table(
                        members,
                        [rows for rows, _ in shapes],
                        [cols for _, cols in shapes],
                        *addresses,
                    ),
                    chunks,
                    programs,
                )
            )

    @torch.no_grad()
    def step(self, lr, control):
        """One AdamW step of every tensor at learning rate `lr`, decided on the device: `control`
        is a float32 tensor [grad_scale, apply] beside the tensors; gradients are multiplied by
        grad_scale, and apply = 0 leaves masters, moments and step counts as they were (the
        outputs take the masters' rounding, as after any step, and the casts theirs). The host
        need not know either value, so it need not wait for the gradient norm before launching."""
        self.steps.add_(control[1])
        # [beta1^t; beta2^t]: the powf of torch's kernel
        powers = torch.pow(self._betas_column, self.steps)
        if self._amaxes:
            torch._foreach_zero_(self._amaxes + self._counts)
        for kernel, dtypes, tensors, chunks, programs in self.launches:
            kernel[(programs,)](
                tensors,
                chunks,
                powers,
                tensors.shape[1],
                self.count,
                lr,
                self.betas[0],
                self.betas[1],
                self.eps,
                self.weight_decay,
                control,
                **dtypes,
                num_warps=NUM_WARPS,
                enable_fp_fusion=False,
            )
        # The kernel writes through addresses, unseen by autograd's version counters: bump them,
        # as an in-place op would, so that whatever caches a function of a weight (the FP8
        # linears' weight casts) sees it changed.
        torch.autograd.graph.increment_version(self._written)


def _triton_dtype(dtype: torch.dtype):
    return {
        torch.float32: tl.float32,
        torch.bfloat16: tl.bfloat16,
        torch.float16: tl.float16,
        torch.float8_e4m3fn: tl.float8e4nv,
        torch.float8_e5m2: tl.float8e5,
    }[dtype]
