"""Model options: layers kept out of FP8, the FP8 output layer, selective recomputation."""

import pytest
import torch
from megafp8.models import TransformerLM, preset

from megafp8 import DelayedScaling, fp8_autocast

CONFIG = preset("llama-tiny")
TOKENS = torch.randint(0, CONFIG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
LABELS = torch.randint(0, CONFIG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))


def run(fp8=True, **options):
    torch.manual_seed(0)
    model = TransformerLM(CONFIG, **options)
    with fp8_autocast(enabled=fp8, recipe=DelayedScaling(amax_history_len=4)):
        loss = model(TOKENS, labels=LABELS)
    loss.mean().backward()
    return model, loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def fp8_passes(module):
    return max(state.update_count for state in module.fp8_scaling.values())


def test_first_and_last_layers_can_stay_out_of_fp8():
    model, loss, _ = run(first_last_layers_bf16=1)  # both layers of the tiny model
    assert all(fp8_passes(m) == 0 for m in model.modules() if hasattr(m, "fp8_scaling"))
    _, reference, _ = run(fp8=False)
    assert torch.equal(loss, reference)
    model, _, _ = run(first_last_layers_bf16=0)
    assert (
        fp8_passes(model.layers["0"].mlp.fc1) == 1
        and fp8_passes(model.layers["1"].attention.qkv) == 1
    )


def test_output_layer_runs_in_fp8_only_when_asked():
    model, _, _ = run()
    assert fp8_passes(model.output_layer) == 0
    model, _, _ = run(fp8_output_layer=True)
    assert fp8_passes(model.output_layer) == 1


def train(steps, fp8, **options):
    """Losses and final gradients of a few SGD steps: later steps' casts use scales that the
    end of each pass has changed since, which a recomputation must not pick up."""
    torch.manual_seed(0)
    model = TransformerLM(CONFIG, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with fp8_autocast(enabled=fp8, recipe=DelayedScaling(amax_history_len=4)):
            loss = model(TOKENS, labels=LABELS)
        loss.mean().backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses, {name: p.grad for name, p in model.named_parameters()}


RECOMPUTATIONS = {
    "selective": {"recompute": "selective"},
    "full": {"recompute": "full"},
    "full-uniform-2": {"recompute": "full", "recompute_num_layers": 2},
    "full-block-1": {"recompute": "full", "recompute_method": "block"},
}


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("recompute", list(RECOMPUTATIONS))
def test_recomputation_does_not_change_losses_or_gradients(recompute, fp8):
    losses, grads = train(3, fp8)
    recomputed_losses, recomputed = train(3, fp8, **RECOMPUTATIONS[recompute])
    for a, b in zip(losses, recomputed_losses):
        assert torch.equal(a, b)
    for name in grads:
        assert torch.equal(grads[name], recomputed[name]), name


def saved_for_backward(**options):
    """(elements saved for backward, of which saved by the recomputed units' checkpoints)."""
    torch.manual_seed(0)
    model = TransformerLM(preset("llama-tiny", num_layers=4), **options)
    count = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: count.append(t.numel()) or t, lambda t: t
    ):
        with fp8_autocast(recipe=DelayedScaling()):
            model(TOKENS, labels=LABELS)
    return sum(count)


def test_full_recomputation_keeps_only_unit_inputs():
    none = saved_for_backward()
    every_layer = saved_for_backward(recompute="full")
    assert every_layer < none / 2, (every_layer, none)
    # Groups of two layers keep half the inputs of single layers; the rest is the same.
    pairs = saved_for_backward(recompute="full", recompute_num_layers=2)
    layer_input = 32 * 2 * 64  # [seq, batch, hidden]
    assert every_layer - pairs == 2 * layer_input
    # Block: only the first N layers are recomputed, the others keep everything.
    blocks = [
        saved_for_backward(recompute="full", recompute_method="block", recompute_num_layers=n)
        for n in (1, 2, 3, 4)
    ]
    assert none > blocks[0] > blocks[1] > blocks[2] > blocks[3] == every_layer, (none, blocks)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="recompute must be one of"):
        TransformerLM(CONFIG, recompute="everything")
    with pytest.raises(ValueError, match="recompute_method must be one of"):
        TransformerLM(CONFIG, recompute="full", recompute_method="random")
    with pytest.raises(ValueError, match="recompute_num_layers must be a positive int"):
        TransformerLM(CONFIG, recompute="full", recompute_num_layers=0)
    with pytest.raises(
        ValueError, match="first_last_layers_bf16=3 must be between 0 and num_layers=2"
    ):
        TransformerLM(CONFIG, first_last_layers_bf16=3)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_documents_packed_in_a_sequence_see_only_themselves(name):
    from megafp8.models.documents import document_layout

    config = preset(name)
    eod = 0
    g = torch.Generator().manual_seed(4)
    first, second = (
        torch.randint(1, config.vocab_size, (1, 12), generator=g),
        torch.randint(1, config.vocab_size, (1, 20), generator=g),
    )
    first[0, -1] = eod
    packed = torch.cat([first, second], dim=1)
    documents, positions = document_layout(packed, eod)
    torch.manual_seed(0)
    model = TransformerLM(config).eval()
    with torch.no_grad():
        together = model(packed, document_ids=documents, position_ids=positions)
        alone = model(second)
        plain = model(packed)
    assert torch.allclose(together[:, 12:], alone, rtol=1e-5, atol=1e-5)
    # the first is unchanged
    assert torch.allclose(together[:, :12], plain[:, :12], rtol=1e-5, atol=1e-5)
    # without reset it would differ
    assert not torch.allclose(plain[:, 12:], alone, rtol=1e-3, atol=1e-3)
