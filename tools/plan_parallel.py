r"""Which parallel layouts of a model fit a cluster, and how much memory each needs per GPU.

    python tools/plan_parallel.py --model llama2-7b --gpus 64 --gpu-memory 80 --seq-length 4096 \
        --global-batch-size 1024 [--fp8 delayed|current|rowwise|blockwise] [--gpus-per-node 8] [--micro-batch-sizes 1 2 4] \
        [--memory-margin 0.1] [--top 20] [--json plan.json] \
        [--layer-maps llama2-7b_tp1.json llama2-7b_tp2.json --collectives collectives.json] [--eager-pipelines]

Every tp x pp x dp layout (tp within a node, sequence parallelism with it), with or without
virtual pipeline stages (2 or 4 per rank), each micro-batch size, no / selective / full
recomputation and, where dp > 1, with and without the distributed optimizer, is checked by the
trainer's own argument rules (what does not divide the heads, layers, GPUs or batch is rejected
with the trainer's message) and by the memory model (megafp8.planner.memory: parameters,
gradients, optimizer states, FP8 weight casts and activations of the fullest pipeline stage),
against the GPU's memory less `--memory-margin` for what the model leaves out (allocator
fragmentation, a backward pass's transient buffers). The memory model is checked against the
trainer on the CPU and against eight-GPU peaks measured on H200s (within 4.2%: docs/tuning.md).

With measurements of the GPUs (`--layer-maps`: benchmarks/bench_layer_grid.py --model MODEL, on
1 GPU for tp 1 and under torchrun on tp GPUs for each tp > 1; `--collectives`:
benchmarks/bench_collectives.py on a node) the layouts that fit are ranked by predicted tokens/s
per GPU (megafp8.planner.throughput: the measured layer times, graphed as the recipes run
them, or with --eager-pipelines a pipeline stage's longer of those and the host's; the 1F1B
bubble, the collectives' measured bandwidths, the optimizer's pass), each saying where the
prediction stretches a measurement; a layout the measurements do not cover is listed apart with
what to measure. Without them the layouts that fit are only listed, simplest first: the fewest
GPUs in tp x pp, then no virtual stages, then no recomputation (then selective, then full), then
the largest micro-batch, then the least memory. Layouts that do not fit are counted by reason,
those out of memory with the range of memory they need and the nearest miss.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megafp8.planner.memory import MemoryLayout, estimate
from megafp8.planner.throughput import Calibration, NotPredicted, predict
from megafp8.training import arguments
from megafp8.training.flags import LEAN_OPTIMIZER_STATES

RECOMPUTE = ("none", "selective", "full")
VIRTUAL_STAGES = (1, 2, 4)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(args) -> list[dict]:
    """Every layout to check, in a fixed order: the simplest parallelism first."""
    out = []
    for tp in [t for t in divisors(min(args.gpus_per_node, args.gpus)) if args.gpus % t == 0]:
        for pp in divisors(args.gpus // tp):
            dp = args.gpus // (tp * pp)
            for vpp in VIRTUAL_STAGES if pp > 1 else (1,):
                for mbs in args.micro_batch_sizes:
                    for recompute in RECOMPUTE:
                        for distributed in (False, True) if dp > 1 else (False,):
                            out.append(
                                dict(
                                    tp=tp,
                                    pp=pp,
                                    dp=dp,
                                    vpp=vpp,
                                    micro_batch_size=mbs,
                                    recompute=recompute,
                                    distributed_optimizer=distributed,
                                )
                            )
    return out


def trainer_flags(args, layout: dict) -> list[str]:
    """The trainer's flags for `layout` (what `python -m megafp8.train` would be given)."""
    flags = [
        "--model",
        args.model,
        "--seq-length",
        str(args.seq_length),
        "--global-batch-size",
        str(args.global_batch_size),
        "--micro-batch-size",
        str(layout["micro_batch_size"]),
        "--tensor-model-parallel-size",
        str(layout["tp"]),
        "--pipeline-model-parallel-size",
        str(layout["pp"]),
        "--train-iters",
        "1",
        "--mock-data",
        "--bf16",
        "--lr",
        "1e-4",
        "--lr-warmup-iters",
        "0",
    ]
    if args.vocab_size:
        flags += ["--vocab-size", str(args.vocab_size)]
    if layout["tp"] > 1:
        flags.append("--sequence-parallel")
    if layout["pp"] > 1:  # as the recipes run pipelines: the output layer's rank given fewer layers
        flags += [
            "--num-virtual-stages-per-pipeline-rank",
            str(layout["vpp"]),
            "--balance-pipeline-split",
        ]
    if layout["recompute"] != "none":
        flags += ["--recompute-granularity", layout["recompute"]]
    if layout["distributed_optimizer"]:  # as the recipes run it
        flags += ["--use-distributed-optimizer", "--overlap-param-gather"]
    if args.fp8:  # the fine-grained recipes' format is E4M3 (docs/fp8.md)
        fmt = "e4m3" if args.fp8 in ("rowwise", "blockwise") else "hybrid"
        flags += ["--fp8-format", fmt, "--fp8-recipe", args.fp8]
    if args.lean_optimizer_states:
        flags += list(LEAN_OPTIMIZER_STATES)
    return flags


def check(args, layout: dict):
    """(config, memory layout, None) if the trainer accepts `layout`, else (None, None, its reason)."""
    try:
        parsed = arguments.validate_args(
            arguments.parse_args(trainer_flags(args, layout)), args.gpus
        )
    except (arguments.ArgumentsError, SystemExit) as error:
        return None, None, str(error).split("\n")[0]
    config = arguments.model_config(parsed, parsed.vocab_size)
    if parsed.balance_pipeline_split:
        arguments.balance_pipeline_split(parsed, config)
    return config, MemoryLayout.from_args(parsed), None


def plan(args, calibration: Calibration | None = None) -> dict:
    budget = args.gpu_memory * (1 - args.memory_margin) * 2**30
    fits, rejected, unpredicted = [], [], []
    for layout in candidates(args):
        config, memory, reason = check(args, layout)
        if config is None:
            rejected.append({**layout, "reason": reason})
            continue
        stages = estimate(config, memory)
        fullest = max(stages, key=lambda s: s["total"])
        entry = {
            **layout,
            "memory_gib": fullest["total"] / 2**30,
            "memory_by_kind_gib": {
                k: v / 2**30 for k, v in fullest.items() if k not in ("pp_rank", "total")
            },
        }
        if fullest["total"] > budget:
            rejected.append(
                {
                    **entry,
                    "reason": f"needs {entry['memory_gib']:.1f} GiB per GPU (pipeline stage "
                    f"{fullest['pp_rank']}), over {budget / 2**30:.1f} GiB",
                }
            )
        elif calibration is None:
            fits.append(entry)
        else:
            try:
                fits.append(
                    {
                        **entry,
                        **predict(
                            config,
                            memory,
                            calibration,
                            args.global_batch_size,
                            args.gpus_per_node,
                            args.model,
                            not args.eager_pipelines,
                        ),
                    }
                )
            except NotPredicted as why:
                unpredicted.append({**entry, "reason": str(why)})
    if calibration is not None:  # fastest first; equals in the simplicity order
        fits.sort(key=lambda e: (-round(e["tokens_per_s_per_gpu"], 6), *simplicity(e)))
    else:
        fits.sort(key=simplicity)
    return {
        "model": args.model,
        "gpus": args.gpus,
        "fp8": args.fp8,
        "budget_gib": budget / 2**30,
        "calibration": calibration.sources if calibration else None,
        "fits": fits,
        "not_predicted": unpredicted,
        "rejected": rejected,
    }


SIMPLEST_FIRST = (
    "the fewest GPUs in tp x pp, then no virtual stages, then no recomputation (then selective, then "
    "full), then the largest micro-batch, then the least memory"
)


def simplicity(entry: dict) -> tuple:
    """The sort key of SIMPLEST_FIRST."""
    return (
        entry["tp"] * entry["pp"],
        entry["vpp"],
        entry["recompute"] != "none",
        entry["recompute"] == "full",
        -entry["micro_batch_size"],
        entry["memory_gib"],
    )


def print_by_reason(heading: str, entries: list, key, describe=None) -> None:
    """`entries` counted by `key(entry)`, most common first, each group described by
    `describe(members)` (default: `by_reason`)."""
    groups = {}
    for entry in entries:
        groups.setdefault(key(entry), []).append(entry)
    print(heading)
    for members in sorted(groups.values(), key=lambda members: -len(members)):
        print(f"  {len(members):4d} x {(describe or by_reason)(members)}")


def by_reason(members: list) -> str:
    """A group's reason, with its first layout for an example."""
    return f"{members[0]['reason']}  (e.g. {layout_name(members[0])})"


def describe_rejected(members: list, gpu_memory: float, budget_gib: float) -> str:
    """Out-of-memory layouts by the range of memory they need and the nearest miss (one within the
    GPU's memory but not its margin may fit a smaller margin); any other reason as it is."""
    if "memory_gib" not in members[0]:
        return by_reason(members)
    nearest = min(members, key=lambda e: e["memory_gib"])
    least, most = f"{nearest['memory_gib']:.1f}", f"{max(e['memory_gib'] for e in members):.1f}"
    needs = f"needs {least}" if least == most else f"need {least} to {most}"
    within = (
        f", within the GPU's {gpu_memory:g} GiB but not its margin"
        if nearest["memory_gib"] <= gpu_memory
        else ""
    )
    return (
        f"{needs} GiB per GPU, over {budget_gib:.1f} GiB  (the nearest miss: {layout_name(nearest)}, "
        f"{least} GiB{within})"
    )


def layout_name(entry: dict) -> str:
    parts = [f"tp{entry['tp']} pp{entry['pp']} dp{entry['dp']}"]
    if entry["vpp"] > 1:
        parts.append(f"vpp{entry['vpp']}")
    parts.append(f"mbs{entry['micro_batch_size']}")
    if entry["recompute"] != "none":
        parts.append(f"recompute {entry['recompute']}")
    if entry["distributed_optimizer"]:
        parts.append("distributed optimizer")
    return ", ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a preset (megafp8.models.config.PRESETS)")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu-memory", type=float, required=True, help="GiB per GPU")
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--global-batch-size", type=int, required=True)
    parser.add_argument(
        "--fp8",
        choices=("delayed", "current", "rowwise", "blockwise"),
        help="FP8 with this scaling, HYBRID (rowwise and blockwise: E4M3; absent: bf16); the "
        "throughput model needs a layer map measured in it (bench_layer_grid.py --recipes)",
    )
    parser.add_argument(
        "--gpus-per-node", type=int, default=8, help="tensor parallelism stays within a node"
    )
    parser.add_argument(
        "--lean-optimizer-states",
        action="store_true",
        help=f"plan with the trainer's {' '.join(LEAN_OPTIMIZER_STATES)}",
    )
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--vocab-size", type=int, help="the tokenizer's vocabulary (default: the preset's)"
    )
    parser.add_argument(
        "--memory-margin",
        type=float,
        default=0.1,
        help="the share of GPU memory kept free for what the memory model leaves out (default 0.1)",
    )
    parser.add_argument("--top", type=int, default=20, help="layouts to print (default 20)")
    parser.add_argument("--json", help="write the whole plan here")
    parser.add_argument(
        "--layer-maps",
        nargs="+",
        default=[],
        metavar="JSON",
        help="measured layer maps (benchmarks/bench_layer_grid.py --model MODEL): rank by throughput",
    )
    parser.add_argument(
        "--collectives",
        metavar="JSON",
        help="measured collective bandwidths (benchmarks/bench_collectives.py)",
    )
    parser.add_argument(
        "--eager-pipelines",
        action="store_true",
        help="pipeline stages run without CUDA graphs (the recipes' CUDA_GRAPH=0; default: graphed, "
        "as the recipes run them)",
    )
    args = parser.parse_args(argv)
    for name in ("gpus", "gpus_per_node", "seq_length", "global_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.gpu_memory <= 0 or not 0 <= args.memory_margin < 1:
        parser.error("--gpu-memory must be positive and --memory-margin in [0, 1)")
    try:
        from megafp8.models.config import PRESETS

        args.num_layers = PRESETS[args.model].num_layers
    except KeyError:
        parser.error(f"--model {args.model!r} is not a preset; give one of {', '.join(PRESETS)}")
    if args.collectives and not args.layer_maps:
        parser.error("--collectives goes with --layer-maps (the layer times the ranking needs)")
    try:
        calibration = (
            Calibration.load(args.layer_maps, args.collectives) if args.layer_maps else None
        )
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    result = plan(args, calibration)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    fits = result["fits"]
    print(
        f"{args.model} on {args.gpus} GPUs of {args.gpu_memory:g} GiB ({'FP8 ' + args.fp8 if args.fp8 else 'bf16'}), "
        f"sequence {args.seq_length}, global batch {args.global_batch_size}: "
        f"{len(fits) + len(result['not_predicted'])} layouts fit in {result['budget_gib']:.1f} GiB per GPU, "
        f"{len(result['rejected'])} do not"
    )
    if calibration is None:
        print(
            f"(listed, not ranked by throughput: give --layer-maps and --collectives measured on these GPUs; "
            f"simplest first: {SIMPLEST_FIRST})"
        )
    else:
        print(
            f"ranked by predicted tokens/s per GPU from {'; '.join(calibration.sources)}; "
            f"{len(result['not_predicted'])} fitting layouts not covered by the measurements"
        )
        mixed = calibration.mixed_devices()
        if mixed:
            print(f"warning: {mixed}")
    for entry in fits[: args.top]:
        kinds = ", ".join(
            f"{k.replace('_', ' ')} {v:.1f}" for k, v in entry["memory_by_kind_gib"].items() if v
        )
        speed = ""
        if calibration is not None:
            stretched = (
                f", {len(entry['extrapolated'])} extrapolated" if entry["extrapolated"] else ""
            )
            speed = f"{entry['tokens_per_s_per_gpu']:9,.0f} tokens/s/GPU  {entry['step_ms']:8.1f} ms/step{stretched}  "
        print(f"  {layout_name(entry):<60} {speed}{entry['memory_gib']:6.1f} GiB  ({kinds})")
    stretches = sorted(
        {note for entry in fits[: args.top] for note in entry.get("extrapolated", ())}
    )
    if stretches:
        print("where the predictions above stretch the measurements:")
        for note in stretches:
            print(f"  - {note}")
    if result["not_predicted"]:
        print_by_reason("fit, not predicted:", result["not_predicted"], key=lambda e: e["reason"])
    print_by_reason(
        "rejected:",
        result["rejected"],
        key=lambda e: "out of memory" if "memory_gib" in e else e["reason"].split(":")[0],
        describe=lambda members: describe_rejected(members, args.gpu_memory, result["budget_gib"]),
    )
    if not fits and not result["not_predicted"]:
        print(
            "no layout fits: more GPUs, a shorter sequence or FP8's smaller activations may",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
