"""TransformerConfig: the shape of a GPT or Llama model, validated when built, and named presets.

Field names follow Megatron-LM; the shapes map one-to-one to Hugging Face's GPT2LMHeadModel and
LlamaForCausalLM so that checkpoints convert exactly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megafp8.messages import check_integer

NORMALIZATIONS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")  # gelu: erf; gelu_tanh: GPT-2's approximation
POSITION_EMBEDDINGS = ("learned", "rope")


def _check_choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _check_keys(what: str, values: dict, cls) -> None:
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(
            f"{what} has unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            "(written by a newer megafp8?)"
        )


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's "llama3" RoPE frequency scaling, with the fields of Hugging Face's rope_scaling dict."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor!r}")
        # The smoothing between the two bands divides by (high - low).
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor!r}, high_freq_factor={self.high_freq_factor!r}"
            )
        check_integer(
            "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings
        )


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer. Optional sizes left as None take their GPT defaults."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # the tokenizer's vocabulary, unpadded
    max_position_embeddings: int  # longest sequence (GPT: size of the learned position table)
    num_kv_heads: int | None = None  # None -> num_attention_heads (no GQA)
    ffn_hidden_size: int | None = None  # None -> 4 * hidden_size
    normalization: str = "layernorm"
    norm_epsilon: float = 1e-5
    activation: str = "gelu_tanh"
    position_embedding: str = "learned"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = True
    bias: bool = True  # in the linear layers; LayerNorm keeps its own bias regardless
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self):
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
            "max_position_embeddings",
            "make_vocab_size_divisible_by",
        ):
            check_integer(name, getattr(self, name))
        for name in ("num_kv_heads", "ffn_hidden_size"):
            if getattr(self, name) is not None:
                check_integer(name, getattr(self, name))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_kv_heads={self.kv_heads} must divide num_attention_heads={self.num_attention_heads} "
                "(each key/value head serves an equal group of query heads)"
            )
        _check_choice("normalization", self.normalization, NORMALIZATIONS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        if self.position_embedding == "rope":
            if self.head_dim % 2:
                raise ValueError(
                    f"head_dim={self.head_dim} must be even for rope (it rotates pairs of channels)"
                )
            if not self.rope_theta > 0:
                raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        elif self.rope_scaling is not None:
            raise ValueError(
                f"rope_scaling is set but position_embedding={self.position_embedding!r}; "
                "it needs position_embedding='rope'"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if not self.norm_epsilon > 0:
            raise ValueError(f"norm_epsilon must be > 0, got {self.norm_epsilon!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Megatron's padding: round the vocabulary up so every tp rank gets an equal,
        GEMM-friendly slice of the embedding and output layer."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple

    def validate_tensor_parallel(self, tp_size: int) -> None:
        """Raise ValueError unless tp_size splits the heads, key/value heads and MLP evenly."""
        check_integer("tp_size", tp_size)
        sizes = {
            "num_attention_heads": self.num_attention_heads,
            "kv_heads": self.kv_heads,
            "ffn_size": self.ffn_size,
        }
        for name, size in sizes.items():
            if size % tp_size:
                common = math.gcd(*sizes.values())
                choices = [d for d in range(1, common + 1) if common % d == 0]
                raise ValueError(
                    f"tp_size={tp_size} does not divide {name}={size}; use a tp_size that divides "
                    f"num_attention_heads, kv_heads and ffn_size ({', '.join(map(str, choices))})"
                )

    def replace(self, **changes) -> TransformerConfig:
        """A copy with `changes` applied, validated again."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The fields as JSON values (rope_scaling a nested dict or None), for a checkpoint."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> TransformerConfig:
        """The config `to_dict` gave, validated as the constructor validates. Keys it does not know
        (a checkpoint of a newer megafp8) are a ValueError naming them, never silently dropped:
        the model built would not be the one saved. Fields missing from `values` that have a
        default (added since it was saved) take it."""
        if not isinstance(values, dict):
            raise ValueError(
                f"a model config is a mapping of field names to values, not a {type(values).__name__}"
            )
        _check_keys("model config", values, cls)
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in values and f.default is dataclasses.MISSING
        ]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}")
        scaling = values.get("rope_scaling")
        if scaling is not None:
            if not isinstance(scaling, dict):
                raise ValueError(f"rope_scaling must be a mapping or null, got {scaling!r}")
            _check_keys("rope_scaling", scaling, RopeScaling)
            scaling = RopeScaling(**scaling)
        return cls(**{**values, "rope_scaling": scaling})

    def num_parameters(self, tp_size: int = 1) -> int:
        """All weights and biases of the whole model, with the vocabulary padded for tp_size."""
        h, vocab = self.hidden_size, self.padded_vocab_size(tp_size)
        norm = 2 * h if self.normalization == "layernorm" else h
        qkv_out = (self.num_attention_heads + 2 * self.kv_heads) * self.head_dim
        attention = h * qkv_out + h * h + (qkv_out + h if self.bias else 0)
        # swiglu: gate and up
        up_out = 2 * self.ffn_size if self.activation == "swiglu" else self.ffn_size
        mlp = h * up_out + self.ffn_size * h + (up_out + h if self.bias else 0)
        layer = 2 * norm + attention + mlp
        embeddings = vocab * h + (
            self.max_position_embeddings * h if self.position_embedding == "learned" else 0
        )
        output = 0 if self.tie_embeddings else vocab * h
        return embeddings + self.num_layers * layer + norm + output


def gpt_config(
    num_layers: int, hidden_size: int, num_attention_heads: int, **overrides
) -> TransformerConfig:
    """GPT-2/GPT-3 style: learned positions, LayerNorm, tanh GELU, biases, tied embeddings."""
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        **{"vocab_size": 50257, "max_position_embeddings": 2048, **overrides},
    )


def llama_config(
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_kv_heads: int,
    ffn_hidden_size: int,
    **overrides,
) -> TransformerConfig:
    """Llama style: RoPE, RMSNorm, SwiGLU, no biases, untied output layer."""
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_kv_heads=num_kv_heads,
        ffn_hidden_size=ffn_hidden_size,
        **{
            "normalization": "rmsnorm",
            "activation": "swiglu",
            "position_embedding": "rope",
            "bias": False,
            "tie_embeddings": False,
            **overrides,
        },
    )


_LLAMA2 = dict(vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0)
_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)

PRESETS: dict[str, TransformerConfig] = {
    # GPT-3 paper shapes (Brown et al. 2020, table 2.1).
    "gpt-125m": gpt_config(12, 768, 12),
    "gpt-350m": gpt_config(24, 1024, 16),
    "gpt-760m": gpt_config(24, 1536, 16),
    "gpt-1.3b": gpt_config(24, 2048, 16),
    "gpt-2.7b": gpt_config(32, 2560, 32),
    "gpt-6.7b": gpt_config(32, 4096, 32),
    # Hugging Face meta-llama configs.
    "llama2-7b": llama_config(32, 4096, 32, 32, 11008, **_LLAMA2),
    "llama2-13b": llama_config(40, 5120, 40, 40, 13824, **_LLAMA2),
    "llama3-8b": llama_config(32, 4096, 32, 8, 14336, **_LLAMA3),
    "llama3-70b": llama_config(80, 8192, 64, 8, 28672, **_LLAMA3),
    # A Llama the size of GPT-125M for convergence studies (GQA 12:4, RoPE, SwiGLU, a 32k vocabulary).
    "llama-120m": llama_config(
        12, 768, 12, 4, 2048, vocab_size=32000, max_position_embeddings=2048, rope_theta=10000.0
    ),
    # For tests: sizes are multiples of 16 (FP8 GEMMs) and split over tp = 2.
    "gpt-tiny": gpt_config(2, 64, 4, vocab_size=1000, max_position_embeddings=128),
    "llama-tiny": llama_config(2, 64, 4, 2, 128, vocab_size=1000, max_position_embeddings=128),
}


def preset(name: str, **overrides) -> TransformerConfig:
    """The named preset, with `overrides` applied and validated."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides)
