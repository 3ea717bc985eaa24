"""The layer map: measured times of one model's transformer layer and output end, the throughput
model's input. `benchmarks/bench_layer_grid.py` writes it (`point`, `write`), `megafp8.planner.throughput`
reads it (`read`, `same_layer`, `measured`); this module is the format both follow.

A map is a JSON object: `device` (the GPU's name), `torch`, `triton`, `tp` (the GPUs it was
measured on), `points` (below) and, from `--model`, `copy_gbs` (the device's copy bandwidth, bytes
read and written per second / 1e9). A point is one layer shape at one sequence length,
micro-batch and tensor-parallel size: `arch` (gpt | llama), `hidden`, `heads`, `kv_heads`, `ffn`,
`seq`, `micro_batch`, `tp`, `tp_comm_overlap` (its collectives beside the GEMMs, as the recipes
run them), and per recipe (bf16, delayed, current) and kind of time `{recipe}_{kind}` in ms (None
where it did not fit or was not timed):

- `ms`: forward + backward, replayed from a CUDA graph; `fwd_ms`: the forward alone;
- `host_ms`: an eager step's host time; `host_layer_ms` and `host_pass_ms`: a stack's, per layer
  and per pass; `selective_ms`: the step with selective recomputation (from `--model`);
- `tflops` (throughput of `ms`), and `head_{recipe}_ms`: the model's output end (embedding,
  final norm, output layer, loss), with `model` and `vocab` (from `--model`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megafp8.models.config import TransformerConfig

KINDS = ("ms", "fwd_ms", "host_ms", "host_layer_ms", "host_pass_ms", "selective_ms")


def arch_of(config: TransformerConfig) -> str:
    """The map's name for the model's family (its `arch` field)."""
    return "llama" if config.activation == "swiglu" else "gpt"


def point(
    config: TransformerConfig,
    seq: int,
    micro_batch: int,
    tp: int,
    tp_comm_overlap: bool,
    times: dict,
    head: dict | None = None,
    model: str | None = None,
    flops: float | None = None,
) -> dict:
    """One point: `times` is {kind: {recipe: ms}} (KINDS), `head` {recipe: ms} of the output end,
    `flops` the layer's forward + backward floating-point operations on this rank."""
    entry = {
        "arch": arch_of(config),
        "hidden": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.kv_heads,
        "ffn": config.ffn_size,
        "seq": seq,
        "micro_batch": micro_batch,
        "tp": tp,
        "tp_comm_overlap": tp_comm_overlap,
        **{
            f"{recipe}_{kind}": ms
            for kind, per_recipe in times.items()
            for recipe, ms in per_recipe.items()
        },
    }
    if flops is not None:
        entry.update(
            {
                f"{recipe}_tflops": (flops / ms / 1e9 if ms else None)
                for recipe, ms in times["ms"].items()
            }
        )
    if model is not None:
        entry.update(
            model=model,
            vocab=config.vocab_size,
            **{f"head_{recipe}_ms": ms for recipe, ms in (head or {}).items()},
        )
    return entry


def same_layer(entry: dict, config: TransformerConfig, seq: int, tp: int) -> bool:
    """Whether `entry` measured `config`'s layer at sequence `seq` over `tp` GPUs."""
    return (
        entry["arch"],
        entry["hidden"],
        entry["heads"],
        entry["kv_heads"],
        entry["ffn"],
        entry["seq"],
        entry["tp"],
    ) == (
        arch_of(config),
        config.hidden_size,
        config.num_attention_heads,
        config.kv_heads,
        config.ffn_size,
        seq,
        tp,
    )


def measured(entry: dict, recipe: str, kind: str = "ms") -> float | None:
    """A point's time in ms of `kind` (KINDS, or "head" for the output end) for `recipe`."""
    return entry.get(f"head_{recipe}_ms" if kind == "head" else f"{recipe}_{kind}")


def write(layer_map: dict, path) -> None:
    """`layer_map` as JSON at `path`, whole or not at all (written beside it, then renamed)."""
    partial = Path(f"{path}.partial")
    partial.write_text(json.dumps(layer_map, indent=1))
    os.replace(partial, path)


def read_json(path):
    """A measurement file's JSON; ValueError naming the file if it cannot be read as JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable JSON file ({error})") from None


def read(path) -> dict:
    """The map at `path`; ValueError, saying what is wrong, if it is no map with points."""
    layer_map = read_json(path)
    if not isinstance(layer_map, dict) or not layer_map.get("points"):
        raise ValueError(
            f"{path}: no layer-map points in it (write one with benchmarks/bench_layer_grid.py)"
        )
    return layer_map
