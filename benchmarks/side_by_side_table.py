"""The tokens/s of megafp8 and the peer measured side by side, and their ratios, as Markdown tables.

Reads the JSON lines benchmarks/side_by_side.sh writes (one file per shape): bench_layouts.py's
records of megafp8's trainer (one per precision) and peer_gpt.py's (one per variant); where a run
appears twice the later record counts. A run missing (failed, or not run) shows as such.

    python benchmarks/side_by_side_table.py benchmarks/results/one_gpu/DATE_side_by_side/1b.jsonl [7b.jsonl ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MEGAFP8_RUNS = {
    "bf16": "megafp8 bf16",
    "delayed": "megafp8 FP8 delayed",
    "current": "megafp8 FP8 current",
    "rowwise": "megafp8 FP8 rowwise",
    "blockwise": "megafp8 FP8 blockwise",
}
PEER_RUNS = {
    "bf16": "peer bf16 eager",
    "bf16_compile": "peer bf16 + compile",
    "float8_tensorwise": "peer torchao float8 tensorwise",
    "float8_rowwise": "peer torchao float8 rowwise",
}
RUNS = tuple(MEGAFP8_RUNS.values()) + tuple(PEER_RUNS.values())
# What side_by_side.sh runs: shown as "not run" when missing; the other peer variants only when run.
EXPECTED = {MEGAFP8_RUNS[p] for p in ("bf16", "delayed", "current")} | {
    PEER_RUNS["bf16_compile"],
    PEER_RUNS["float8_tensorwise"],
}
# (numerator, denominator): megafp8 against the peer at each precision, then FP8's gain on each side.
RATIOS = (
    ("megafp8 FP8 delayed", "peer torchao float8 tensorwise"),
    ("megafp8 FP8 current", "peer torchao float8 tensorwise"),
    ("megafp8 bf16", "peer bf16 + compile"),
    ("megafp8 FP8 delayed", "megafp8 bf16"),
    ("megafp8 FP8 current", "megafp8 bf16"),
    ("peer torchao float8 tensorwise", "peer bf16 + compile"),
)
# The fine-grained recipes, where they ran: against torchao's rowwise, our bf16 and FP8 delayed.
FINE_GRAINED_RATIOS = tuple(
    (MEGAFP8_RUNS[recipe], other)
    for recipe in ("rowwise", "blockwise")
    for other in (PEER_RUNS["float8_rowwise"], MEGAFP8_RUNS["bf16"], MEGAFP8_RUNS["delayed"])
)


def run_name(record: dict) -> str:
    """bench_layouts.py's records carry the precision (and after the shape in their label, the
    name side_by_side.sh's NAME gave runs with more flags), peer_gpt.py's the variant."""
    if record.get("benchmark") == "peer_gpt":
        return PEER_RUNS[record["variant"]]
    named = record.get("label", "").partition(", ")[2]
    return MEGAFP8_RUNS[record["precision"]] + (f" ({named})" if named else "")


def named_runs(runs: dict[str, dict]) -> list[str]:
    """megafp8's runs with more flags (NAME), in the order they ran."""
    return [name for name in runs if name not in RUNS]


def all_ratios(runs: dict[str, dict]) -> tuple:
    """RATIOS, the fine-grained recipes' where they ran, then each named run against its plain
    namesake and, under FP8, against torchao."""
    extra = [(top, bottom) for top, bottom in FINE_GRAINED_RATIOS if top in runs]
    for name in named_runs(runs):
        plain = name.rpartition(" (")[0]
        extra.append((name, plain))
        if "FP8" in name:
            extra.append((name, PEER_RUNS["float8_tensorwise"]))
    return RATIOS + tuple(extra)


def tokens_per_sec(record: dict) -> float:
    # One GPU: bench_layouts.py's per-GPU figure is the run's.
    return (
        record["tokens_per_sec"] if "tokens_per_sec" in record else record["tokens_per_sec_per_gpu"]
    )


def step_ms(record: dict) -> float | None:
    return record["step_ms"] if "step_ms" in record else record.get("iteration_time_ms")


def latest_runs(records: list[dict]) -> dict[str, dict]:
    return {run_name(record): record for record in records}


def ratios(runs: dict[str, dict], of=tokens_per_sec) -> list[tuple[str, str, float | None]]:
    """Each of `all_ratios` with its value of `of` (tokens/s), None where either is missing."""
    return [
        (
            top,
            bottom,
            of(runs[top]) / of(runs[bottom])
            if top in runs and bottom in runs and of(runs[top]) and of(runs[bottom])
            else None,
        )
        for top, bottom in all_ratios(runs)
    ]


def peak_memory(record: dict) -> float | None:
    return record.get("peak_memory_gib")


def table(runs: dict[str, dict]) -> str:
    lines = ["| run | tokens/s | step ms | peak memory (GiB) | device |", "|---|---|---|---|---|"]
    megafp8 = tuple(MEGAFP8_RUNS.values())
    for name in megafp8 + tuple(named_runs(runs)) + tuple(PEER_RUNS.values()):
        record = runs.get(name)
        if record is None:
            if name in EXPECTED:
                lines.append(f"| {name} | not run | | | |")
            continue
        step, memory = step_ms(record), record.get("peak_memory_gib")
        lines.append(
            f"| {name} | {tokens_per_sec(record):,.0f} | {'' if step is None else f'{step:.1f}'} | "
            f"{'' if memory is None else f'{memory:.2f}'} | {record.get('device', '')} |"
        )
    lines += ["", "| ratio of tokens/s | |", "|---|---|"]
    for top, bottom, value in ratios(runs):
        lines.append(
            f"| {top} / {bottom} | {'not run' if value is None else f'**{value:.3f}x**'} |"
        )
    if named_runs(runs):  # what the named runs' flags do to memory
        lines += ["", "| ratio of peak memory | |", "|---|---|"]
        for top, bottom, value in ratios(runs, of=peak_memory):
            if top in named_runs(runs) and value is not None:
                lines.append(f"| {top} / {bottom} | {value:.3f}x |")
    peer = next((record for record in runs.values() if record.get("benchmark") == "peer_gpt"), None)
    if peer is not None:
        lines.append(
            f"\nThe peer ran on torch {peer['torch']}, torchao {peer['torchao'] or 'not installed'}."
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="JSON lines files, one per shape")
    args = parser.parse_args(argv)
    for i, path in enumerate(args.runs):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        print(("\n" if i else "") + f"## {path.stem}\n\n{table(latest_runs(records))}")


if __name__ == "__main__":
    main()
