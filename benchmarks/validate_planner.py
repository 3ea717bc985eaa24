"""The planner's models against what GPUs measured: the memory model's peak per GPU, and, given
layer maps and collective bandwidths measured on the same GPUs and code, the throughput model's
tokens/s per GPU and its ranking of the layouts.

    python benchmarks/validate_planner.py [RESULTS_DIR ...] \
        [--layer-maps gpt-1.3b_tp1.json gpt-1.3b_tp2.json ... --collectives collectives.json]

Reads the JSON lines `bench_layouts.py` wrote (default: benchmarks/results/several_gpus/2026-11-22_8xH200,
the eight-GPU layouts of RESULTS.md). Memory: per record, the peak predicted for the fullest
pipeline stage against `peak_memory_gib` (torch.cuda.max_memory_allocated); only the first
precision of each launch is compared, as the later ones in the same process carried memory the
runs before them leaked (RESULTS.md, "Eight GPUs"). Throughput (with --layer-maps): every record's
predicted against measured `tokens_per_sec_per_gpu`, and per model, precision and GPU count
whether the predicted order of the layouts is the measured one (the issue's bar: rank order
right, each within 15%; the planner ranks the layouts of one GPU count, never 2 against 4;
two runs predicted alike, as a bf16 pipeline graphed and eager, claim no order).
Each model's flags come from the label's prefix, as benchmarks/layouts_8gpu.sh ran them, unless
the record names its own (the pipeline split, the distributed optimizer, --overlap-param-gather,
recomputation: bench_layouts.py records them). Maps
and records must come from the same code: a map of today's code says nothing about layouts
measured before its speed-ups.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

from megafp8.models.config import preset

from megafp8.planner.memory import MemoryLayout, estimate
from megafp8.planner.throughput import Calibration, NotPredicted, predict

DEFAULT = Path(__file__).resolve().parent / "results" / "several_gpus" / "2026-11-22_8xH200"
# What layouts_8gpu.sh gave each model: its preset (with the sample corpus's 32768-token
# vocabulary) and flags.
MODELS = {
    "gpt": ("gpt-1.3b", dict(distributed_optimizer=False, recompute="none")),
    "llama": ("llama2-7b", dict(distributed_optimizer=True, recompute="selective")),
}
VOCAB = 32768
THROUGHPUT_BAR = 0.15


def preset_of(record: dict) -> str:
    """The preset a bench_layouts.py record trained (its label's model family)."""
    return MODELS[record["label"].split("_")[0]][0]


# Flags a record may name itself (bench_layouts.py records them since 2026-11-28); older records
# ran their model's flags above.
RECORDED_FLAGS = (
    "first_stage_layers",
    "last_stage_layers",
    "stage_layout",
    "distributed_optimizer",
    "overlap_param_gather",
    "recompute",
)


def layout_of(record: dict) -> tuple:
    """(model config, MemoryLayout) of a bench_layouts.py record."""
    name, flags = MODELS[record["label"].split("_")[0]]
    flags = flags | {key: record[key] for key in RECORDED_FLAGS if key in record}
    config = preset(name, vocab_size=VOCAB)
    dp = record["dp"]
    return config, MemoryLayout(
        seq_length=record["seq_length"],
        micro_batch_size=record["micro_batch_size"],
        num_micro_batches=record["global_batch_size"] // (dp * record["micro_batch_size"]),
        tp=record["tp"],
        pp=record["pp"],
        dp=dp,
        vpp=record.get("vpp") or 1,
        sequence_parallel=record["tp"] > 1,
        fp8=None if record["precision"] == "bf16" else record["precision"],
        **flags,
    )


def predicted_gib(record: dict) -> float:
    config, layout = layout_of(record)
    return max(stage["total"] for stage in estimate(config, layout)) / 2**30


def gpus_of(record: dict) -> int:
    return record["tp"] * record["pp"] * record["dp"]


def run_name(record: dict) -> str:
    """The record's label, with its GPU count where the label lacks it (layouts_8gpu.sh names a
    tp:pp layout alike on 2, 4 and 8 GPUs)."""
    label = record["label"]
    graphed = ", graphed" if pipeline_graphs(record) else ""
    gpus = gpus_of(record)
    return (
        label
        if label.endswith("gpu")
        else f"{label} ({gpus} GPU{'s' if gpus > 1 else ''}{graphed})"
    )


def pipeline_graphs(record: dict) -> bool:
    """Whether a pipeline layout ran its stages as CUDA graphs (a record without "cuda_graph" is
    from before it was recorded, when the trainer refused to graph a pipeline: eager)."""
    return record["pp"] > 1 and record.get("cuda_graph", False)


def read_records(folders) -> list[list[dict]]:
    """The records of each launch (one JSON-lines file), in file order."""
    launches = []
    for folder in folders:
        for path in sorted(Path(folder).glob("*.jsonl")):
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            lines = [
                r
                for r in lines
                if r.get("tokens_per_sec_per_gpu") and r["label"].split("_")[0] in MODELS
            ]
            if lines:
                launches.append(lines)
    return launches


def memory_table(launches) -> None:
    worst, firsts = 0.0, [launch[0] for launch in launches if launch[0].get("peak_memory_gib")]
    if not firsts:
        print("(memory not checked: the records hold no peak memory)")
        return
    print("| run | precision | tp x pp x dp | measured GiB | predicted GiB | error |")
    print("|---|---|---|---|---|---|")
    for record in firsts:
        measured, predicted = record["peak_memory_gib"], predicted_gib(record)
        error = predicted / measured - 1
        worst = max(worst, abs(error))
        print(
            f"| {run_name(record)} | {record['precision']} | {record['tp']} x {record['pp']} x {record['dp']} | "
            f"{measured:.1f} | {predicted:.1f} | {100 * error:+.1f}% |"
        )
    print(f"\nlargest error {100 * worst:.1f}% over {len(firsts)} runs")


def throughput_table(launches, calibration: Calibration) -> tuple[bool, int, int]:
    """Predicted against measured tokens/s per GPU: whether every covered record is within the
    bar and every group's order is the measured one, and how many records were and were not
    covered."""
    print(
        "\n| run | precision | tp x pp x dp | measured tokens/s/GPU | predicted | error | stretched |"
    )
    print("|---|---|---|---|---|---|---|")
    groups, passed, uncovered = {}, True, 0
    for record in (r for launch in launches for r in launch):
        config, layout = layout_of(record)
        name = f"| {run_name(record)} | {record['precision']} | {record['tp']} x {record['pp']} x {record['dp']} |"
        measured = record["tokens_per_sec_per_gpu"]
        try:
            result = predict(
                config,
                layout,
                calibration,
                record["global_batch_size"],
                model=preset_of(record),
                pipeline_graphs=pipeline_graphs(record),
            )
        except NotPredicted as why:
            print(f"{name} {measured:,.0f} | not covered: {why} | | |")
            uncovered += 1
            continue
        error = result["tokens_per_s_per_gpu"] / measured - 1
        passed &= abs(error) <= THROUGHPUT_BAR
        groups.setdefault(
            (record["label"].split("_")[0], record["precision"], gpus_of(record)), []
        ).append((run_name(record), measured, result["tokens_per_s_per_gpu"]))
        print(
            f"{name} {measured:,.0f} | {result['tokens_per_s_per_gpu']:,.0f} | {100 * error:+.1f}% | "
            f"{'; '.join(result['extrapolated']) or '–'} |"
        )
    for (model, precision, gpus), runs in sorted(groups.items()):
        if len(runs) < 2:
            continue
        measured_order = ", ".join(label for label, *_ in sorted(runs, key=lambda r: -r[1]))
        predicted_order = predicted_ranking(runs)
        agrees = order_agrees(runs)
        passed &= agrees
        verdict = (
            "predicted the same"
            if predicted_order == measured_order
            else f"predicted {predicted_order} ({'agrees: equals claim no order' if agrees else 'wrong'})"
        )
        print(f"\n{model} {precision} on {gpus} GPUs: measured order {measured_order}; {verdict}")
    return passed, sum(len(runs) for runs in groups.values()), uncovered


def same_prediction(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


def order_agrees(runs) -> bool:
    """Whether every pair of (name, measured, predicted) runs that the prediction tells apart ran
    in that order. A pair predicted equal claims no order: the model times both alike (a bf16
    pipeline graphed or eager), so whichever measured faster is noise, not a miss."""
    return all(
        same_prediction(p1, p2) or (m1 > m2) == (p1 > p2)
        for (_, m1, p1), (_, m2, p2) in itertools.combinations(runs, 2)
    )


def predicted_ranking(runs) -> str:
    """The names by predicted throughput, fastest first, equal predictions joined by " = "."""
    ranked, text = sorted(runs, key=lambda r: -r[2]), ""
    for i, (name, _, predicted) in enumerate(ranked):
        if i:
            text += " = " if same_prediction(ranked[i - 1][2], predicted) else ", "
        text += name
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "folders", nargs="*", default=[DEFAULT], help="folders of bench_layouts.py JSON lines"
    )
    parser.add_argument(
        "--layer-maps",
        nargs="+",
        default=[],
        metavar="JSON",
        help="layer maps of the GPUs the records ran on (benchmarks/bench_layer_grid.py --model)",
    )
    parser.add_argument(
        "--collectives", metavar="JSON", help="their collective bandwidths (bench_collectives.py)"
    )
    args = parser.parse_args(argv)
    launches = read_records(args.folders)
    if not launches:
        print(
            f"validate_planner.py: no bench_layouts.py records in {', '.join(map(str, args.folders))}",
            file=sys.stderr,
        )
        return 2
    memory_table(launches)
    if not args.layer_maps:
        print(
            "\n(throughput not checked: give --layer-maps and --collectives measured on the same GPUs and code)"
        )
        return 0
    try:
        calibration = Calibration.load(args.layer_maps, args.collectives)
    except ValueError as error:
        print(f"validate_planner.py: {error}", file=sys.stderr)
        return 2
    mixed = calibration.mixed_devices(
        *{record["device"] for launch in launches for record in launch if "device" in record}
    )
    if mixed:
        print(f"\nwarning: {mixed}")
    passed, covered, uncovered = throughput_table(launches, calibration)
    print(
        f"\nthroughput within {100 * THROUGHPUT_BAR:.0f}% and in the measured order: {'yes' if passed else 'no'} "
        f"({covered} runs predicted"
        + (f"; {uncovered} not covered, each with why, above)" if uncovered else ")")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
