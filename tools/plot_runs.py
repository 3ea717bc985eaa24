"""Draw the loss curves of training runs side by side, from their metrics.jsonl files.

    python tools/plot_runs.py runs/bf16 runs/fp8_delayed runs/fp8_current --output curves.png \
        [--labels bf16 "FP8 delayed" "FP8 current"] [--fields fp8_saturation fp8_scale_min] \
        [--smooth 5] [--log-y fp8_scale_min] [--relative] [--title "GPT-125M"] [--table final_losses.md]
        [--train-from 150] [--repeats 2]

Each RUN is a run folder (the trainer's --save or --tensorboard-dir, which holds metrics.jsonl)
or a metrics.jsonl file; its legend label is its --labels entry, else its folder's name (for a
folder named checkpoints, as the recipes and the quickstart save, the folder above it), with the
folders above where two runs would share a name. The figure has one panel per quantity, every
run on shared axes over the iteration: the training loss (the trainer logs its mean over each
--log-interval window), the validation loss when any run has one, then each field of --fields (any numeric
metrics.jsonl field: fp8_scale_min/max, fp8_saturation, grad_norm, lr, tokens_per_sec, ...).
`--smooth N` averages the training loss over N logged points. `--relative` adds a panel of each
run's validation loss against the first run's (in percent, at the iterations both evaluated),
where differences too small to see on the loss curves show. A run keeps its colour in every
panel. A record logged twice at one iteration (a run resumed from an earlier checkpoint) counts
once, the later one.

`--table FILE` also writes the runs' final losses as a Markdown table, each compared with the
first run (the baseline): the last validation loss, the training loss averaged over the last
`--final-points` logged points, and the largest spike, the training loss's biggest rise above
its lowest value so far (after the first tenth of the run, once warm-up noise is past).
`--train-from N` adds a column for the training loss along the run: at each logged iteration
from N on that both runs logged, the run's training loss (averaged over `--smooth` points)
against the baseline's, as the mean of those differences and the largest one in size.
`--repeats K` says the runs come in settings of K consecutive runs (K initialisations of each,
say); the table then adds each setting's mean final losses against the first setting's, how far
its own runs ended apart, and (with `--train-from`) its mean training loss against the first
setting's along the run.

matplotlib is an optional dependency (`pip install matplotlib`, or megafp8's `plot` extra);
the figure is drawn off-screen (Agg) and written as PNG (or any format matplotlib infers from
the output's suffix).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

TRAIN, VALID = "loss", "valid_loss"
RELATIVE = "valid_loss vs first run"  # --relative's panel (no metrics.jsonl field has a space)


class PlotError(Exception):
    """Bad input: said in one line, exit status 2."""


def metrics_path(run: str) -> Path:
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(
            f"{run}: no metrics.jsonl there (give a run folder, the trainer's --save or "
            f"--tensorboard-dir, or the metrics.jsonl file itself)"
        )
    return path


def default_labels(paths: list) -> list:
    """Each run's folder name (for a folder named checkpoints, the recipes' and the quickstart's --save,
    the folder above it; for a file other than metrics.jsonl, its name without the suffix), with as
    many folders above it as it takes to tell the runs apart."""
    trails = []
    for path in paths:
        parts = list(path.resolve().parent.parts[1:])  # no root: an absolute path's "/" is no name
        if path.name != "metrics.jsonl":
            parts.append(path.stem)
        elif parts[-1:] == ["checkpoints"] and len(parts) > 1:
            parts.pop()
        trails.append(parts)
    depth = 1
    while depth < max(map(len, trails)) and len({tuple(t[-depth:]) for t in trails}) < len(trails):
        depth += 1
    return ["/".join(trail[-depth:]) for trail in trails]


def _number(value):
    # The trainer writes inf and NaN as strings (JSON has neither); other non-numbers are skipped.
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf"):
        return float(value)
    return None


def read_run(path: Path) -> dict:
    """{field: ([iterations], [values])} of every numeric field, by iteration, one value per
    iteration (the last logged)."""
    latest: dict = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise PlotError(f"{path}, line {number}: not JSON ({error.msg})") from None
            iteration = record.get("iteration") if isinstance(record, dict) else None
            if not isinstance(iteration, int):
                raise PlotError(f'{path}, line {number}: a record without an integer "iteration"')
            for field, value in record.items():
                value = _number(value)
                if field not in ("iteration", "time") and value is not None:
                    latest.setdefault(field, {})[iteration] = value
    if not latest:
        raise PlotError(
            f"{path}: no logged iteration in it (is the run still before its first --log-interval?)"
        )
    return {
        field: (sorted(points), [points[i] for i in sorted(points)])
        for field, points in latest.items()
    }


def moving_average(values: list, window: int) -> list:
    """The mean of each value with the up to `window - 1` before it (NaN where any of them is)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def final_losses(run: dict, points: int) -> dict:
    """A run's last iteration, final validation loss, final training loss (mean of the last
    `points` logged values) and largest spike (relative rise of the training loss over its
    lowest value so far, after the first tenth of the run)."""
    iterations, losses = run[TRAIN]
    tail = losses[-points:]
    spike, lowest = 0.0, math.inf
    start = iterations[-1] / 10
    for iteration, loss in zip(iterations, losses):
        if iteration > start and lowest < math.inf:
            spike = max(spike, loss / lowest - 1)
        lowest = min(lowest, loss)
    return {
        "iteration": iterations[-1],
        "train": sum(tail) / len(tail),
        "spike": spike,
        "valid": run[VALID][1][-1] if VALID in run else None,
        "valid_iteration": run[VALID][0][-1] if VALID in run else None,
    }


def smoothed_training_loss(run: dict, window: int) -> dict:
    """{iteration: training loss averaged over `window` logged points} of a run."""
    return dict(zip(run[TRAIN][0], moving_average(run[TRAIN][1], window)))


def training_gap(run: dict, base: dict, start: int, window: int = 1):
    """The run's training loss against the baseline's at every iteration from `start` on that
    both logged (each averaged over `window` logged points): (mean, largest in size) as
    fractions, or None where they share no such iteration."""
    smoothed = [smoothed_training_loss(r, window) for r in (run, base)]
    gaps = [
        loss / smoothed[1][iteration] - 1
        for iteration, loss in smoothed[0].items()
        if iteration >= start and iteration in smoothed[1]
    ]
    if not gaps:
        return None
    return sum(gaps) / len(gaps), max(gaps, key=abs)


def _versus(value, reference) -> str:
    """A table cell: value against reference, in percent."""
    if value is None or reference is None:
        return "–"
    return f"{100 * (value / reference - 1):+.2f}%"


def _loss(value) -> str:
    """A table cell: a loss."""
    return "–" if value is None else f"{value:.4f}"


def _gap_cell(gap) -> str:
    """A table cell: training_gap's (mean, largest)."""
    return " – |" if gap is None else f" {100 * gap[0]:+.2f}%, {100 * gap[1]:+.2f}% |"


def table(
    runs: list, labels: list, points: int = 10, train_from: int | None = None, window: int = 1
) -> str:
    """The final losses of the runs as Markdown, each against the first run's; with
    `train_from`, also the training loss against the first run's along the run from there."""
    missing = [label for run, label in zip(runs, labels) if TRAIN not in run]
    if missing:
        raise PlotError(f'--table: {", ".join(missing)} logged no training loss ("loss")')
    rows = [final_losses(run, points) for run in runs]
    base = rows[0]

    along = (
        f" training loss vs {labels[0]} from iteration {train_from} (mean, largest) |"
        if train_from is not None
        else ""
    )
    lines = [
        "| run | iterations | final validation loss | vs "
        + labels[0]
        + f" | final training loss (mean of last {points} logged) | vs {labels[0]} | largest spike |"
        + along,
        "|---|---|---|---|---|---|---|" + ("---|" if along else ""),
    ]

    for run, label, row in zip(runs, labels, rows):
        # no evaluation at the last iteration
        early = row["valid_iteration"] not in (
            None,
            row["iteration"],
        )
        lines.append(
            f"| {label} | {row['iteration']} | {_loss(row['valid'])}"
            + (f" (at {row['valid_iteration']})" if early else "")
            + f" | {_versus(row['valid'], base['valid'])} | {_loss(row['train'])}"
            + f" | {_versus(row['train'], base['train'])} | {100 * row['spike']:.1f}% |"
            + (_gap_cell(training_gap(run, runs[0], train_from, window)) if along else "")
        )
    return "\n".join(lines) + "\n"


def mean_run(runs: list, window: int = 1) -> dict:
    """The runs' training losses (each averaged over `window` logged points first) averaged at
    every iteration all of them logged, as a run of its own."""
    curves = [smoothed_training_loss(r, window) for r in runs]
    shared = sorted(set.intersection(*(set(curve) for curve in curves)))
    return {TRAIN: (shared, [sum(curve[i] for curve in curves) / len(curves) for i in shared])}


def repeats_table(
    runs: list,
    labels: list,
    repeats: int,
    points: int = 10,
    train_from: int | None = None,
    window: int = 1,
) -> str:
    """Each setting's mean over its `repeats` runs (consecutive runs, named by the first's
    label), against the first setting's, as Markdown: the final losses, how far its runs' final
    validation losses lie apart (highest over lowest), and with `train_from` its mean training
    loss against the first setting's along the run."""
    settings = [runs[i : i + repeats] for i in range(0, len(runs), repeats)]
    finals = [[final_losses(run, points) for run in setting] for setting in settings]

    def mean(values):
        return None if None in values else sum(values) / len(values)

    valid = [mean([f["valid"] for f in setting]) for setting in finals]
    train = [mean([f["train"] for f in setting]) for setting in finals]
    curves = [mean_run(setting, window) for setting in settings]
    base = labels[0]

    def apart(setting):
        values = [f["valid"] for f in setting]
        return "–" if None in values else f"{100 * (max(values) / min(values) - 1):.2f}%"

    along = (
        f" mean training loss vs {base}'s from iteration {train_from} (mean, largest) |"
        if train_from is not None
        else ""
    )
    lines = [
        f"Each setting over its {repeats} runs, against {base}'s:",
        "",
        f"| setting | final validation loss (mean of {repeats}) | vs {base} | its runs apart "
        f"| final training loss (mean of {repeats}) | vs {base} |" + along,
        "|---|---|---|---|---|---|" + ("---|" if along else ""),
    ]
    for i, setting in enumerate(finals):
        row = (
            f"| {labels[i * repeats]} | {_loss(valid[i])} | {_versus(valid[i], valid[0])}"
            f" | {apart(setting)} | {_loss(train[i])} | {_versus(train[i], train[0])} |"
        )
        if along:
            row += _gap_cell(training_gap(curves[i], curves[0], train_from))
        lines.append(row)
    return "\n".join(lines) + "\n"


def relative_to_first(runs: list, field: str = VALID) -> list:
    """Each run's `field` against the first run's, in percent, at the iterations both logged:
    [(iterations, percents) or None per run]."""
    if field not in runs[0]:
        raise PlotError(f"--relative: the first run (the baseline) logged no {field}")
    base = dict(zip(*runs[0][field]))
    curves = []
    for run in runs:
        shared = [(i, v) for i, v in zip(*run[field]) if i in base] if field in run else []
        curves.append(
            ([i for i, _ in shared], [100 * (v / base[i] - 1) for i, v in shared])
            if shared
            else None
        )
    return curves


def plot(
    runs: list,
    labels: list,
    fields: list,
    output: Path,
    smooth: int = 1,
    log_y=(),
    title=None,
    relative: bool = False,
) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise PlotError(
            "matplotlib is not installed: pip install matplotlib (or megafp8's plot extra)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(TRAIN in run for run in runs):
        raise PlotError('no run logged a training loss ("loss")')
    curves = {RELATIVE: relative_to_first(runs)} if relative else {}
    panels = (
        [TRAIN]
        + ([VALID] if any(VALID in run for run in runs) else [])
        + ([RELATIVE] if relative else [])
        + list(fields)
    )
    for field in fields:
        if not any(field in run for run in runs):
            known = sorted({f for run in runs for f in run})
            raise PlotError(f"--fields {field}: no run logged it; the runs have {', '.join(known)}")
    figure, axes = plt.subplots(
        len(panels), 1, figsize=(8, 3 * len(panels)), sharex=True, squeeze=False
    )
    for axis, field in zip(axes[:, 0], panels):
        for index, (run, label) in enumerate(zip(runs, labels)):
            curve = curves[field][index] if field in curves else run.get(field)
            if curve is None:
                continue
            iterations, values = curve
            if field == TRAIN and smooth > 1:
                values = moving_average(values, smooth)
            axis.plot(
                iterations,
                values,
                label=label,
                color=f"C{index % 10}",
                marker="o" if len(iterations) == 1 else None,
            )
        name = {
            TRAIN: "training loss" + (f" (mean of {smooth} points)" if smooth > 1 else ""),
            VALID: "validation loss",
            RELATIVE: f"validation loss vs {labels[0]} (%)",
        }.get(field, field)
        axis.set_ylabel(name)
        if field in log_y:
            axis.set_yscale("log")
        axis.grid(True, alpha=0.3)
        axis.legend()
    axes[-1, 0].set_xlabel("iteration")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120)
    plt.close(figure)
    return output


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Draw training and validation loss (and any other "
        "metrics.jsonl field) of several runs on shared axes."
    )
    parser.add_argument(
        "runs", nargs="+", metavar="RUN", help="a run folder holding metrics.jsonl, or the file"
    )
    parser.add_argument("--output", required=True, help="the picture to write (PNG by its suffix)")
    parser.add_argument(
        "--labels",
        nargs="+",
        help="one legend label per run (default: the run folders' names; "
        "for a folder named checkpoints, the one above it)",
    )
    parser.add_argument(
        "--fields", nargs="*", default=[], help="more metrics.jsonl fields, a panel each"
    )
    parser.add_argument(
        "--smooth", type=int, default=1, help="average the training loss over N logged points"
    )
    parser.add_argument(
        "--log-y", nargs="*", default=[], help="panels (fields) drawn on a log scale"
    )
    parser.add_argument(
        "--relative",
        action="store_true",
        help="add a panel of each run's validation loss against the first run's, in percent",
    )
    parser.add_argument("--title")
    parser.add_argument(
        "--table", help="also write the final losses, against the first run's, as Markdown here"
    )
    parser.add_argument(
        "--final-points",
        type=int,
        default=10,
        help="the final training loss is the mean of this many last logged points",
    )
    parser.add_argument(
        "--train-from",
        type=int,
        metavar="ITERATION",
        help="the table also compares the training loss (averaged over --smooth points) with the "
        "first run's at every logged iteration from this one on: the mean and the largest",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        metavar="K",
        help="the runs come in settings of K consecutive runs each (e.g. K initialisations): "
        "the table also gives each setting's mean against the first setting's",
    )
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        parser.error(f"--labels: {len(args.labels)} labels for {len(args.runs)} runs")
    if args.smooth < 1:
        parser.error(f"--smooth {args.smooth}: give 1 (none) or more points")
    if args.final_points < 1:
        parser.error(f"--final-points {args.final_points}: give 1 or more points")
    if args.train_from is not None and not args.table:
        parser.error("--train-from adds a column to the table: give --table too")
    if args.repeats is not None:
        if not args.table:
            parser.error("--repeats adds a table of means: give --table too")
        if args.repeats < 2 or len(args.runs) % args.repeats:
            parser.error(
                f"--repeats {args.repeats}: give 2 or more, dividing the {len(args.runs)} runs "
                "into settings of that many"
            )
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        paths = [metrics_path(run) for run in args.runs]
        runs = [read_run(path) for path in paths]
        labels = args.labels or default_labels(paths)
        output = plot(
            runs,
            labels,
            args.fields,
            Path(args.output),
            args.smooth,
            set(args.log_y),
            args.title,
            args.relative,
        )
        if args.table:
            Path(args.table).parent.mkdir(parents=True, exist_ok=True)
            text = table(runs, labels, args.final_points, args.train_from, args.smooth)
            if args.repeats:
                text += "\n" + repeats_table(
                    runs, labels, args.repeats, args.final_points, args.train_from, args.smooth
                )
            Path(args.table).write_text(text)
    except PlotError as error:
        print(f"plot_runs.py: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {output}" + (f" and {args.table}" if args.table else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
