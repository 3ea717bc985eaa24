"""Which layers' FP8 casts saturate or underflow: the per-layer health a run logged with
`--log-fp8-layers`, as a Markdown table.

    python tools/fp8_layer_table.py RUN [--iteration N] [--sort underflow|saturation|scale] [--top K]

RUN is a run folder (the trainer's --save, which holds metrics.jsonl) or a metrics.jsonl file.
One row per layer and role (input, weight, grad_output) at the logged step N (default: the last
one): the scale in use, the fraction of the cast's elements saturated and the fraction flushed
to zero (nonzero values below half the format's smallest subnormal once scaled), and the
largest of each fraction over the whole run. Rows are sorted worst first by `--sort` (the
smallest scales first for `scale`); `--top K` keeps the first K.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SORTS = ("underflow", "saturation", "scale")


class TableError(Exception):
    """Bad input: said in one line, exit status 2."""


def layer_records(run: str) -> list[dict]:
    """The run's records that hold `fp8_layers`, in the order logged (a resumed run's repeat of an
    iteration replaces the earlier record)."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise TableError(
            f"{run}: no metrics.jsonl there (give a run folder, the trainer's --save, or the file)"
        )
    by_iteration = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TableError(f"{path}, line {number}: not JSON ({error.msg})") from None
        if isinstance(record, dict) and isinstance(record.get("fp8_layers"), dict):
            by_iteration[record.get("iteration")] = record
    if not by_iteration:
        raise TableError(
            f"{path}: no per-layer FP8 record in it; train with --fp8-format ... --log-fp8-layers"
        )
    return [by_iteration[i] for i in sorted(by_iteration, key=lambda i: (i is None, i))]


def rows(records: list[dict], iteration: int | None) -> tuple[int, list[dict]]:
    """(the iteration shown, one row per layer and role: scale, saturation, underflow at it, and
    the largest saturation and underflow over all records)."""
    chosen = (
        records[-1]
        if iteration is None
        else next((r for r in records if r.get("iteration") == iteration), None)
    )
    if chosen is None:
        logged = ", ".join(str(r.get("iteration")) for r in records)
        raise TableError(f"no per-layer record at iteration {iteration}; logged at: {logged}")
    worst: dict = {}
    for record in records:
        for layer, health in record["fp8_layers"].items():
            for role, numbers in health.get("roles", {}).items():
                peak = worst.setdefault((layer, role), {"saturation": 0.0, "underflow": 0.0})
                for key in peak:
                    if numbers.get(key) is not None:
                        peak[key] = max(peak[key], numbers[key])
    table = []
    for layer, health in chosen["fp8_layers"].items():
        for role, numbers in health.get("roles", {}).items():
            table.append(
                {
                    "layer": layer,
                    "role": role,
                    "scale": numbers.get("scale"),
                    "saturation": numbers.get("saturation"),
                    "underflow": numbers.get("underflow"),
                    "max_saturation": worst[(layer, role)]["saturation"],
                    "max_underflow": worst[(layer, role)]["underflow"],
                }
            )
    return chosen.get("iteration"), table


def markdown(iteration, table: list[dict], sort: str, top: int | None) -> str:
    if sort == "scale":
        table = sorted(
            table, key=lambda row: row["scale"] if row["scale"] is not None else float("inf")
        )
    else:
        table = sorted(table, key=lambda row: -(row[sort] or 0.0))
    if top is not None:
        table = table[:top]

    def number(value, spec):
        return "–" if value is None else format(value, spec)

    lines = [
        f"FP8 casts per layer and role at iteration {iteration} (worst {sort} first)",
        "",
        "| layer | role | scale | saturated | underflowed | run's max saturated | run's max underflowed |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {row['layer']} | {row['role']} | {number(row['scale'], '.4g')} | "
        f"{number(row['saturation'], '.2e')} | {number(row['underflow'], '.2e')} | "
        f"{number(row['max_saturation'], '.2e')} | {number(row['max_underflow'], '.2e')} |"
        for row in table
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", help="a run folder or its metrics.jsonl")
    parser.add_argument("--iteration", type=int, help="the logged step to show (default: the last)")
    parser.add_argument("--sort", choices=SORTS, default="underflow")
    parser.add_argument("--top", type=int, help="keep the first K rows")
    args = parser.parse_args(argv)
    if args.top is not None and args.top < 1:
        parser.error(f"--top must be a positive number of rows, got {args.top}")
    try:
        iteration, table = rows(layer_records(args.run), args.iteration)
    except TableError as error:
        print(f"fp8_layer_table.py: error: {error}", file=sys.stderr)
        return 2
    print(markdown(iteration, table, args.sort, args.top), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
