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

Layout: a table of addresses (master, gradient, exp_avg, exp_avg_sq, output), lengths, decay
flags and step indices, one column per tensor; and a table of chunks, (tensor, chunk index), one
program per chunk of CHUNK elements, so a launch covers tensors of any mix of sizes. The tables
are built once; a step costs the step-count increment, one torch.pow and one launch per output
dtype (one in practice). Whether to step and the clipping factor are read from the device
(`control`), so a step is queued before the gradient norm is known on the host.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: MixedPrecisionAdamW steps with torch.optim.AdamW.
    triton = None

BLOCK = 1024  # elements per loop iteration of a program
CHUNK = 16 * BLOCK  # elements per program
NUM_WARPS = 4


def available(device: torch.device) -> bool:
    """Whether the kernel runs on tensors of `device`: CUDA with triton, or any device in
    Triton's interpreter (TRITON_INTERPRET=1, which the CPU tests use)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
    return triton is not None and (device.type == "cuda" or interpreting)


if triton is not None:

    @triton.jit
    def _adamw_kernel(
        tensors, chunks, powers, count, total, lr, beta1, beta2, eps, weight_decay, control,
        OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    ):
        # tensors rows: master, grad, exp_avg, exp_avg_sq, out addresses, numel, decayed, index
        # in the step counts; a column per tensor. chunks: (column, chunk index) per program.
        # control: the gradients' factor (clipping) and whether to step at all. A step not taken
        # still writes the outputs, the masters' rounding (what they hold already, or for the
        # distributed optimizer the all-gather input, which its caller gathers either way).
        grad_scale = tl.load(control)
        apply = tl.load(control + 1) != 0.0
        program = tl.program_id(0)
        t = tl.load(chunks + 2 * program)
        chunk = tl.load(chunks + 2 * program + 1)
        master = tl.load(tensors + t).to(tl.pointer_type(tl.float32))
        grad = tl.load(tensors + count + t).to(tl.pointer_type(tl.float32))
        exp_avg = tl.load(tensors + 2 * count + t).to(tl.pointer_type(tl.float32))
        exp_avg_sq = tl.load(tensors + 3 * count + t).to(tl.pointer_type(tl.float32))
        if OUT_DTYPE == tl.bfloat16:  # stored as bits, rounded below
            out = tl.load(tensors + 4 * count + t).to(tl.pointer_type(tl.uint16))
        else:
            out = tl.load(tensors + 4 * count + t).to(tl.pointer_type(OUT_DTYPE))
        numel = tl.load(tensors + 5 * count + t)
        decayed = tl.load(tensors + 6 * count + t) != 0
        index = tl.load(tensors + 7 * count + t)
        # powers: beta1^t of every tensor, then beta2^t.
        bias_correction1 = 1.0 - tl.load(powers + index)
        bias_correction2_sqrt = tl.sqrt_rn(1.0 - tl.load(powers + total + index))
        step_size = tl.div_rn(lr, bias_correction1)
        decay = lr * weight_decay
        start = chunk.to(tl.int64) * CHUNK
        for i in range(0, CHUNK, BLOCK):
            offsets = start + i + tl.arange(0, BLOCK)
            mask = offsets < numel
            p = tl.load(master + offsets, mask=mask)
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
            if OUT_DTYPE == tl.bfloat16:
                tl.store(out + offsets, _bfloat16_bits(p), mask=mask)
            else:
                tl.store(out + offsets, p.to(OUT_DTYPE), mask=mask)

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
    `decayed[i]` says whether `weight_decay` applies to it. Addresses are read once, here: the
    tensors must stay where they are (build another after replacing any)."""

    def __init__(self, masters, grads, exp_avgs, exp_avg_sqs, steps, outs, decayed, *, betas, eps, weight_decay):
        self.steps, self.count = steps, len(masters)
        self._written = [*masters, *exp_avgs, *exp_avg_sqs, *outs]
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        device = masters[0].device
        self._betas_column = torch.tensor(betas, dtype=torch.float32, device=device)[:, None]
        self.launches = []  # (out dtype, address table, chunk table, number of chunks)
        for dtype in dict.fromkeys(out.dtype for out in outs):
            members = [i for i, out in enumerate(outs) if out.dtype == dtype]
            columns = [[t[i].data_ptr() for i in members] for t in (masters, grads, exp_avgs, exp_avg_sqs, outs)]
            columns += [[masters[i].numel() for i in members], [int(decayed[i]) for i in members], members]
            tensors = torch.tensor(columns, dtype=torch.int64).to(device)
            per_tensor = torch.tensor([-(-masters[i].numel() // CHUNK) for i in members])
            column = torch.repeat_interleave(torch.arange(len(members)), per_tensor)
            first_chunk = torch.cumsum(per_tensor, 0) - per_tensor
            index = torch.arange(len(column)) - first_chunk[column]
            chunks = torch.stack([column, index], dim=1).to(torch.int32).to(device)
            self.launches.append((_triton_dtype(dtype), tensors, chunks, len(column)))

    @torch.no_grad()
    def step(self, lr, control):
        """One AdamW step of every tensor at learning rate `lr`, decided on the device: `control`
        is a float32 tensor [grad_scale, apply] beside the tensors; gradients are multiplied by
        grad_scale, and apply = 0 leaves masters, moments and step counts as they were (the
        outputs take the masters' rounding, as after any step). The host
        need not know either value, so it need not wait for the gradient norm before launching."""
        self.steps.add_(control[1])
        powers = torch.pow(self._betas_column, self.steps)  # [beta1^t; beta2^t]: the powf of torch's kernel
        for out_dtype, tensors, chunks, num_chunks in self.launches:
            _adamw_kernel[(num_chunks,)](
                tensors, chunks, powers, tensors.shape[1], self.count, lr, self.betas[0], self.betas[1],
                self.eps, self.weight_decay, control, OUT_DTYPE=out_dtype, BLOCK=BLOCK, CHUNK=CHUNK,
                num_warps=NUM_WARPS, enable_fp_fusion=False)
        # The kernel writes through addresses, unseen by autograd's version counters: bump them,
        # as an in-place op would, so that whatever caches a function of a weight (the FP8
        # linears' weight casts) sees it changed.
        torch.autograd.graph.increment_version(self._written)


def _triton_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
