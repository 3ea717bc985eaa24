"""TransformerConfig: preset shapes, parameter counts, vocabulary padding and validation."""

import dataclasses

import pytest
from megafp8.models.config import PRESETS, RopeScaling, TransformerConfig, preset

GPT_SHAPES = {  # name: (layers, hidden, heads), GPT-3 paper table 2.1
    "gpt-125m": (12, 768, 12),
    "gpt-350m": (24, 1024, 16),
    "gpt-760m": (24, 1536, 16),
    "gpt-1.3b": (24, 2048, 16),
    "gpt-2.7b": (32, 2560, 32),
    "gpt-6.7b": (32, 4096, 32),
}
LLAMA_SHAPES = {  # name: (layers, hidden, heads, kv heads, ffn, vocab, max positions, rope theta)
    "llama2-7b": (32, 4096, 32, 32, 11008, 32000, 4096, 10000.0),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000, 4096, 10000.0),
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 8192, 500000.0),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 8192, 500000.0),
    "llama-120m": (12, 768, 12, 4, 2048, 32000, 2048, 10000.0),
}


def shape(cfg):
    return cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads


@pytest.mark.parametrize("name", sorted(GPT_SHAPES))
def test_gpt_presets(name):
    cfg = preset(name)
    assert shape(cfg) == GPT_SHAPES[name]
    assert (cfg.kv_heads, cfg.ffn_size) == (cfg.num_attention_heads, 4 * cfg.hidden_size)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (50257, 2048)
    assert (cfg.normalization, cfg.norm_epsilon, cfg.activation) == ("layernorm", 1e-5, "gelu_tanh")
    assert cfg.position_embedding == "learned" and cfg.bias and cfg.tie_embeddings


@pytest.mark.parametrize("name", sorted(LLAMA_SHAPES))
def test_llama_presets(name):
    cfg = preset(name)
    got = (
        *shape(cfg),
        cfg.kv_heads,
        cfg.ffn_size,
        cfg.vocab_size,
        cfg.max_position_embeddings,
        cfg.rope_theta,
    )
    assert got == LLAMA_SHAPES[name]
    assert (cfg.normalization, cfg.norm_epsilon, cfg.activation) == ("rmsnorm", 1e-5, "swiglu")
    assert cfg.position_embedding == "rope" and cfg.rope_scaling is None
    assert not cfg.bias and not cfg.tie_embeddings


def test_tiny_presets_are_fp8_and_tp_friendly():
    gpt, llama = preset("gpt-tiny"), preset("llama-tiny")
    assert (*shape(gpt), gpt.vocab_size, gpt.max_position_embeddings) == (2, 64, 4, 1000, 128)
    assert (*shape(llama), llama.kv_heads, llama.ffn_size, llama.vocab_size) == (
        2,
        64,
        4,
        2,
        128,
        1000,
    )
    assert (llama.max_position_embeddings, llama.rope_theta, llama.position_embedding) == (
        128,
        10000.0,
        "rope",
    )
    for cfg in (gpt, llama):
        assert cfg.hidden_size % 16 == 0 and cfg.ffn_size % 16 == 0 and cfg.head_dim % 16 == 0
        cfg.validate_tensor_parallel(2)
    gpt.validate_tensor_parallel(4)


def test_every_preset_is_listed_and_constructs():
    assert set(PRESETS) == set(GPT_SHAPES) | set(LLAMA_SHAPES) | {"gpt-tiny", "llama-tiny"}
    for name, cfg in PRESETS.items():
        assert preset(name) == cfg


def test_derived_sizes():
    cfg = preset("llama3-70b")
    assert (cfg.head_dim, cfg.kv_heads, cfg.ffn_size) == (128, 8, 28672)


def test_parameter_counts():
    # Hugging Face's published counts (sum of p.numel() over LlamaForCausalLM).
    assert preset("llama2-7b").num_parameters() == 6_738_415_616
    assert preset("llama3-8b").num_parameters() == 8_030_261_248
    assert preset("gpt-125m").num_parameters() == pytest.approx(125e6, rel=0.01)
    # GPT-125M's size
    assert preset("llama-120m").num_parameters() == pytest.approx(125e6, rel=0.05)
    assert preset("gpt-1.3b").num_parameters() == pytest.approx(1.3e9, rel=0.02)
    # tp only pads the (tied) vocabulary: 50304 -> 50688 rows of 768.
    assert (
        preset("gpt-125m").num_parameters(4) - preset("gpt-125m").num_parameters()
        == (50688 - 50304) * 768
    )


def test_parameter_count_per_part():
    # llama-tiny by hand: embedding + output, 2 x (2 norms, qkv, proj, gate/up, down), final norm.
    h, vocab = 64, 1024
    layer = 2 * h + h * (4 + 2 * 2) * 16 + h * h + h * 2 * 128 + 128 * h
    assert preset("llama-tiny").num_parameters() == 2 * vocab * h + 2 * layer + h
    # gpt-tiny: tied embedding + positions; layernorm and linear layers with biases.
    layer = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)
    assert preset("gpt-tiny").num_parameters() == vocab * h + 128 * h + 2 * layer + 2 * h


@pytest.mark.parametrize("tp, padded", [(1, 50304), (2, 50432), (4, 50688)])
def test_padded_vocab_size(tp, padded):
    assert preset("gpt-125m").padded_vocab_size(tp) == padded


def test_padded_vocab_size_keeps_an_exact_multiple():
    assert preset("llama2-7b").padded_vocab_size() == 32000
    # 128256 = 1002 * 128 = 501 * 256: a multiple for tp 1 and 2, padded from tp 4 on.
    assert preset("llama3-8b").padded_vocab_size(2) == 128256
    assert preset("llama3-8b").padded_vocab_size(4) == 128512


def test_validate_tensor_parallel():
    preset("llama3-8b").validate_tensor_parallel(8)
    with pytest.raises(ValueError, match=r"tp_size=16 does not divide kv_heads=8"):
        preset("llama3-8b").validate_tensor_parallel(16)
    with pytest.raises(
        ValueError, match=r"tp_size=5 does not divide num_attention_heads=12.*1, 2, 3, 4, 6, 12"
    ):
        preset("gpt-125m").validate_tensor_parallel(5)
    with pytest.raises(ValueError, match=r"does not divide ffn_size=98"):
        TransformerConfig(1, 64, 4, 10, 8, ffn_hidden_size=98).validate_tensor_parallel(4)
    with pytest.raises(ValueError, match="tp_size"):
        preset("gpt-tiny").validate_tensor_parallel(0)


BASE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=1000,
    max_position_embeddings=128,
)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"num_layers": 0}, "num_layers"),
        ({"hidden_size": -64}, "hidden_size"),
        ({"vocab_size": 1000.0}, "vocab_size"),
        ({"max_position_embeddings": True}, "max_position_embeddings"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"ffn_hidden_size": 0}, "ffn_hidden_size"),
        ({"make_vocab_size_divisible_by": 0}, "make_vocab_size_divisible_by"),
        ({"hidden_size": 60, "num_attention_heads": 8}, r"hidden_size=60.*num_attention_heads=8"),
        ({"num_kv_heads": 3}, r"num_kv_heads=3.*num_attention_heads=4"),
        (
            {"hidden_size": 24, "num_attention_heads": 8, "position_embedding": "rope"},
            r"head_dim=3",
        ),
        ({"normalization": "batchnorm"}, r"normalization.*'layernorm', 'rmsnorm'.*'batchnorm'"),
        ({"activation": "relu"}, r"activation.*'gelu', 'gelu_tanh', 'swiglu'"),
        ({"position_embedding": "alibi"}, r"position_embedding.*'learned', 'rope'"),
        ({"position_embedding": "rope", "rope_theta": 0.0}, "rope_theta"),
        ({"rope_scaling": RopeScaling()}, r"rope_scaling.*position_embedding='learned'"),
        ({"hidden_dropout": 1.0}, "hidden_dropout"),
        ({"attention_dropout": -0.1}, "attention_dropout"),
        ({"norm_epsilon": 0.0}, "norm_epsilon"),
    ],
)
def test_validation_errors_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**{**BASE, **changes})


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"factor": 0.0}, "factor"),
        ({"low_freq_factor": 4.0, "high_freq_factor": 1.0}, "low_freq_factor"),
        ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ],
)
def test_rope_scaling_validation(changes, field):
    with pytest.raises(ValueError, match=field):
        RopeScaling(**changes)


def test_rope_scaling_with_rope():
    cfg = preset("llama3-8b", rope_scaling=RopeScaling(), max_position_embeddings=131072)
    assert (
        cfg.rope_scaling.factor == 8.0 and cfg.rope_scaling.original_max_position_embeddings == 8192
    )


def test_preset_unknown_name_lists_known():
    with pytest.raises(ValueError, match=r"unknown preset 'gpt-5'.*gpt-125m.*llama3-70b"):
        preset("gpt-5")


def test_overrides_are_applied_and_validated():
    cfg = preset("gpt-tiny", num_layers=3, hidden_dropout=0.1)
    assert (cfg.num_layers, cfg.hidden_dropout, cfg.hidden_size) == (3, 0.1, 64)
    assert PRESETS["gpt-tiny"].num_layers == 2  # the preset itself is untouched
    with pytest.raises(ValueError, match="num_attention_heads"):
        preset("gpt-tiny", num_attention_heads=5)
    with pytest.raises(ValueError, match="rope_scaling"):
        preset("gpt-tiny").replace(rope_scaling=RopeScaling())


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset("gpt-tiny").num_layers = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        RopeScaling().factor = 2.0


# ---- to_dict / from_dict: the model as a checkpoint records it ----------------------------------


def json_round_trip(cfg):
    import json

    return TransformerConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_json(name):
    assert json_round_trip(preset(name)) == preset(name)


def test_settings_without_a_flag_round_trip():
    llama31 = preset(
        "llama3-8b",
        rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072,
    )
    erf_gpt = preset(
        "gpt-tiny", activation="gelu", tie_embeddings=False, num_kv_heads=2, ffn_hidden_size=96
    )
    for cfg in (llama31, erf_gpt):
        assert json_round_trip(cfg) == cfg
    assert llama31.to_dict()["rope_scaling"] == {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert erf_gpt.to_dict()["rope_scaling"] is None


def test_from_dict_rejects_unknown_and_invalid_fields():
    values = preset("llama-tiny").to_dict()
    with pytest.raises(ValueError, match=r"unknown fields moe_experts, qk_norm .*newer megafp8"):
        TransformerConfig.from_dict({**values, "qk_norm": True, "moe_experts": 8})
    with pytest.raises(ValueError, match=r"rope_scaling has unknown field beta"):
        TransformerConfig.from_dict({**values, "rope_scaling": {"factor": 8.0, "beta": 1}})
    with pytest.raises(ValueError, match="rope_scaling.factor must be > 0"):
        TransformerConfig.from_dict({**values, "rope_scaling": {"factor": 0.0}})
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_attention_heads=4"):
        TransformerConfig.from_dict({**values, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="lacks hidden_size"):
        TransformerConfig.from_dict({k: v for k, v in values.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="mapping"):
        TransformerConfig.from_dict(["num_layers", 2])
    # A field added after the checkpoint was written takes its default.
    assert TransformerConfig.from_dict(
        {k: v for k, v in values.items() if k != "attention_dropout"}
    ) == preset("llama-tiny")
