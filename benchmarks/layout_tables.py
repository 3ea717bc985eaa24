"""Markdown tables from bench_layouts.py's JSON lines: throughput, memory and FP8/bf16 per layout,
and how closely each run's losses follow a reference run's.

    python benchmarks/layout_tables.py results/*.jsonl --reference gpt_1gpu

The last record of each (label, precision) counts. `--reference LABEL_PREFIX` compares every run
with more than one GPU against the run of that label prefix and the same precision, step by step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PRECISIONS = ("bf16", "delayed", "current")


def load(paths) -> dict:
    records = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                records[(record["label"], record["precision"])] = record
    return records


def layout(record) -> str:
    name = f"tp{record['tp']} x pp{record['pp']} x dp{record['dp']}"
    return name + (f" (vpp {record['vpp']})" if record.get("vpp") else "")


def _cell(value, fmt, missing="not run"):
    return format(value, fmt) if value is not None else missing


def throughput_table(records) -> str:
    labels = sorted(
        {label for label, _ in records},
        key=lambda name: (-records_of(records, name)[0]["world_size"], name),
    )
    lines = [
        "| run | GPUs | layout | bf16 tokens/s/GPU | FP8 delayed | FP8 current | delayed / bf16 | current / bf16 "
        "| peak memory GiB (bf16 / delayed / current) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label in labels:
        by_precision = {p: records.get((label, p)) for p in PRECISIONS}
        first = next(r for r in by_precision.values() if r is not None)
        rate = {p: r["tokens_per_sec_per_gpu"] if r else None for p, r in by_precision.items()}
        memory = " / ".join(
            _cell(r["peak_memory_gib"] if r else None, ".1f", "-") for r in by_precision.values()
        )

        def ratio(p):
            return f"{rate[p] / rate['bf16']:.2f}x" if rate[p] and rate["bf16"] else "-"

        lines.append(
            f"| {label} | {first['world_size']} | {layout(first)} | "
            + " | ".join(_cell(rate[p], ",.0f") for p in PRECISIONS)
            + f" | {ratio('delayed')} | {ratio('current')} | {memory} |"
        )
    return "\n".join(lines)


def records_of(records, label):
    return [r for (name, _), r in records.items() if name == label]


def loss_table(records, reference: str) -> str:
    lines = [
        "| run | precision | steps | loss at the last step (reference) | largest step difference "
        "| mean difference, second half |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (label, precision), record in sorted(records.items()):
        if label.startswith(reference):
            continue
        ref = next(
            (
                r
                for (name, p), r in records.items()
                if name.startswith(reference) and p == precision
            ),
            None,
        )
        if ref is None or ref["iterations"] != record["iterations"]:
            continue  # another schedule: the learning rate differs step by step
        steps = min(len(ref["losses"]), len(record["losses"]))
        diffs = [a - b for a, b in zip(record["losses"][:steps], ref["losses"][:steps])]
        late = diffs[steps // 2 :]
        lines.append(
            f"| {label} | {precision} | {steps} | {record['losses'][steps - 1]:.4f} "
            f"({ref['losses'][steps - 1]:.4f}) | {max(diffs, key=abs):+.4f} "
            f"| {sum(late) / len(late):+.4f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument(
        "--reference", help="label prefix of the runs the others' losses are compared with"
    )
    args = parser.parse_args(argv)
    records = load(args.files)
    print(throughput_table(records))
    if args.reference:
        print()
        print(loss_table(records, args.reference))


if __name__ == "__main__":
    main()
