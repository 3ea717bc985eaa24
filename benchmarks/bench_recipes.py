"""A pretraining recipe as shipped, layout by layout and precision by precision, one run after the
other on one machine: tokens/s of each, per GPU against one GPU of the same precision, and FP8
against bf16 of the same layout (the tables of docs/tuning.md and benchmarks/RESULTS.md).

    python benchmarks/bench_recipes.py --layouts 1gpu dp2 pp2 tp2 --precisions bf16 delayed
    python benchmarks/bench_recipes.py --layouts tp2 --precisions delayed --extra=--tp-comm-overlap
    python benchmarks/bench_recipes.py --recipe examples/pretrain_llama2_7b_fp8.sh --layouts pp2dp2 tp2pp2 \\
        --precisions bf16 delayed --env GBS=64

A layout is `1gpu` or its sizes, `tp2pp2`, `pp2dp2`, `dp4`... (GPUS = tp x pp x dp). Each run is
the recipe with GPUS, TP, PP, PRECISION and FP8_RECIPE set, `SAVE=` (no checkpoints), `ITERS`
(--iters) and the `--env` settings; its tokens/s is the last logged window of its metrics.jsonl
(the recipe logs every ITERS / 2 iterations here). Every run's log and metrics stay under
--output; the table is printed and written there as table.md, the records as runs.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = {
    "bf16": {"PRECISION": "bf16"},
    "delayed": {"PRECISION": "fp8", "FP8_RECIPE": "delayed"},
    "current": {"PRECISION": "fp8", "FP8_RECIPE": "current"},
}


def layout_sizes(name: str) -> dict:
    """{"tp", "pp", "dp", "gpus"} of a layout name (`1gpu`, or `tp2pp2`-style sizes)."""
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    if name != "1gpu":
        parts = re.fullmatch(r"((?:tp|pp|dp)\d+)+", name) and re.findall(r"(tp|pp|dp)(\d+)", name)
        if not parts or len({kind for kind, _ in parts}) != len(parts):
            raise ValueError(f"layout {name!r}: give 1gpu or sizes such as tp2, pp2dp2, tp2pp2dp2")
        sizes.update({kind: int(size) for kind, size in parts})
    return {**sizes, "gpus": sizes["tp"] * sizes["pp"] * sizes["dp"]}


def run_recipe(recipe: Path, layout: str, precision: str, args, folder: Path) -> dict:
    """One run of `recipe`; its record (tokens/s None when it logged none, with its exit status)."""
    sizes = layout_sizes(layout)
    folder.mkdir(parents=True, exist_ok=True)
    extra = f"{args.extra} --tensorboard-dir {folder}".strip()
    env = {
        **os.environ,
        **dict(setting.split("=", 1) for setting in args.env),
        **PRECISIONS[precision],
        "GPUS": str(sizes["gpus"]),
        "TP": str(sizes["tp"]),
        "PP": str(sizes["pp"]),
        "ITERS": str(args.iters),
        "LOG_INTERVAL": str(max(args.iters // 2, 1)),
        "SAVE": "",
        "EXTRA_ARGS": extra,
        "WORKDIR": str(args.output / "data"),
    }
    with open(folder / "run.log", "w") as log:
        # a failed run is a row of the table
        status = subprocess.run(
            ["bash", str(recipe)],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        ).returncode
    speeds = [
        record["tokens_per_sec"]
        for record in _records(folder / "metrics.jsonl")
        if "tokens_per_sec" in record
    ]
    return {
        "layout": layout,
        "precision": precision,
        "label": args.label,
        "gpus": sizes["gpus"],
        "returncode": status,
        "tokens_per_sec": speeds[-1] if speeds else None,
        "extra": args.extra,
        "env": args.env,
        "recipe": str(recipe.relative_to(REPO)),
        "iters": args.iters,
    }


def _records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def table(records: list) -> str:
    """Markdown: each run's tokens/s, per GPU against one GPU of its precision, FP8 against bf16."""
    speed = {(r["layout"], r["precision"]): r["tokens_per_sec"] for r in records}
    lines = [
        "| layout | precision | tokens/s | per GPU vs one GPU | FP8 / bf16 |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        tokens = r["tokens_per_sec"]
        one_gpu = speed.get(("1gpu", r["precision"]))
        bf16 = speed.get((r["layout"], "bf16"))
        cells = [
            f"{tokens:,.0f}" if tokens else f"failed (exit {r['returncode']})",
            f"{100 * tokens / r['gpus'] / one_gpu:.1f}%"
            if tokens and one_gpu and r["layout"] != "1gpu"
            else "",
            f"{tokens / bf16:.2f}x" if tokens and bf16 and r["precision"] != "bf16" else "",
        ]
        lines.append(f"| {r['layout']} | {r['precision']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", type=Path, default=REPO / "examples" / "pretrain_gpt_1b_fp8.sh")
    parser.add_argument("--layouts", nargs="+", default=["1gpu", "dp2", "pp2", "tp2"])
    parser.add_argument(
        "--precisions", nargs="+", choices=tuple(PRECISIONS), default=["bf16", "delayed"]
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--extra", default="", help="trainer flags added to every run (the recipe's EXTRA_ARGS)"
    )
    parser.add_argument(
        "--env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="the recipe's settings, e.g. GBS=32",
    )
    parser.add_argument("--label", default="", help="a name for this series, kept in each record")
    parser.add_argument("--output", type=Path, default=Path("runs/bench_recipes"))
    args = parser.parse_args(argv)
    try:
        for layout in args.layouts:
            layout_sizes(layout)
    except ValueError as error:
        parser.error(str(error))
    bad = [setting for setting in args.env if "=" not in setting]
    if bad:
        parser.error(f"--env takes KEY=VALUE settings, not {' '.join(bad)}")
    if args.iters < 2:
        parser.error("--iters must be at least 2 (the first logged window includes start-up)")
    args.output = args.output.resolve()
    recipe = (REPO / args.recipe).resolve() if not args.recipe.is_absolute() else args.recipe
    records = []
    for layout in args.layouts:
        for precision in args.precisions:
            name = "-".join(filter(None, (layout, precision, args.label)))
            record = run_recipe(recipe, layout, precision, args, args.output / name)
            records.append(record)
            with open(args.output / "runs.jsonl", "a") as out:
                out.write(json.dumps(record) + "\n")
            print(
                f"{layout} {precision}: "
                + (
                    f"{record['tokens_per_sec']:,.0f} tokens/s"
                    if record["tokens_per_sec"]
                    else f"failed (exit {record['returncode']})"
                ),
                flush=True,
            )
    text = table(records)
    (args.output / "table.md").write_text(text + "\n")
    print(text)
    return 0 if all(r["tokens_per_sec"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
