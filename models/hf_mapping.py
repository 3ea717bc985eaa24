"""Hugging Face GPT2LMHeadModel / LlamaForCausalLM state dicts as megafp8 TransformerLM state
dicts (the full model, tensor-parallel size 1). Every megafp8 weight is one HF weight, or a
fixed rearrangement of several:

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
| output_layer.weight (rows padded) | tied to wte | lm_head.weight |

GPT-2's Conv1D layers store weights as [in, out]; megafp8 (like nn.Linear) as [out, in]. The
fused QKV is laid out per key/value group — for each kv head: its query heads, then k, then v
— so that tensor parallelism can split it into whole groups. SwiGLU's fc1 is [gate; up].
"""
from __future__ import annotations

import torch

from .config import TransformerConfig


def grouped_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Separate q [heads*d, ...], k and v [kv_heads*d, ...] (weights or biases) as the fused,
    per-group layout."""
    d, kv = config.head_dim, config.kv_heads
    rest = q.shape[1:]
    q = q.reshape(kv, config.num_attention_heads // kv, d, *rest)
    k, v = k.reshape(kv, 1, d, *rest), v.reshape(kv, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def from_hf_gpt2(hf: dict, config: TransformerConfig) -> dict:
    out = {
        "embedding.weight": _pad_rows(hf["transformer.wte.weight"], config.padded_vocab_size()),
        "position_embedding.weight": hf["transformer.wpe.weight"],
        "final_norm.weight": hf["transformer.ln_f.weight"],
        "final_norm.bias": hf["transformer.ln_f.bias"],
    }
    for i in range(config.num_layers):
        theirs, ours = f"transformer.h.{i}.", f"layers.{i}."
        for name in ("weight", "bias"):
            out[ours + f"input_norm.{name}"] = hf[theirs + f"ln_1.{name}"]
            out[ours + f"mlp_norm.{name}"] = hf[theirs + f"ln_2.{name}"]
        attn_w = hf[theirs + "attn.c_attn.weight"].t()
        out[ours + "attention.qkv.weight"] = grouped_qkv(*attn_w.chunk(3), config)
        out[ours + "attention.qkv.bias"] = grouped_qkv(*hf[theirs + "attn.c_attn.bias"].chunk(3), config)
        for mine, conv in (("attention.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            out[ours + f"{mine}.weight"] = hf[theirs + f"{conv}.weight"].t()
            out[ours + f"{mine}.bias"] = hf[theirs + f"{conv}.bias"]
    return {name: tensor.contiguous() for name, tensor in out.items()}


def from_hf_llama(hf: dict, config: TransformerConfig) -> dict:
    vocab = config.padded_vocab_size()
    out = {
        "embedding.weight": _pad_rows(hf["model.embed_tokens.weight"], vocab),
        "final_norm.weight": hf["model.norm.weight"],
        "output_layer.weight": _pad_rows(hf["lm_head.weight"], vocab),
    }
    for i in range(config.num_layers):
        theirs, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = theirs + "self_attn."
        out[ours + "input_norm.weight"] = hf[theirs + "input_layernorm.weight"]
        out[ours + "mlp_norm.weight"] = hf[theirs + "post_attention_layernorm.weight"]
        out[ours + "attention.qkv.weight"] = grouped_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], config)
        out[ours + "attention.proj.weight"] = hf[attn + "o_proj.weight"]
        mlp = theirs + "mlp."
        out[ours + "mlp.fc1.weight"] = torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
        out[ours + "mlp.fc2.weight"] = hf[mlp + "down_proj.weight"]
    return {name: tensor.contiguous() for name, tensor in out.items()}
