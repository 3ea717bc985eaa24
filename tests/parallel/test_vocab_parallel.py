"""Vocabulary-parallel embedding and cross-entropy on tp = 2 and 4 gloo ranks against a single
process: same seed, same full batch on every rank. The cross-entropy's fused Triton kernels
against its torch path: on the CPU under Triton's interpreter, and on a GPU."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megafp8.parallel.vocab_parallel import (
    VocabParallelEmbedding,
    _FusedVocabParallelCrossEntropy,
    _VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)
from torch import nn

from megafp8 import triton_support

from ..multiprocess import run_on_ranks

SEQ, BATCH, HIDDEN, VOCAB = 8, 4, 16, 48  # VOCAB divides by 2 and 4; SEQ too (sequence parallel)
IGNORE = -100
FP32_BOUND = 1e-6
# bf16 logits: the loss is computed in fp32 from the same bf16 values as the fp32 reference, so
# only fp32 rounding separates them; the gradient is then rounded to bf16 once, a relative error
# of at most its unit roundoff 2^-8 (8 significant bits).
BF16_GRAD_BOUND = 2.0**-8


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output holds inf or NaN"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_embedding(rank, world_size, group, generator):
    errors = {}
    for sequence_parallel in (False, True):
        torch.manual_seed(1234)
        full = VocabParallelEmbedding(VOCAB, HIDDEN)  # tp = 1: the whole table
        torch.manual_seed(1234)
        emb = VocabParallelEmbedding(VOCAB, HIDDEN, group, sequence_parallel=sequence_parallel)
        ref = nn.Embedding.from_pretrained(full.weight.detach().clone(), freeze=False)
        rows = slice(emb.vocab_start, emb.vocab_end)
        assert (emb.vocab_start, emb.vocab_end) == (
            rank * VOCAB // world_size,
            (rank + 1) * VOCAB // world_size,
        )
        assert torch.equal(emb.weight, full.weight[rows])

        ids = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)
        grad = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
        ref_out = ref(ids)
        ref_out.backward(grad)
        out = emb(ids)
        if sequence_parallel:  # each rank holds, and gets the gradient of, its sequence shard
            ref_out, grad = ref_out.chunk(world_size)[rank], grad.chunk(world_size)[rank]
        out.backward(grad)
        errors[sequence_parallel] = (
            rel_err(out, ref_out),
            rel_err(emb.weight.grad, ref.weight.grad[rows]),
        )
    return errors


def check_cross_entropy(rank, world_size, group, generator):
    """Per (dtype, label smoothing, padding columns past the real vocabulary): errors of the loss
    and of this rank's gradient against F.cross_entropy on the real vocabulary."""
    errors = {}
    logits = torch.randn(SEQ, BATCH, VOCAB, generator=generator) * 4
    targets = torch.rand(SEQ, BATCH, generator=generator)
    grad = torch.rand(SEQ, BATCH, generator=generator) + 0.5
    for padding in (0, 5, 13):  # 13: tp = 4's last shard (12 columns) is all padding
        real = VOCAB - padding
        target = (targets * real).long()
        target[0, :2] = IGNORE
        for dtype in (torch.float32, torch.bfloat16):
            for smoothing in (0.0, 0.1):
                full = logits.to(dtype).float()[..., :real].detach().requires_grad_()
                ref = F.cross_entropy(
                    full.reshape(-1, real),
                    target.view(-1),
                    reduction="none",
                    ignore_index=IGNORE,
                    label_smoothing=smoothing,
                ).view(SEQ, BATCH)
                ref.backward(grad)
                local = logits.to(dtype).chunk(world_size, dim=-1)[rank].clone().requires_grad_()
                loss = vocab_parallel_cross_entropy(
                    local,
                    target,
                    group,
                    ignore_index=IGNORE,
                    label_smoothing=smoothing,
                    vocab_size=real if padding else None,
                )
                loss.backward(grad)
                assert loss.dtype == torch.float32 and local.grad.dtype == dtype
                assert not loss[0, :2].any() and not local.grad[0, :2].any(), (
                    "ignored tokens contribute"
                )
                # no gradient on padding
                ref_grad = F.pad(full.grad, (0, padding)).chunk(world_size, dim=-1)[rank]
                grad_err = (
                    rel_err(local.grad, ref_grad)
                    if ref_grad.any()
                    else float(local.grad.abs().max())
                )
                errors[dtype, smoothing, padding] = (rel_err(loss, ref), grad_err)
    return errors


def all_checks(rank, world_size):
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(0)  # the same full batch on every rank
    try:
        VocabParallelEmbedding(2 * world_size + 1, HIDDEN, group)
        indivisible = None
    except ValueError as error:
        indivisible = str(error)
    return {
        "embedding": check_embedding(rank, world_size, group, generator),
        "cross_entropy": check_cross_entropy(rank, world_size, group, generator),
        "indivisible": indivisible,
    }


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def results(request):
    """One spawn per tp size runs every check; the tests below read its results."""
    return request.param, run_on_ranks(all_checks, request.param)


def test_embedding_matches_a_single_process_table(results):
    tp, by_rank = results
    for rank, result in enumerate(by_rank):
        for sequence_parallel, (out_err, grad_err) in result["embedding"].items():
            assert out_err < FP32_BOUND and grad_err < FP32_BOUND, (
                tp,
                rank,
                sequence_parallel,
                out_err,
                grad_err,
            )


def test_cross_entropy_matches_the_full_logits(results):
    tp, by_rank = results
    for rank, result in enumerate(by_rank):
        for (dtype, smoothing, padding), (loss_err, grad_err) in result["cross_entropy"].items():
            grad_bound = BF16_GRAD_BOUND if dtype == torch.bfloat16 else FP32_BOUND
            assert loss_err < FP32_BOUND and grad_err < grad_bound, (
                tp,
                rank,
                dtype,
                smoothing,
                padding,
                loss_err,
                grad_err,
            )


def test_a_vocabulary_that_does_not_divide_is_rejected(results):
    tp, by_rank = results
    for message in (result["indivisible"] for result in by_rank):
        assert (
            message is not None
            and f"num_embeddings={2 * tp + 1}" in message
            and f"{tp} tensor-parallel" in message
        )


def test_without_a_group_both_match_torch():
    generator = torch.Generator().manual_seed(1)
    emb = VocabParallelEmbedding(VOCAB, HIDDEN)
    ids = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)
    assert torch.equal(emb(ids), F.embedding(ids, emb.weight))
    with pytest.raises(IndexError):
        emb(torch.tensor([VOCAB]))

    logits = torch.randn(SEQ, VOCAB, generator=generator, requires_grad=True)
    target = torch.randint(0, VOCAB, (SEQ,), generator=generator)
    loss = vocab_parallel_cross_entropy(logits, target)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    ref = F.cross_entropy(logits, target, reduction="none")
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    assert rel_err(loss, ref) < FP32_BOUND and rel_err(grad, ref_grad) < FP32_BOUND


def test_a_second_backward_fails_instead_of_reusing_the_consumed_softmax():
    logits = torch.randn(SEQ, VOCAB, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.zeros(SEQ, dtype=torch.long)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_target_that_does_not_match_the_logits_is_rejected():
    with pytest.raises(ValueError, match=r"target \(4, 2\) does not match logits \(4, 3, 10\)"):
        vocab_parallel_cross_entropy(torch.randn(4, 3, 10), torch.zeros(4, 2, dtype=torch.long))


# -- the fused Triton path ---------------------------------------------------------------------------

# Its gradient against the torch path's, elementwise: in bf16/fp16 one unit in the last place
# (the two round slightly different fp32 values, so they may land on neighbouring values), in
# fp32 a few units of fp32 rounding; plus an absolute 1e-6 where softmax − 1 or softmax − ε/V
# cancels and leaves fp32's absolute error of a probability (≤ 1) bare.
GRAD_TOLERANCE = {
    torch.bfloat16: dict(rtol=2.0**-7, atol=1e-6),
    torch.float16: dict(rtol=2.0**-10, atol=1e-6),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
}
# The loss: fp32 throughout in both, only the order of summation differs (and on a GPU Triton's
# exp, a few fp32 units); atol for a loss near 0, whose logits' magnitude is still ~10.
LOSS_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def both_paths(logits, target, group, smoothing, vocab_size, grad_loss):
    """(loss, gradient of the logits) of the fused and of the torch path, and whether the fused
    gradient has the logits' memory layout."""
    results = []
    for function in (_FusedVocabParallelCrossEntropy, _VocabParallelCrossEntropy):
        x = logits.detach().requires_grad_()
        loss = function.apply(x, target, group, IGNORE, smoothing, vocab_size)
        (grad,) = torch.autograd.grad(loss, x, grad_loss)
        results.append((loss, grad))
    return results, results[0][1].stride() == logits.stride()


def fused_checks(rank, world_size):
    """Runs in a process started with TRITON_INTERPRET=1. Logits [batch, seq, vocab/tp] as the
    model makes them, the transpose of a contiguous [seq, batch, vocab/tp]; 39 tokens of a
    10000-token vocabulary, so a row spans several 4096-column blocks."""
    seq, batch, vocab = 13, 3, 10000
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(seq, batch, vocab, generator=generator) * 4
    targets = torch.rand(batch, seq, generator=generator)
    grad_loss = torch.rand(batch, seq, generator=generator) + 0.5
    results = {}
    # 5: tp = 1's last block is partly padding; 5100: tp = 2's second shard is all padding, and
    # tp = 1's last block too.
    for padding in (0, 5, 5100):
        real = vocab - padding
        target = (targets * real).long()
        target[0, :2] = IGNORE
        for dtype in (torch.float32, torch.bfloat16):
            for smoothing in (0.0, 0.1):
                full = logits.to(dtype).double()[..., :real].transpose(0, 1).requires_grad_()
                ref = F.cross_entropy(
                    full.reshape(-1, real),
                    target.view(-1),
                    reduction="none",
                    ignore_index=IGNORE,
                    label_smoothing=smoothing,
                ).view(batch, seq)
                (ref_grad,) = torch.autograd.grad(ref, full, grad_loss.double())
                ref_grad = F.pad(ref_grad, (0, padding)).chunk(world_size, dim=-1)[rank]
                local = (
                    logits.to(dtype).chunk(world_size, dim=-1)[rank].contiguous().transpose(0, 1)
                )
                paths, same_layout = both_paths(
                    local, target, group, smoothing, real if padding else None, grad_loss
                )
                results[dtype, smoothing, padding] = dict(
                    paths=paths, same_layout=same_layout, ref=(ref, ref_grad)
                )
    return results


@pytest.mark.skipif(
    not triton_support.available(),
    reason="needs triton, whose interpreter runs the fused kernels on the CPU (pip install triton)",
)
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_kernels_match_the_torch_path_under_the_triton_interpreter(tp, monkeypatch):
    # The interpreter is chosen when triton is imported: in fresh processes, with it in their environment.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for rank, result in enumerate(run_on_ranks(fused_checks, tp)):
        for (dtype, smoothing, padding), checks in result.items():
            where = f"tp={tp} rank={rank} {dtype} smoothing={smoothing} padding={padding}"
            (loss, grad), (torch_loss, torch_grad) = checks["paths"]
            ref, ref_grad = checks["ref"]
            assert loss.dtype == torch.float32 and grad.dtype == dtype and checks["same_layout"], (
                where
            )
            assert not loss[0, :2].any() and not grad[0, :2].any(), (
                f"{where}: ignored tokens contribute"
            )
            torch.testing.assert_close(
                loss, torch_loss, **LOSS_TOLERANCE, msg=lambda m: f"{where}: {m}"
            )
            torch.testing.assert_close(
                grad, torch_grad, **GRAD_TOLERANCE[dtype], msg=lambda m: f"{where}: {m}"
            )
            # And against F.cross_entropy in fp64 (in fp32, its label-smoothing gradient is off by
            # ~1e-5 at this vocabulary). The interpreter casts fp32 to bf16 by truncation, not by
            # rounding to nearest as a GPU does: up to a unit in the last place, 2^-7, not 2^-8.
            grad_bound = 2 * BF16_GRAD_BOUND if dtype == torch.bfloat16 else FP32_BOUND
            grad_err = rel_err(grad, ref_grad) if ref_grad.any() else float(grad.abs().max())
            assert rel_err(loss, ref) < FP32_BOUND and grad_err < grad_bound, (
                where,
                rel_err(loss, ref),
                grad_err,
            )


# GPT-2's vocabulary, padded as Megatron does
GPU_BATCH, GPU_SEQ, GPU_VOCAB, GPU_REAL_VOCAB = (
    2,
    2048,
    50304,
    50257,
)


def gpu_batch(dtype):
    """The model's layout: [batch, seq, vocab] logits, the transpose of a contiguous [seq, batch, vocab]."""
    generator = torch.Generator(device="cuda").manual_seed(3)
    logits = (
        torch.randn(GPU_SEQ, GPU_BATCH, GPU_VOCAB, device="cuda", generator=generator) * 4
    ).to(dtype)
    target = torch.randint(
        0, GPU_REAL_VOCAB, (GPU_BATCH, GPU_SEQ), device="cuda", generator=generator
    )
    target[:, :7] = IGNORE
    grad_loss = torch.rand(GPU_BATCH, GPU_SEQ, device="cuda", generator=generator) + 0.5
    return logits.transpose(0, 1), target, grad_loss


@pytest.mark.gpu
@pytest.mark.skipif(not triton_support.available(), reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_fused_kernels_match_the_torch_path_on_gpu(dtype, smoothing):
    logits, target, grad_loss = gpu_batch(dtype)
    (loss, grad), (torch_loss, torch_grad) = both_paths(
        logits, target, None, smoothing, GPU_REAL_VOCAB, grad_loss
    )[0]
    torch.testing.assert_close(loss, torch_loss, **LOSS_TOLERANCE)
    torch.testing.assert_close(grad, torch_grad, **GRAD_TOLERANCE[dtype])
    assert not grad[..., GPU_REAL_VOCAB:].any() and not grad[:, :7].any(), (
        "padding or ignored tokens get gradient"
    )
    assert grad.stride() == logits.stride(), (
        "the gradient should keep the logits' layout (no copy behind the transpose)"
    )

    full = logits[..., :GPU_REAL_VOCAB].double().requires_grad_()
    ref = F.cross_entropy(
        full.reshape(-1, GPU_REAL_VOCAB),
        target.reshape(-1),
        reduction="none",
        ignore_index=IGNORE,
        label_smoothing=smoothing,
    ).view(target.shape)
    (ref_grad,) = torch.autograd.grad(ref, full, grad_loss.double())
    grad_bound = (
        BF16_GRAD_BOUND if dtype == torch.bfloat16 else 2.0**-11 if dtype == torch.float16 else 1e-5
    )
    assert (
        rel_err(loss, ref) < FP32_BOUND
        and rel_err(grad[..., :GPU_REAL_VOCAB], ref_grad) < grad_bound
    )


@pytest.mark.gpu
@pytest.mark.skipif(not triton_support.available(), reason="needs triton")
def test_fused_forward_and_backward_need_less_memory_than_the_torch_path():
    logits, target, grad_loss = gpu_batch(torch.bfloat16)
    logits.requires_grad_()
    peaks = {}
    for function in (_FusedVocabParallelCrossEntropy, _VocabParallelCrossEntropy):
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        function.apply(logits, target, None, IGNORE, 0.1, GPU_REAL_VOCAB).backward(grad_loss)
        torch.cuda.synchronize()
        peaks[function] = torch.cuda.max_memory_allocated() - before
    fused, reference = peaks[_FusedVocabParallelCrossEntropy], peaks[_VocabParallelCrossEntropy]
    # The torch path holds an fp32 copy of the logits and then its bf16 cast; the fused one only
    # the bf16 gradient: less than a single fp32 logits-sized buffer.
    assert fused < reference and fused < logits.numel() * 4, (fused, reference)
