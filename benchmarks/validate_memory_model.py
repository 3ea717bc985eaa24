"""The memory model (megafp8.training.memory_model) against the peak memory measured on GPUs.

    python benchmarks/validate_memory_model.py [RESULTS_DIR ...]

Reads the JSON lines `bench_layouts.py` wrote (default: benchmarks/results/2026-11-22_8xH200,
the eight-GPU layouts of RESULTS.md) and prints, per record, the peak memory predicted for the
fullest pipeline stage against `peak_memory_gib` (torch.cuda.max_memory_allocated). Only the
first precision of each launch is compared: the later ones in the same process carried memory
the runs before them leaked (RESULTS.md, "Memory"). The model's flags come from the label's
prefix, as benchmarks/layouts_8gpu.sh ran them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megafp8.models.config import preset
from megafp8.training.memory_model import MemoryLayout, estimate

DEFAULT = Path(__file__).resolve().parent / "results" / "2026-11-22_8xH200"
# What layouts_8gpu.sh gave each model (the sample corpus's 32768-token vocabulary).
MODELS = {
    "gpt": (preset("gpt-1.3b", vocab_size=32768), dict(distributed_optimizer=False, recompute="none")),
    "llama": (preset("llama2-7b", vocab_size=32768), dict(distributed_optimizer=True, recompute="selective")),
}


def predicted_gib(record: dict) -> float:
    config, flags = MODELS[record["label"].split("_")[0]]
    dp = record["dp"]
    layout = MemoryLayout(
        seq_length=record["seq_length"], micro_batch_size=record["micro_batch_size"],
        num_micro_batches=record["global_batch_size"] // (dp * record["micro_batch_size"]),
        tp=record["tp"], pp=record["pp"], dp=dp, vpp=record.get("vpp") or 1, sequence_parallel=record["tp"] > 1,
        fp8=None if record["precision"] == "bf16" else record["precision"], **flags)
    return max(stage["total"] for stage in estimate(config, layout)) / 2**30


def first_of_each_launch(folders) -> list[dict]:
    records = []
    for folder in folders:
        for path in sorted(Path(folder).glob("*.jsonl")):
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if lines and lines[0].get("peak_memory_gib") and lines[0]["label"].split("_")[0] in MODELS:
                records.append(lines[0])
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="*", default=[DEFAULT], help="folders of bench_layouts.py JSON lines")
    args = parser.parse_args(argv)
    records = first_of_each_launch(args.folders)
    if not records:
        print(f"validate_memory_model.py: no bench_layouts.py records in {', '.join(map(str, args.folders))}",
              file=sys.stderr)
        return 2
    print("| run | precision | tp x pp x dp | measured GiB | predicted GiB | error |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for record in records:
        measured, predicted = record["peak_memory_gib"], predicted_gib(record)
        error = predicted / measured - 1
        worst = max(worst, abs(error))
        print(f"| {record['label']} | {record['precision']} | {record['tp']} x {record['pp']} x {record['dp']} | "
              f"{measured:.1f} | {predicted:.1f} | {100 * error:+.1f}% |")
    print(f"\nlargest error {100 * worst:.1f}% over {len(records)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
