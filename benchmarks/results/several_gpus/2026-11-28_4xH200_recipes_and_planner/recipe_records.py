"""call1_summary.txt as the JSON lines validate_planner.py reads (recipes/gpt_recipes.jsonl), and
likewise the two-GPU series of the same code on another machine (two_gpus/gpt_recipes.jsonl, from
../2026-11-28_2xH200_tp_gathers_one_round/call2_summary.txt): each
run of examples/pretrain_gpt_1b_fp8.sh as shipped, with the layout and flags the recipe gave it
(the sizes of the run's own log: GPT-1.3B, sequence 2048, micro-batch 4, global batch 32, CUDA
graphs; pp 2: 4 virtual stages of 3.5, 3, ..., 3, 2.5 layers; dp > 1: the distributed optimizer
with --overlap-param-gather) and its tokens/s of iterations 16-20.

    python benchmarks/results/several_gpus/2026-11-28_4xH200_recipes_and_planner/recipe_records.py
"""

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = {
    "recipes": HERE / "call1_summary.txt",
    "two_gpus": HERE.parent / "2026-11-28_2xH200_tp_gathers_one_round" / "call2_summary.txt",
}
LAYOUTS = {
    "gpu1": (1, 1, 1),
    "dp2": (1, 1, 2),
    "pp2": (1, 2, 1),
    "tp2": (2, 1, 1),
    "tp2pp2": (2, 2, 1),
    "pp2dp2": (1, 2, 2),
    "tp2dp2": (2, 1, 2),
    "dp4": (1, 1, 4),
}


def records_of(summary: Path) -> list:
    """The recipe's runs in a summary, as records; other lines (probes, other VPP) left out."""
    records = []
    for line in summary.read_text().splitlines():
        match = re.match(r"(\w+?)_(delayed|bf16) rc=0 .*tokens/s: (\d+)", line)
        if match:
            records.append(record(match[1], match[2], int(match[3])))
    return records


def record(name: str, precision: str, tokens: int) -> dict:
    tp, pp, dp = LAYOUTS[name]
    return {
        "label": f"gpt_recipe_{name}",
        "precision": precision,
        "device": "NVIDIA H200",
        "world_size": tp * pp * dp,
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "vpp": 4 if pp == 2 else None,
        "micro_batch_size": 4,
        "global_batch_size": 32,
        "seq_length": 2048,
        "cuda_graph": True,
        "window": [16, 20],
        "tokens_per_sec_per_gpu": tokens / (tp * pp * dp),
        "first_stage_layers": 3.5 if pp == 2 else None,
        "last_stage_layers": 2.5 if pp == 2 else None,
        "distributed_optimizer": dp > 1,
        "overlap_param_gather": dp > 1,
        "recompute": "none",
    }


for folder, summary in SOURCES.items():
    records = records_of(summary)
    (HERE / folder).mkdir(exist_ok=True)
    (HERE / folder / "gpt_recipes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{folder}: {len(records)} records")
