r"""What a training run will hold per GPU, by the memory model (megafp8.planner.memory), from the
trainer's own flags: for each pipeline stage its parameters, gradients, optimizer states, FP8
weight casts and activations, and what a layer saves for backward per micro-batch, by role.

    python tools/memory_report.py --gpus 8 [--gpu-memory 80] -- --model llama2-7b --seq-length 4096 \
        --micro-batch-size 1 --pipeline-model-parallel-size 4 --bf16 --fp8-format hybrid \
        --recompute-granularity selective [--exp-avg-dtype bf16 ...]

The flags after `--` are checked by the trainer's rules (its message where they do not hold);
data, iterations and the learning rate do not change the memory and may be left out. What the
model leaves out (allocator fragmentation, a backward's transient buffers, CUDA graphs' pools)
comes on top: plan with a margin (tools/plan_parallel.py keeps 10%).
"""

from __future__ import annotations

import argparse
import sys

from megafp8.planner.memory import (
    MemoryLayout,
    estimate,
    layer_activation_roles,
    micro_batches_in_flight,
    stage_layer_parts,
)
from megafp8.training import arguments

# Flags the trainer needs that the memory does not depend on, added where the command has none.
FILLERS = (
    (("--mock-data", "--data-path", "--train-data-path"), ["--mock-data"]),
    (("--train-iters", "--train-samples"), ["--train-iters", "1", "--lr-warmup-iters", "0"]),
    (("--lr",), ["--lr", "1e-4"]),
)
KINDS = ("parameters", "gradients", "optimizer", "fp8_weight_casts", "activations", "total")
GIB = 2**30


def trainer_flags(flags: list[str]) -> list[str]:
    """`flags` with the memory-neutral ones the trainer requires added where absent."""
    given = {flag.split("=")[0] for flag in flags if flag.startswith("--")}
    extra = [filler for names, filler in FILLERS if not given & set(names)]
    return flags + [flag for filler in extra for flag in filler]


def report(flags: list[str], gpus: int, gpu_memory: float | None = None) -> str:
    """The report of the run `flags` describe on `gpus` GPUs (arguments.ArgumentsError if the
    trainer would refuse them)."""
    args = arguments.validate_args(arguments.parse_args(trainer_flags(flags)), gpus)
    config = arguments.model_config(args, args.vocab_size)
    if args.balance_pipeline_split:
        arguments.balance_pipeline_split(args, config)
    layout = MemoryLayout.from_args(args)
    stages = estimate(config, layout)
    lines = [
        f"{args.model or 'model'}: tp {layout.tp} x pp {layout.pp} x dp {layout.dp}"
        f"{f' x vpp {layout.vpp}' if layout.vpp > 1 else ''}, micro-batch {layout.micro_batch_size} "
        f"({layout.num_micro_batches} a step per data-parallel rank), sequence "
        f"{layout.seq_length}, {f'FP8 {layout.fp8}' if layout.fp8 else 'bf16'}; GiB per GPU",
        "",
        "| pipeline stage | " + " | ".join(KINDS) + " | micro-batches in flight |",
        "|---" * (len(KINDS) + 2) + "|",
    ]
    for stage in stages:
        in_flight = micro_batches_in_flight(layout, stage["pp_rank"])
        lines.append(
            f"| {stage['pp_rank']} | "
            + " | ".join(f"{stage[kind] / GIB:.2f}" for kind in KINDS)
            + f" | {in_flight:g} |"
        )
    fullest = max(stages, key=lambda stage: stage["total"])
    if gpu_memory is not None:
        verdict = "fits" if fullest["total"] <= gpu_memory * GIB else "does not fit"
        lines += [
            "",
            f"The fullest stage ({fullest['total'] / GIB:.1f} GiB) {verdict} {gpu_memory:g} GiB.",
        ]
    lines += ["", "A layer's activations per micro-batch (MiB), by role:", ""]
    kept_in = {fp8 for _, _, fp8 in stage_layer_parts(config, layout, fullest["pp_rank"])}
    for fp8 in sorted(kept_in, reverse=True):
        roles = layer_activation_roles(config, layout, in_fp8=fp8)
        kept = {role: size for role, size in roles.items() if size}
        name = f"FP8 {layout.fp8} layer" if fp8 else "bf16 layer"
        lines.append(
            f"- {name}, {sum(kept.values()) / 2**20:.1f}: "
            + ", ".join(f"{role} {size / 2**20:.1f}" for role, size in kept.items())
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the run (its world size)")
    parser.add_argument("--gpu-memory", type=float, help="GiB per GPU: say whether it fits")
    args = parser.parse_args(ours)
    if not flags:
        parser.error("give the trainer's flags after --")
    try:
        print(report(flags, args.gpus, args.gpu_memory))
    except arguments.ArgumentsError as error:
        print(f"memory_report.py: the trainer would refuse these flags: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
