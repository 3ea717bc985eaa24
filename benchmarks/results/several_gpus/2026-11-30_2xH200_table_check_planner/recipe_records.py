"""The two-GPU table's summary (call1_summary.txt) as the JSON lines validate_planner.py reads:
each run of examples/pretrain_gpt_1b_fp8.sh as shipped, with the layout and flags the recipe gave
it, and its mean tokens/s of iterations 21-40.

    python recipe_records.py call1_summary.txt recipes
"""

import json
import re
import sys
from pathlib import Path

LAYOUTS = {"gpu1": (1, 1, 1), "dp2": (1, 1, 2), "pp2": (1, 2, 1), "tp2": (2, 1, 1)}

summary, out = Path(sys.argv[1]), Path(sys.argv[2])
records = []
for line in summary.read_text().splitlines():
    match = re.match(r"(gpu1|dp2|pp2|tp2)(_bf16)?(_r2)? rc=0 mean21-40 (\d+)", line)
    if not match:
        continue
    tp, pp, dp = LAYOUTS[match[1]]
    records.append(
        {
            "label": f"gpt_recipe_{match[1]}{match[2] or ''}{match[3] or ''}",
            "precision": "bf16" if match[2] else "delayed",
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
            "window": [21, 40],
            "tokens_per_sec_per_gpu": int(match[4]) / (tp * pp * dp),
            "first_stage_layers": 3.5 if pp == 2 else None,
            "last_stage_layers": 2.5 if pp == 2 else None,
            "distributed_optimizer": dp > 1,
            "overlap_param_gather": dp > 1,
            "recompute": "none",
        }
    )
out.mkdir(parents=True, exist_ok=True)
(out / "gpt_recipes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
print(f"{len(records)} records in {out / 'gpt_recipes.jsonl'}")
