"""Fused Triton kernels of the vocabulary-parallel cross-entropy, used on CUDA (the torch autograd
function in vocab_parallel.py is the CPU path and the reference).

The torch path keeps an fp32 copy of this rank's logits (the softmax; 3.3 GB for GPT-1.3B's
8 x 2048 tokens x 50304 columns) from forward to backward. Here nothing logits-sized in fp32
exists: forward reads the logits once and leaves four fp32 numbers per token; backward reads
the logits again, recomputes the softmax from the saved max and sum of exp, and writes the
gradient in the logits' dtype.

Both kernels run one program per token (a row of the logits) and walk its columns in blocks of
BLOCK_V, in fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the caller falls back to torch.
    triton = None


# 4096 columns at 8 warps: 16 per thread, two 16-byte loads of bf16, and 13 blocks for a
# 50304-column row. A starting point, not yet tuned on a GPU.
BLOCK_V = 4096
NUM_WARPS = 8

if triton is not None:

    @triton.jit
    def _row_start(ptr, row, inner, stride_outer, stride_inner):
        # Rows are [outer, inner] with two strides: the model's [b, s, V] logits are the transpose of
        # a contiguous [s, b, V] tensor, which no single row stride describes.
        return ptr + (row // inner) * stride_outer + (row % inner) * stride_inner

    @triton.jit
    def _load_fp32(row_ptr, cols, vocab_local):
        # Masked at the shard's width, padding included, not at the valid columns: the width is a
        # multiple of 128 (Megatron's padding), so the mask is constant over vector widths and the
        # loads vectorize; a mask at 50257 compiles to one 2-byte load per element.
        return tl.load(row_ptr + cols, mask=cols < vocab_local, other=0.0).to(tl.float32)

    @triton.jit
    def _statistics_kernel(
        logits_ptr,
        target_ptr,
        stats_ptr,
        rows,
        inner,
        stride_outer,
        stride_inner,
        vocab_start,
        vocab_local,
        valid,
        SMOOTHING: tl.constexpr,
        BLOCK_V: tl.constexpr,
        NUM_BLOCKS: tl.constexpr,
    ):
        # stats rows: max and sum of exp (relative to that max) over this shard's valid columns,
        # the target logit (0 where another rank owns the target), the sum of the valid logits.
        row = tl.program_id(0).to(tl.int64)
        logits_row = _row_start(logits_ptr, row, inner, stride_outer, stride_inner)
        running_max = tl.full((), float("-inf"), tl.float32)
        sum_exp = tl.zeros((), tl.float32)
        logit_sum = tl.zeros((), tl.float32)
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK_V + tl.arange(0, BLOCK_V)
            in_vocab = cols < valid
            x = tl.where(in_vocab, _load_fp32(logits_row, cols, vocab_local), float("-inf"))
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            # While the row has shown only -inf, shift by 0 instead: -inf - -inf would be NaN.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            sum_exp = sum_exp * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
            running_max = new_max
            if SMOOTHING:
                logit_sum += tl.sum(tl.where(in_vocab, x, 0.0), axis=0)
        local_target = tl.load(target_ptr + row) - vocab_start
        owned = (local_target >= 0) & (local_target < vocab_local)
        target_logit = tl.load(logits_row + local_target, mask=owned, other=0.0).to(tl.float32)
        tl.store(stats_ptr + row, running_max)
        tl.store(stats_ptr + rows + row, sum_exp)
        tl.store(stats_ptr + 2 * rows + row, target_logit)
        if SMOOTHING:
            tl.store(stats_ptr + 3 * rows + row, logit_sum)

    @triton.jit
    def _gradient_kernel(
        logits_ptr,
        target_ptr,
        logits_max_ptr,
        sum_exp_ptr,
        grad_loss_ptr,
        grad_ptr,
        inner,
        stride_outer,
        stride_inner,
        grad_stride_outer,
        grad_stride_inner,
        vocab_start,
        vocab_local,
        valid,
        ignore_index,
        target_weight,
        smoothing_per_column,
        SMOOTHING: tl.constexpr,
        BLOCK_V: tl.constexpr,
        NUM_BLOCKS: tl.constexpr,
    ):
        # (softmax − target_weight·one_hot − smoothing_per_column) · grad_loss, with the torch path's
        # order of operations; padding columns load as -inf, so their softmax and gradient are 0.
        row = tl.program_id(0).to(tl.int64)
        logits_row = _row_start(logits_ptr, row, inner, stride_outer, stride_inner)
        grad_row = _row_start(grad_ptr, row, inner, grad_stride_outer, grad_stride_inner)
        target = tl.load(target_ptr + row)
        local_target = target - vocab_start
        grad_loss = tl.load(grad_loss_ptr + row).to(tl.float32)
        grad_loss = tl.where(target == ignore_index, 0.0, grad_loss)
        logits_max = tl.load(logits_max_ptr + row)
        inverse_sum_exp = 1.0 / tl.load(sum_exp_ptr + row)
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK_V + tl.arange(0, BLOCK_V)
            in_vocab = cols < valid
            x = tl.where(in_vocab, _load_fp32(logits_row, cols, vocab_local), float("-inf"))
            grad = tl.exp(x - logits_max) * inverse_sum_exp - tl.where(
                cols == local_target, target_weight, 0.0
            )
            if SMOOTHING:
                grad -= tl.where(in_vocab, smoothing_per_column, 0.0)
            tl.store(
                grad_row + cols,
                (grad * grad_loss).to(grad_ptr.dtype.element_ty),
                mask=cols < vocab_local,
            )


def as_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits` [..., V] as [outer, inner, V] with unit column stride: a view where one exists
    (the model's transposed logits included), else a contiguous copy."""
    rows = logits.reshape(-1, 1, logits.shape[-1]) if logits.dim() < 3 else logits.flatten(0, -3)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _blocks(vocab_local: int) -> dict:
    """Block width and count for a shard of `vocab_local` columns. The count is a compile-time
    constant (the shard is one width for a whole run, so one compilation): Triton's interpreter,
    which runs these kernels in the CPU tests, cannot loop to a runtime bound with recent NumPy."""
    block = min(BLOCK_V, triton.next_power_of_2(max(vocab_local, 1)))
    return dict(BLOCK_V=block, NUM_BLOCKS=triton.cdiv(vocab_local, block))


def statistics(
    rows: torch.Tensor, target: torch.Tensor, vocab_start: int, valid: int, smoothing: bool
):
    """Per token of `rows` (from as_rows) and `target` [tokens] (contiguous, global ids): this
    shard's max and sum of exp(logit − max) over its `valid` first columns, the target logit
    (0 where the target is another shard's) and, with `smoothing`, the sum of the valid logits
    (else unset). Returns them as the rows of one fp32 [4, tokens] tensor."""
    outer, inner, vocab_local = rows.shape
    tokens = outer * inner
    stats = torch.empty((4, tokens), device=rows.device, dtype=torch.float32)
    _statistics_kernel[(tokens,)](
        rows,
        target,
        stats,
        tokens,
        inner,
        rows.stride(0),
        rows.stride(1),
        vocab_start,
        vocab_local,
        valid,
        SMOOTHING=smoothing,
        num_warps=NUM_WARPS,
        **_blocks(vocab_local),
    )
    return stats


def gradient(
    rows: torch.Tensor,
    target: torch.Tensor,
    logits_max: torch.Tensor,
    sum_exp: torch.Tensor,
    grad_loss: torch.Tensor,
    vocab_start: int,
    valid: int,
    vocab: int,
    ignore_index: int,
    label_smoothing: float,
) -> torch.Tensor:
    """The gradient of the loss with respect to `rows`, in their dtype and memory layout, from
    the global per-token max and sum of exp of forward. `target`, `logits_max`, `sum_exp` and
    `grad_loss` are contiguous [tokens]."""
    outer, inner, vocab_local = rows.shape
    # A fresh tensor, not the logits overwritten: this function cannot know that nothing else
    # reads them (a leaf, another loss on the same logits, the caller), and one buffer in the
    # logits' dtype is already no more than the torch path's fp32 softmax.
    grad = torch.empty_like(rows)
    _gradient_kernel[(outer * inner,)](
        rows,
        target,
        logits_max,
        sum_exp,
        grad_loss,
        grad,
        inner,
        rows.stride(0),
        rows.stride(1),
        grad.stride(0),
        grad.stride(1),
        vocab_start,
        vocab_local,
        valid,
        ignore_index,
        1.0 - label_smoothing,
        label_smoothing / vocab,
        SMOOTHING=label_smoothing > 0,
        num_warps=NUM_WARPS,
        **_blocks(vocab_local),
    )
    return grad
