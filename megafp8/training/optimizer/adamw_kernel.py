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

Weights of FP8 linears may be given a `WeightCast`: their tensors are then stepped by a second
kernel, tile by tile, which also writes the new weight's FP8 cast (both layouts, with its amax
and inverse scale) from the value it has just rounded, exactly what the next forward would make
with that scale. The separate cast would read the weight again and launch once per layer.
"""

from __future__ import annotations

import torch

from megafp8.triton_support import INTERPRETING

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: MixedPrecisionAdamW steps with torch.optim.AdamW.
    triton = None
else:
    from megafp8.fp8.triton_kernels import to_fp8, transpose_stored_tile

BLOCK = 1024  # elements per loop iteration of a program
CHUNK = 16 * BLOCK  # elements per program
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
    def _state_pointers(tensors, count, t):
        # Tensor t's master, gradient, exp_avg and exp_avg_sq (fp32).
        return (
            tl.load(tensors + t).to(tl.pointer_type(tl.float32)),
            tl.load(tensors + count + t).to(tl.pointer_type(tl.float32)),
            tl.load(tensors + 2 * count + t).to(tl.pointer_type(tl.float32)),
            tl.load(tensors + 3 * count + t).to(tl.pointer_type(tl.float32)),
        )

    @triton.jit
    def _step_elements(
        master,
        grad,
        exp_avg,
        exp_avg_sq,
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
    ):
        # AdamW on the elements at `offsets`, torch's fused CUDA arithmetic (see the module's
        # docstring), unless not `apply`; returns the (new) master values.
        p = tl.load(master + offsets, mask=mask, other=0.0)
        if apply:
            g = tl.load(grad + offsets, mask=mask) * grad_scale
            m = tl.load(exp_avg + offsets, mask=mask)
            v = tl.load(exp_avg_sq + offsets, mask=mask)
            if decayed:  # a branch, not a multiply by 0: -0.0 stays -0.0 as in torch
                p = tl.fma(-decay, p, p)
            m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
            g2 = g * g
            v = tl.fma(beta2, v, tl.fma(-beta2, g2, g2))
            denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
            p = p - tl.div_rn(step_size * m, denom)
            tl.store(master + offsets, p, mask=mask)
            tl.store(exp_avg + offsets, m, mask=mask)
            tl.store(exp_avg_sq + offsets, v, mask=mask)
        return p

    @triton.jit
    def _out_pointer(tensors, count, t, OUT_DTYPE: tl.constexpr):
        if OUT_DTYPE == tl.bfloat16:  # stored as bits, rounded by _bfloat16_bits
            return tl.load(tensors + 4 * count + t).to(tl.pointer_type(tl.uint16))
        else:
            return tl.load(tensors + 4 * count + t).to(tl.pointer_type(OUT_DTYPE))

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
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        # tensors rows: master, grad, exp_avg, exp_avg_sq, out addresses, decayed, index in the
        # step counts, numel; a column per tensor. chunks: (column, chunk index) per program.
        # control: the gradients' factor (clipping) and whether to step at all. A step not taken
        # still writes the outputs, the masters' rounding (what they hold already, or for the
        # distributed optimizer the all-gather input, which its caller gathers either way).
        grad_scale = tl.load(control)
        apply = tl.load(control + 1) != 0.0
        program = tl.program_id(0)
        t = tl.load(chunks + 2 * program)
        chunk = tl.load(chunks + 2 * program + 1)
        master, grad, exp_avg, exp_avg_sq = _state_pointers(tensors, count, t)
        out = _out_pointer(tensors, count, t, OUT_DTYPE)
        numel = tl.load(tensors + 7 * count + t)
        step_size, bias_correction2_sqrt, decay, decayed = _step_constants(
            tensors, count, total, powers, t, lr, weight_decay
        )
        start = chunk.to(tl.int64) * CHUNK
        for i in range(0, CHUNK, BLOCK):
            offsets = start + i + tl.arange(0, BLOCK)
            mask = offsets < numel
            p = _step_elements(
                master,
                grad,
                exp_avg,
                exp_avg_sq,
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
            )
            if OUT_DTYPE == tl.bfloat16:
                tl.store(out + offsets, _bfloat16_bits(p), mask=mask)
            else:
                tl.store(out + offsets, p.to(OUT_DTYPE), mask=mask)

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
        FP8_DTYPE: tl.constexpr,
        TILE_ROWS: tl.constexpr,
        TILE_COLS: tl.constexpr,
        TILES: tl.constexpr,
    ):
        # _adamw_kernel's step of 2-D weights, TILES consecutive [TILE_ROWS, TILE_COLS] tiles
        # (in row-major order of tiles) per program, that also casts the new weight to FP8 as
        # triton_kernels._quantize_kernel would cast the model's copy (the value just rounded to
        # OUT_DTYPE). tensors rows: _adamw_kernel's first seven, then rows, cols (multiples of
        # 16, as FP8 GEMMs need), and the addresses of the WeightCast's data, data_t, scale, amax
        # and scale_inv. chunks: (column, index of the program's first tile / TILES).
        grad_scale = tl.load(control)
        apply = tl.load(control + 1) != 0.0
        program = tl.program_id(0)
        t = tl.load(chunks + 2 * program)
        first_tile = tl.load(chunks + 2 * program + 1) * TILES
        master, grad, exp_avg, exp_avg_sq = _state_pointers(tensors, count, t)
        out = _out_pointer(tensors, count, t, OUT_DTYPE)
        M = tl.multiple_of(tl.load(tensors + 7 * count + t), 16)
        N = tl.multiple_of(tl.load(tensors + 8 * count + t), 16)
        data = tl.load(tensors + 9 * count + t).to(tl.pointer_type(FP8_DTYPE))
        data_t = tl.load(tensors + 10 * count + t).to(tl.pointer_type(FP8_DTYPE))
        scale = tl.load(tl.load(tensors + 11 * count + t).to(tl.pointer_type(tl.float32)))
        amax_ptr = tl.load(tensors + 12 * count + t).to(tl.pointer_type(tl.float32))
        scale_inv_ptr = tl.load(tensors + 13 * count + t).to(tl.pointer_type(tl.float32))
        step_size, bias_correction2_sqrt, decay, decayed = _step_constants(
            tensors, count, total, powers, t, lr, weight_decay
        )
        tiles_per_row = tl.cdiv(N, TILE_COLS)
        amax = 0.0
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
            p = _step_elements(
                master,
                grad,
                exp_avg,
                exp_avg_sq,
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
            )
            if OUT_DTYPE == tl.bfloat16:
                bits = _bfloat16_bits(p)
                tl.store(out + offsets, bits, mask=mask)
                weight = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                tl.store(out + offsets, p.to(OUT_DTYPE), mask=mask)
                weight = p.to(OUT_DTYPE).to(tl.float32)
            # The cast: amax (a NaN counts as +inf), then the bytes and their transpose.
            magnitude = tl.where(
                mask, tl.where(weight == weight, tl.abs(weight), float("inf")), 0.0
            )
            amax = tl.maximum(amax, tl.max(tl.max(magnitude, axis=1), axis=0))
            tl.store(data + offsets, to_fp8(weight * scale, FP8_DTYPE), mask=mask)
            mask_t = (cols[:, None] < N) & (rows[None, :] < M)
            transpose_stored_tile(data, data_t, rows[None, :], cols[:, None], mask_t, M, N)
        tl.atomic_max(amax_ptr, amax)
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
    """AdamW over a fixed set of 1-D fp32 tensors: masters[i] with grads[i], exp_avgs[i],
    exp_avg_sqs[i], its step count steps[i] (one fp32 tensor holds them all) and outs[i], a
    contiguous tensor as long as masters[i] that receives the new master in its own dtype.
    `decayed[i]` says whether `weight_decay` applies to it. `casts[i]`, when given and not None,
    is a WeightCast (megafp8.fp8.tensor) of outs[i] viewed as its `data`'s [rows, cols] (outs in bf16 or fp32).
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
    ):
        self.steps, self.count = steps, len(masters)
        self._written = [*masters, *exp_avgs, *exp_avg_sqs, *outs]
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        casts = casts if casts is not None else [None] * len(masters)
        for out, cast in zip(outs, casts):
            if cast is not None and (
                out.dtype not in (torch.bfloat16, torch.float32) or cast.data.numel() != out.numel()
            ):
                raise ValueError(
                    f"a WeightCast of shape {tuple(cast.data.shape)} for a weight of "
                    f"{out.numel()} {out.dtype} elements: needs bf16 or fp32, as many elements"
                )
        self._amaxes = [cast.amax for cast in casts if cast is not None]
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
        plain = [i for i in range(len(masters)) if casts[i] is None]
        for dtype in dict.fromkeys(outs[i].dtype for i in plain):
            members = [i for i in plain if outs[i].dtype == dtype]
            chunks, programs = chunk_table([-(-masters[i].numel() // CHUNK) for i in members])
            self.launches.append(
                (
                    _adamw_kernel,
                    dict(OUT_DTYPE=_triton_dtype(dtype), BLOCK=BLOCK, CHUNK=CHUNK),
                    table(members, [masters[i].numel() for i in members]),
                    chunks,
                    programs,
                )
            )
        cast = [i for i in range(len(masters)) if casts[i] is not None]
        for dtypes in dict.fromkeys((outs[i].dtype, casts[i].data.dtype) for i in cast):
            members = [i for i in cast if (outs[i].dtype, casts[i].data.dtype) == dtypes]
            shapes = [casts[i].data.shape for i in members]
            tiles = [-(-rows // TILE_ROWS) * -(-cols // TILE_COLS) for rows, cols in shapes]
            chunks, programs = chunk_table([-(-n // TILES) for n in tiles])
            # a row per WeightCast field
            addresses = zip(*([t.data_ptr() for t in casts[i]] for i in members))
            self.launches.append(
                (
                    _adamw_cast_kernel,
                    dict(
                        OUT_DTYPE=_triton_dtype(dtypes[0]),
                        FP8_DTYPE=_triton_dtype(dtypes[1]),
                        TILE_ROWS=TILE_ROWS,
                        TILE_COLS=TILE_COLS,
                        TILES=TILES,
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
            torch._foreach_zero_(self._amaxes)
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
