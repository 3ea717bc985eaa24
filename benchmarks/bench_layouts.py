"""One parallel layout of the pretraining job in bf16 and in FP8 (delayed and current scaling).

The trainer runs once per precision inside one torchrun launch, so the launch, the imports and
the NCCL set-up are paid once. Everything after `--` is the trainer's command line (give it
--bf16; the FP8 flags are added per precision, as examples/pretrain_fp8.sh adds them):

    torchrun --standalone --nproc-per-node 8 benchmarks/bench_layouts.py --output runs.jsonl \\
        --precisions bf16 delayed current -- --model gpt-1.3b --bf16 --tensor-model-parallel-size 2 ...

Appends one JSON line per precision to --output (written by the last rank, which holds the
loss): the layout, the last logged window's tokens/s per GPU, TFLOP/s per GPU and MFU, the peak
memory allocated on any rank, what the run left allocated after it (which would count in the next
run's peak), and the loss of every step; and prints a table row for each.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from megafp8.training.trainer import pretrain

PRECISION_FLAGS = {
    "bf16": [],
    "delayed": [
        "--fp8-format",
        "hybrid",
        "--fp8-recipe",
        "delayed",
        "--fp8-amax-history-len",
        "1024",
        "--fp8-amax-compute-algo",
        "max",
    ],
    "current": ["--fp8-format", "hybrid", "--fp8-recipe", "current"],
    # fine-grained scaling (not run unless asked for), in E4M3 as those recipes train
    "rowwise": ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
    "blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
}
DEFAULT_PRECISIONS = ["bf16", "delayed", "current"]


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--precisions", nargs="+", choices=tuple(PRECISION_FLAGS), default=DEFAULT_PRECISIONS
    )
    parser.add_argument("--output", required=True, type=Path, help="JSON lines file to append to")
    parser.add_argument("--label", default="", help="a name for this series, kept in each record")
    parser.add_argument(
        "trainer_args", nargs=argparse.REMAINDER, help="-- then the trainer's flags"
    )
    args = parser.parse_args(argv)
    if args.trainer_args[:1] == ["--"]:
        args.trainer_args = args.trainer_args[1:]
    if not args.trainer_args:
        parser.error("give the trainer's flags after --")
    return args


def run_one(trainer_args: list[str], precision: str, device: torch.device) -> dict:
    """Train once; return this run's figures (complete on the last rank)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = _allocated(device)
    with tempfile.TemporaryDirectory(prefix=f"bench_{precision}_") as run_dir:
        trainer = pretrain(
            trainer_args + PRECISION_FLAGS[precision] + ["--tensorboard-dir", run_dir]
        )
        records = (
            [
                json.loads(line)
                for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
            ]
            if trainer.is_logger
            else []
        )
    a, groups = trainer.args, trainer.groups
    # stopped early (SIGTERM, --exit-*): no figures for a partial run
    if trainer.iteration < a.train_iters:
        raise SystemExit(
            f"bench_layouts: the {precision} run stopped at iteration {trainer.iteration} of "
            f"{a.train_iters}; nothing recorded for it"
        )
    peak = _max_over_ranks(
        torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0, device
    )
    timed = [r for r in records if "tokens_per_sec" in r]
    last = timed[-1] if timed else {}
    result = {
        "precision": precision,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": a.world_size,
        "tp": groups.tp_size,
        "pp": groups.pp_size,
        "dp": groups.dp_size,
        "vpp": a.virtual_pipeline_model_parallel_size,
        "micro_batch_size": a.micro_batch_size,
        "global_batch_size": a.global_batch_size,
        "seq_length": a.seq_length,
        "cuda_graph": bool(a.enable_cuda_graph),
        # what the planner's model reads besides the layout (validate_planner.py)
        "first_stage_layers": a.decoder_first_pipeline_num_layers,
        "last_stage_layers": a.decoder_last_pipeline_num_layers,
        "stage_layout": a.pipeline_stage_layers,
        "distributed_optimizer": bool(a.use_distributed_optimizer),
        "overlap_param_gather": bool(a.overlap_param_gather),
        "recompute": a.recompute_granularity or "none",
        "iterations": trainer.iteration,
        "window": [last["iteration"] - a.log_interval + 1, last["iteration"]] if last else None,
        "tokens_per_sec_per_gpu": last["tokens_per_sec"] / a.world_size if last else None,
        "tflops_per_gpu": last.get("tflops_per_gpu"),
        "mfu": last.get("mfu"),
        "iteration_time_ms": last.get("iteration_time_ms"),
        "peak_memory_gib": peak / 2**30,
        "losses": [loss for _, loss in trainer.history],
    }
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # What the run left allocated would inflate the next run's peak: say so in its record.
    result["memory_left_after_gib"] = _max_over_ranks(_allocated(device) - before, device) / 2**30
    return result


def _max_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def main(argv=None):
    args = parse(argv)
    if "--bf16" not in args.trainer_args:
        raise SystemExit(
            "bench_layouts: pass --bf16 among the trainer's flags (the baseline and FP8's "
            "high precision); it compares bf16 with FP8, not fp32"
        )
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    last_rank = dist.get_rank() == dist.get_world_size() - 1
    try:
        for precision in args.precisions:
            result = run_one(args.trainer_args, precision, device)
            if last_rank:
                result["label"] = args.label
                args.output.parent.mkdir(parents=True, exist_ok=True)
                with open(args.output, "a") as f:
                    f.write(json.dumps(result) + "\n")
                rate = result["tokens_per_sec_per_gpu"]
                if result["memory_left_after_gib"] > 0.1:
                    print(
                        f"bench_layouts: warning: the {precision} run left {result['memory_left_after_gib']:.1f} GiB "
                        "allocated, which counts in the next run's peak memory",
                        flush=True,
                    )
                print(
                    f"bench {args.label} tp{result['tp']} pp{result['pp']} dp{result['dp']} {precision:8s} "
                    f"tokens/s/GPU {rate:,.0f} | TFLOP/s/GPU {result['tflops_per_gpu']:.1f} | "
                    f"peak {result['peak_memory_gib']:.1f} GiB | loss@{result['iterations']} "
                    f"{result['losses'][-1]:.4f}",
                    flush=True,
                )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
