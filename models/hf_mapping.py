"""Hugging Face GPT2LMHeadModel / LlamaForCausalLM as megafp8 TransformerLM, both ways: configs
and state dicts (the full model, tensor-parallel size 1).

Configs: `hf_architecture(config)` names the HF model that computes what a TransformerConfig
does; `hf_config(config, arch, dtype)` is its transformers config; `config_from_hf(hf_config)`
the TransformerConfig of a GPT2Config / LlamaConfig (Llama 3.1's llama3 rope scaling and GPT-2's
erf GELU included). A setting one side cannot compute is an HFMappingError (a ValueError) naming
it. `transformers` is imported only by hf_config, so the weight mapping works without it.

Weights: every megafp8 weight is one HF weight, or a fixed rearrangement of several:

| megafp8 | GPT2LMHeadModel | LlamaForCausalLM |
| --- | --- | --- |
| embedding.weight (rows padded) | transformer.wte.weight | model.embed_tokens.weight |
| position_embedding.weight | transformer.wpe.weight | - |
| layers.i.input_norm | h.i.ln_1 | layers.i.input_layernorm |
| layers.i.attention.qkv | h.i.attn.c_attn (transposed; q, k, v) | layers.i.self_attn.{q,k,v}_proj |
| layers.i.attention.proj | h.i.attn.c_proj (transposed) | layers.i.self_attn.o_proj |
| layers.i.mlp_norm | h.i.ln_2 | layers.i.post_attention_layernorm |
| layers.i.mlp.fc1 | h.i.mlp.c_fc (transposed) | layers.i.mlp.{gate,up}_proj, stacked |
| layers.i.mlp.fc2 | h.i.mlp.c_proj (transposed) | layers.i.mlp.down_proj |
| final_norm | transformer.ln_f | model.norm |
| output_layer.weight (rows padded) | tied to wte (untied: lm_head.weight) | lm_head.weight (tied: none) |

GPT-2's Conv1D layers store weights as [in, out]; megafp8 (like nn.Linear) as [out, in]. The
fused QKV is laid out per key/value group — for each kv head: its query heads, then k, then v
— so that tensor parallelism can split it into whole groups. SwiGLU's fc1 is [gate; up].
A Llama config with `bias=True` maps to LlamaForCausalLM with attention_bias and mlp_bias.

`from_hf_*(hf, config, layers=..., ends=...)` convert part of a model (a few layers, or the
embeddings and output), so a converter can go layer by layer; `to_hf_*(ours, config)` convert
whichever megafp8 tensors they are given, and drop the vocabulary's padding rows.
"""

from __future__ import annotations

import re

import torch

from .config import RopeScaling, TransformerConfig

# model_type -> the transformers class megafp8 converts to and from.
SUPPORTED = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
# model_type -> the HF names of a transformer layer's tensors (group 1: the layer's index) and of the embedding.
HF_LAYER = {
    "gpt2": re.compile(r"transformer\.h\.(\d+)\..+"),
    "llama": re.compile(r"model\.layers\.(\d+)\..+"),
}
HF_EMBEDDING = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}
# model_type -> buffers that some exports carry but Hugging Face recomputes instead of loading (non-persistent
# today): GPT-2's causal mask (attn.bias, attn.masked_bias), Llama's rotary frequencies (from rope_theta).
HF_BUFFERS = {
    "gpt2": re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)"),
    "llama": re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq"),
}


class HFMappingError(ValueError):
    """A model or config that the other side cannot compute; the message names the setting."""


# ---- configs ----------------------------------------------------------------------------------


def hf_architecture(config: TransformerConfig) -> str:
    """'gpt2' or 'llama': the Hugging Face model that computes exactly what `config` does."""
    if (
        config.normalization == "layernorm"
        and config.position_embedding == "learned"
        and config.activation in ("gelu", "gelu_tanh")
        and config.bias
    ):
        return "gpt2"
    if (
        config.normalization == "rmsnorm"
        and config.position_embedding == "rope"
        and config.activation == "swiglu"
    ):
        return "llama"
    raise HFMappingError(
        f"no Hugging Face architecture matches this model (normalization={config.normalization}, "
        f"position_embedding={config.position_embedding}, activation={config.activation}, bias={config.bias}): "
        "GPT2LMHeadModel needs layernorm + learned positions + gelu/gelu_tanh + biases; "
        "LlamaForCausalLM needs rmsnorm + rope + swiglu"
    )


def hf_config(config: TransformerConfig, arch: str, dtype: torch.dtype, bos=None, eos=None):
    """The transformers config of `config` (vocabulary unpadded) for `arch` (hf_architecture's)."""
    import transformers  # optional: only converting to Hugging Face needs it

    if arch == "gpt2":
        hf = transformers.GPT2Config(
            vocab_size=config.vocab_size,
            n_positions=config.max_position_embeddings,
            n_embd=config.hidden_size,
            n_layer=config.num_layers,
            n_head=config.num_attention_heads,
            n_inner=config.ffn_size,
            activation_function="gelu_new" if config.activation == "gelu_tanh" else "gelu",
            layer_norm_epsilon=config.norm_epsilon,
            initializer_range=config.init_method_std,
            resid_pdrop=config.hidden_dropout,
            embd_pdrop=0.0,
            attn_pdrop=config.attention_dropout,
            tie_word_embeddings=config.tie_embeddings,
            bos_token_id=bos,
            eos_token_id=eos,
        )
    else:
        rope = {"rope_type": "default", "rope_theta": config.rope_theta}
        if config.rope_scaling is not None:
            s = config.rope_scaling
            rope.update(
                rope_type="llama3",
                factor=s.factor,
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
        hf = transformers.LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.ffn_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.kv_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.norm_epsilon,
            rope_parameters=rope,
            tie_word_embeddings=config.tie_embeddings,
            attention_bias=config.bias,
            mlp_bias=config.bias,
            attention_dropout=config.attention_dropout,
            hidden_act="silu",
            initializer_range=config.init_method_std,
            bos_token_id=bos,
            eos_token_id=eos,
        )
    hf.architectures = [SUPPORTED[arch]]
    hf.dtype = dtype
    return hf


def _require(condition, message):
    if not condition:
        raise HFMappingError(message)


def config_from_hf(hf) -> TransformerConfig:
    """The megafp8 config of a transformers GPT2Config or LlamaConfig; a setting megafp8 does not
    compute (e.g. another activation or rope type) is an HFMappingError naming it."""
    where = f"{hf.model_type} config"
    try:
        if hf.model_type == "gpt2":
            activations = {
                "gelu_new": "gelu_tanh",
                "gelu_pytorch_tanh": "gelu_tanh",
                "gelu": "gelu",
            }
            _require(
                hf.activation_function in activations,
                f"{where}: activation_function={hf.activation_function!r}; megafp8 computes "
                f"{', '.join(activations)}",
            )
            _require(
                hf.scale_attn_weights
                and not hf.scale_attn_by_inverse_layer_idx
                and not hf.add_cross_attention,
                f"{where}: megafp8 needs scale_attn_weights=true, scale_attn_by_inverse_layer_idx=false "
                "and add_cross_attention=false",
            )
            return TransformerConfig(
                num_layers=hf.n_layer,
                hidden_size=hf.n_embd,
                num_attention_heads=hf.n_head,
                vocab_size=hf.vocab_size,
                max_position_embeddings=hf.n_positions,
                ffn_hidden_size=hf.n_inner or 4 * hf.n_embd,
                normalization="layernorm",
                norm_epsilon=hf.layer_norm_epsilon,
                activation=activations[hf.activation_function],
                position_embedding="learned",
                tie_embeddings=bool(hf.tie_word_embeddings),
                bias=True,
                init_method_std=hf.initializer_range,
                hidden_dropout=hf.resid_pdrop,
                attention_dropout=hf.attn_pdrop,
            )
        _require(
            hf.hidden_act == "silu",
            f"{where}: hidden_act={hf.hidden_act!r}; megafp8's SwiGLU is silu",
        )
        _require(
            bool(hf.attention_bias) == bool(getattr(hf, "mlp_bias", False)),
            f"{where}: attention_bias={hf.attention_bias} and mlp_bias={hf.mlp_bias}; megafp8 has one "
            "bias switch for every linear layer",
        )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        _require(
            head_dim * hf.num_attention_heads == hf.hidden_size,
            f"{where}: head_dim={head_dim} x num_attention_heads={hf.num_attention_heads} != "
            f"hidden_size={hf.hidden_size}; megafp8 needs head_dim = hidden_size / heads",
        )
        _require(
            getattr(hf, "pretraining_tp", 1) == 1,
            f"{where}: pretraining_tp={hf.pretraining_tp}; needs 1",
        )
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        _require(
            rope_type in ("default", "llama3"),
            f"{where}: rope type {rope_type!r}; megafp8 computes 'default' and 'llama3' RoPE",
        )
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=rope["factor"],
                low_freq_factor=rope["low_freq_factor"],
                high_freq_factor=rope["high_freq_factor"],
                original_max_position_embeddings=rope["original_max_position_embeddings"],
            )
        return TransformerConfig(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            ffn_hidden_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            max_position_embeddings=hf.max_position_embeddings,
            normalization="rmsnorm",
            norm_epsilon=hf.rms_norm_eps,
            activation="swiglu",
            position_embedding="rope",
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
            rope_scaling=scaling,
            tie_embeddings=bool(hf.tie_word_embeddings),
            bias=bool(hf.attention_bias),
            init_method_std=hf.initializer_range,
            attention_dropout=float(hf.attention_dropout),
        )
    except HFMappingError:
        raise
    except (ValueError, TypeError) as error:  # TransformerConfig's own checks
        raise HFMappingError(f"{where}: {error}") from None


# ---- weights ----------------------------------------------------------------------------------


def grouped_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: TransformerConfig
) -> torch.Tensor:
    """Separate q [heads*d, ...], k and v [kv_heads*d, ...] (weights or biases) as the fused,
    per-group layout."""
    d, kv = config.head_dim, config.kv_heads
    rest = q.shape[1:]
    q = q.reshape(kv, config.num_attention_heads // kv, d, *rest)
    k, v = k.reshape(kv, 1, d, *rest), v.reshape(kv, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def ungrouped_qkv(qkv: torch.Tensor, config: TransformerConfig) -> tuple:
    """grouped_qkv's inverse: the fused, per-group tensor as separate q, k and v."""
    d, kv = config.head_dim, config.kv_heads
    per_group = config.num_attention_heads // kv
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(kv, per_group + 2, d, *rest).split([per_group, 1, 1], dim=1)
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def _layer_range(config: TransformerConfig, layers):
    return range(config.num_layers) if layers is None else layers


def from_hf_gpt2(hf: dict, config: TransformerConfig, layers=None, ends: bool = True) -> dict:
    """GPT2LMHeadModel's weights as megafp8's: the transformer `layers` (default all) and with
    `ends` the embeddings, final norm (and untied output layer)."""
    out = {}
    if ends:
        out.update(
            {
                "embedding.weight": _pad_rows(
                    hf["transformer.wte.weight"], config.padded_vocab_size()
                ),
                "position_embedding.weight": hf["transformer.wpe.weight"],
                "final_norm.weight": hf["transformer.ln_f.weight"],
                "final_norm.bias": hf["transformer.ln_f.bias"],
            }
        )
        if not config.tie_embeddings:
            out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], config.padded_vocab_size())
    for i in _layer_range(config, layers):
        theirs, ours = f"transformer.h.{i}.", f"layers.{i}."
        for name in ("weight", "bias"):
            out[ours + f"input_norm.{name}"] = hf[theirs + f"ln_1.{name}"]
            out[ours + f"mlp_norm.{name}"] = hf[theirs + f"ln_2.{name}"]
        attn_w = hf[theirs + "attn.c_attn.weight"].t()
        out[ours + "attention.qkv.weight"] = grouped_qkv(*attn_w.chunk(3), config)
        out[ours + "attention.qkv.bias"] = grouped_qkv(
            *hf[theirs + "attn.c_attn.bias"].chunk(3), config
        )
        for mine, conv in (
            ("attention.proj", "attn.c_proj"),
            ("mlp.fc1", "mlp.c_fc"),
            ("mlp.fc2", "mlp.c_proj"),
        ):
            out[ours + f"{mine}.weight"] = hf[theirs + f"{conv}.weight"].t()
            out[ours + f"{mine}.bias"] = hf[theirs + f"{conv}.bias"]
    return {name: tensor.contiguous() for name, tensor in out.items()}


def from_hf_llama(hf: dict, config: TransformerConfig, layers=None, ends: bool = True) -> dict:
    """LlamaForCausalLM's weights as megafp8's: the transformer `layers` (default all) and with
    `ends` the embedding, final norm and (untied) output layer."""
    vocab = config.padded_vocab_size()
    out = {}
    if ends:
        out["embedding.weight"] = _pad_rows(hf["model.embed_tokens.weight"], vocab)
        out["final_norm.weight"] = hf["model.norm.weight"]
        if not config.tie_embeddings:
            out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], vocab)
    kinds = ("weight", "bias") if config.bias else ("weight",)
    for i in _layer_range(config, layers):
        theirs, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = theirs + "self_attn."
        out[ours + "input_norm.weight"] = hf[theirs + "input_layernorm.weight"]
        out[ours + "mlp_norm.weight"] = hf[theirs + "post_attention_layernorm.weight"]
        mlp = theirs + "mlp."
        for kind in kinds:
            out[ours + f"attention.qkv.{kind}"] = grouped_qkv(
                hf[attn + f"q_proj.{kind}"],
                hf[attn + f"k_proj.{kind}"],
                hf[attn + f"v_proj.{kind}"],
                config,
            )
            out[ours + f"attention.proj.{kind}"] = hf[attn + f"o_proj.{kind}"]
            out[ours + f"mlp.fc1.{kind}"] = torch.cat(
                [hf[mlp + f"gate_proj.{kind}"], hf[mlp + f"up_proj.{kind}"]]
            )
            out[ours + f"mlp.fc2.{kind}"] = hf[mlp + f"down_proj.{kind}"]
    return {name: tensor.contiguous() for name, tensor in out.items()}


# ---- megafp8 -> Hugging Face ----------------------------------------------------------------

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_GPT2_CONV = {"attention.proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
_LLAMA_LINEAR = {"attention.proj": "self_attn.o_proj", "mlp.fc2": "mlp.down_proj"}
_NORMS = {
    "gpt2": {"input_norm": "ln_1", "mlp_norm": "ln_2"},
    "llama": {"input_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
}


def _unknown(name: str, model: str):
    return KeyError(
        f"megafp8 weight {name!r} has no counterpart in {model} (is the model of that shape?)"
    )


def to_hf_gpt2(ours: dict, config: TransformerConfig) -> dict:
    """megafp8 weights (any subset of a model's, e.g. one layer) as GPT2LMHeadModel's; the
    vocabulary tensors keep only their first config.vocab_size rows. Tied output: no lm_head."""
    out = {}
    for name, tensor in ours.items():
        layer = _LAYER.fullmatch(name)
        if layer is None:
            ends = {
                "embedding.weight": "transformer.wte.weight",
                "position_embedding.weight": "transformer.wpe.weight",
                "final_norm.weight": "transformer.ln_f.weight",
                "final_norm.bias": "transformer.ln_f.bias",
                "output_layer.weight": "lm_head.weight",
            }
            if name not in ends:
                raise _unknown(name, "GPT2LMHeadModel")
            out[ends[name]] = (
                tensor[: config.vocab_size]
                if name in ("embedding.weight", "output_layer.weight")
                else tensor
            )
            continue
        index, rest = layer.groups()
        module, kind = rest.rsplit(".", 1)
        theirs = f"transformer.h.{index}."
        if module in _NORMS["gpt2"]:
            out[theirs + f"{_NORMS['gpt2'][module]}.{kind}"] = tensor
        elif module == "attention.qkv":
            fused = torch.cat(ungrouped_qkv(tensor, config))
            out[theirs + f"attn.c_attn.{kind}"] = fused.t() if kind == "weight" else fused
        elif module in _GPT2_CONV:
            out[theirs + f"{_GPT2_CONV[module]}.{kind}"] = (
                tensor.t() if kind == "weight" else tensor
            )
        else:
            raise _unknown(name, "GPT2LMHeadModel")
    return {name: tensor.contiguous() for name, tensor in out.items()}


def to_hf_llama(ours: dict, config: TransformerConfig) -> dict:
    """megafp8 weights (any subset of a model's, e.g. one layer) as LlamaForCausalLM's; the
    vocabulary tensors keep only their first config.vocab_size rows. Tied output: no lm_head."""
    out = {}
    for name, tensor in ours.items():
        layer = _LAYER.fullmatch(name)
        if layer is None:
            ends = {
                "embedding.weight": "model.embed_tokens.weight",
                "final_norm.weight": "model.norm.weight",
                "output_layer.weight": "lm_head.weight",
            }
            if name not in ends:
                raise _unknown(name, "LlamaForCausalLM")
            out[ends[name]] = tensor[: config.vocab_size] if name != "final_norm.weight" else tensor
            continue
        index, rest = layer.groups()
        module, kind = rest.rsplit(".", 1)
        theirs = f"model.layers.{index}."
        if module in _NORMS["llama"]:
            out[theirs + f"{_NORMS['llama'][module]}.{kind}"] = tensor
        elif module == "attention.qkv":
            for part, piece in zip("qkv", ungrouped_qkv(tensor, config)):
                out[theirs + f"self_attn.{part}_proj.{kind}"] = piece
        elif module == "mlp.fc1":
            gate, up = tensor.chunk(2)
            out[theirs + f"mlp.gate_proj.{kind}"], out[theirs + f"mlp.up_proj.{kind}"] = gate, up
        elif module in _LLAMA_LINEAR:
            out[theirs + f"{_LLAMA_LINEAR[module]}.{kind}"] = tensor
        else:
            raise _unknown(name, "LlamaForCausalLM")
    return {name: tensor.contiguous() for name, tensor in out.items()}
