"""Vocabulary-parallel embedding and cross-entropy on tp = 2 and 4 gloo ranks against a single
process: same seed, same full batch on every rank."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megafp8.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

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
        assert (emb.vocab_start, emb.vocab_end) == (rank * VOCAB // world_size, (rank + 1) * VOCAB // world_size)
        assert torch.equal(emb.weight, full.weight[rows])

        ids = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)
        grad = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
        ref_out = ref(ids)
        ref_out.backward(grad)
        out = emb(ids)
        if sequence_parallel:  # each rank holds, and gets the gradient of, its sequence shard
            ref_out, grad = ref_out.chunk(world_size)[rank], grad.chunk(world_size)[rank]
        out.backward(grad)
        errors[sequence_parallel] = (rel_err(out, ref_out), rel_err(emb.weight.grad, ref.weight.grad[rows]))
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
                ref = F.cross_entropy(full.reshape(-1, real), target.view(-1), reduction="none", ignore_index=IGNORE,
                                      label_smoothing=smoothing).view(SEQ, BATCH)
                ref.backward(grad)
                local = logits.to(dtype).chunk(world_size, dim=-1)[rank].clone().requires_grad_()
                loss = vocab_parallel_cross_entropy(local, target, group, ignore_index=IGNORE, label_smoothing=smoothing,
                                                    vocab_size=real if padding else None)
                loss.backward(grad)
                assert loss.dtype == torch.float32 and local.grad.dtype == dtype
                assert not loss[0, :2].any() and not local.grad[0, :2].any(), "ignored tokens contribute"
                ref_grad = F.pad(full.grad, (0, padding)).chunk(world_size, dim=-1)[rank]  # no gradient on padding
                grad_err = rel_err(local.grad, ref_grad) if ref_grad.any() else float(local.grad.abs().max())
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
    return {"embedding": check_embedding(rank, world_size, group, generator),
            "cross_entropy": check_cross_entropy(rank, world_size, group, generator),
            "indivisible": indivisible}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def results(request):
    """One spawn per tp size runs every check; the tests below read its results."""
    return request.param, run_on_ranks(all_checks, request.param)


def test_embedding_matches_a_single_process_table(results):
    tp, by_rank = results
    for rank, result in enumerate(by_rank):
        for sequence_parallel, (out_err, grad_err) in result["embedding"].items():
            assert out_err < FP32_BOUND and grad_err < FP32_BOUND, (tp, rank, sequence_parallel, out_err, grad_err)


def test_cross_entropy_matches_the_full_logits(results):
    tp, by_rank = results
    for rank, result in enumerate(by_rank):
        for (dtype, smoothing, padding), (loss_err, grad_err) in result["cross_entropy"].items():
            grad_bound = BF16_GRAD_BOUND if dtype == torch.bfloat16 else FP32_BOUND
            assert loss_err < FP32_BOUND and grad_err < grad_bound, (tp, rank, dtype, smoothing, padding, loss_err,
                                                                       grad_err)


def test_a_vocabulary_that_does_not_divide_is_rejected(results):
    tp, by_rank = results
    for message in (result["indivisible"] for result in by_rank):
        assert message is not None and f"num_embeddings={2 * tp + 1}" in message and f"{tp} tensor-parallel" in message


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
