"""The model cut into pipeline stages: each stage holds exactly the full model's weights for its
layers, and the stages chained together compute the full model's loss and gradients."""

import pytest
import torch
from megafp8.models import TransformerLM, preset

# Whole layers, and stages that end after a layer's attention (the next one holds its MLP).
SPLITS = {"whole": ((0, 1), (1, 3), (3, 4)), "halves": ((0, 1.5), (1.5, 3.5), (3.5, 4))}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])  # tied and untied embeddings
def test_stages_compose_to_the_full_model(name, split):
    config = preset(name, num_layers=4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=g)
    labels = torch.randint(0, config.vocab_size, (2, 32), generator=g)
    full = TransformerLM(config)
    stages = [TransformerLM(config, layers=span) for span in SPLITS[split]]

    full_params = dict(full.named_parameters())
    for stage in stages:
        for param_name, param in stage.named_parameters():
            assert torch.equal(param, full_params[param_name]), param_name
    first, middle, last = stages
    assert first.pre_process and not first.post_process and hasattr(first, "embedding")
    assert not middle.pre_process and not middle.post_process and not hasattr(middle, "embedding")
    if split == "whole":
        assert list(middle.layers) == ["1", "2"]
    else:  # layer 1's attention on the first stage, its MLP on the middle one; 3 likewise
        assert list(first.layers) == ["0", "1"] and list(middle.layers) == ["1", "2", "3"]
        assert first.layers["1"].mlp is None and middle.layers["1"].attention is None
        assert middle.layers["3"].mlp is None and last.layers["3"].attention is None
        assert not any(".1.mlp" in n for n, _ in first.named_parameters())
    assert last.post_process and hasattr(last, "embedding") == config.tie_embeddings

    hidden = first(tokens)
    assert hidden.shape == (32, 2, config.hidden_size)  # [seq, batch, hidden] between stages
    loss = last(middle(hidden), labels)
    expected = full(tokens, labels)
    assert torch.allclose(loss, expected, rtol=1e-6, atol=1e-6)

    loss.mean().backward()
    expected.mean().backward()
    grads = {}
    for stage in stages:
        for param_name, param in stage.named_parameters():
            # The tied embedding's gradient is split between the first stage and the last's copy.
            grads[param_name] = (
                grads[param_name] + param.grad if param_name in grads else param.grad
            )
    assert set(grads) == {name for name, _ in full.named_parameters()}
    for param_name, param in full.named_parameters():
        assert torch.allclose(grads[param_name], param.grad, rtol=1e-5, atol=1e-7), param_name


def test_bad_layer_ranges_are_refused():
    config = preset("gpt-tiny")
    for span in ((1, 1), (0, 3), (-1, 1), (0, 1.25), (0.5, 0.5)):
        with pytest.raises(ValueError, match="must be a non-empty range"):
            TransformerLM(config, layers=span)
