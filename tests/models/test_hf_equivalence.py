"""Our GPT and Llama equal Hugging Face's GPT2LMHeadModel and LlamaForCausalLM (fp32, the same
weights through models/hf_mapping.py) on random tokens. The HF models are built from configs:
nothing is downloaded."""

import pytest
import torch
from megafp8.models.config import RopeScaling, preset
from megafp8.models.hf_mapping import from_hf_gpt2, from_hf_llama
from megafp8.models.transformer import TransformerLM
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from ..fp8.helpers import rel_err


def randomize(model):
    """Every parameter random (HF initialises biases to 0 and norms to 1, which would hide a
    wrong mapping of either)."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model.eval()


def load(ours, state):
    """Load converted weights: everything but the (fresh) FP8 scaling state must be there."""
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and missing and all(".fp8_scaling." in name for name in missing), (
        missing,
        unexpected,
    )
    return ours


def compare(ours, hf, vocab):
    """The larger of the normwise relative error and the largest elementwise difference
    relative to the largest logit."""
    tokens = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours.eval()(tokens)[..., :vocab]
    return max(rel_err(got, expected), ((got - expected).abs().max() / expected.abs().max()).item())


def test_gpt_equals_gpt2lmheadmodel():
    config = preset("gpt-tiny")
    hf = randomize(
        GPT2LMHeadModel(
            GPT2Config(
                vocab_size=config.vocab_size,
                n_positions=config.max_position_embeddings,
                n_embd=config.hidden_size,
                n_layer=config.num_layers,
                n_head=config.num_attention_heads,
                activation_function="gelu_new",
                layer_norm_epsilon=config.norm_epsilon,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    )
    ours = load(TransformerLM(config), from_hf_gpt2(hf.state_dict(), config))
    assert compare(ours, hf, config.vocab_size) < 1e-4


def llama_pair(config, rope_parameters):
    hf = randomize(
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=config.vocab_size,
                hidden_size=config.hidden_size,
                intermediate_size=config.ffn_size,
                num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.kv_heads,
                max_position_embeddings=config.max_position_embeddings,
                rms_norm_eps=config.norm_epsilon,
                rope_parameters=rope_parameters,
                tie_word_embeddings=False,
                attention_bias=False,
                mlp_bias=False,
            )
        )
    )
    ours = load(TransformerLM(config), from_hf_llama(hf.state_dict(), config))
    return ours, hf


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_llama_equals_llamaforcausallm(kv_heads):
    config = preset("llama-tiny", num_kv_heads=kv_heads)
    ours, hf = llama_pair(config, {"rope_type": "default", "rope_theta": config.rope_theta})
    assert compare(ours, hf, config.vocab_size) < 1e-4


def test_llama3_rope_scaling_equals_hf():
    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
    )
    config = preset("llama-tiny", rope_theta=500000.0, rope_scaling=scaling)
    ours, hf = llama_pair(
        config,
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    assert compare(ours, hf, config.vocab_size) < 1e-4
