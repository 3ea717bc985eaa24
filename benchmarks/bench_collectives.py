"""Bandwidth of the collectives a 3D-parallel trainer runs: all-reduce, all-gather, reduce-scatter
over groups of k consecutive ranks (as tensor-parallel groups are laid out, every group at once,
as in training) and send/recv between rank pairs (as pipeline stages pass activations).

    torchrun --standalone --nproc-per-node 8 benchmarks/bench_collectives.py --output coll.json \\
        [--sizes-mb 1 4 16 64 256 1024] [--group-sizes 2 4 8] \\
        [--ops all_reduce all_gather reduce_scatter send_recv] [--dtype bf16] [--warmup 5] [--iters 20]

NCCL with one GPU per process (from LOCAL_RANK) where CUDA is available, else gloo on the CPU.
The group sizes default to every power of two from 2 that divides the world size. A size S is
the bytes of the all-reduce's tensor, of the all-gather's output (each rank gives S/k), of the
reduce-scatter's input (each rank keeps S/k) and of the message sent; element counts are
rounded to a multiple of k. send_recv pairs ranks (0, 1), (2, 3), ...: it is recorded once, as
group size 2, when 2 is among the group sizes.

The time of one op is the slowest rank's mean over --iters repetitions after --warmup (CUDA
events on a GPU, the wall clock on the CPU), so every rank reports the same. algbw is S / time
(GB/s of 1e9 bytes); busbw follows nccl-tests: algbw x 2(k-1)/k for all-reduce, x (k-1)/k for
all-gather and reduce-scatter, algbw itself for send/recv, comparable with the link's bandwidth.

Rank 0 writes the JSON that the planner reads (tools/plan_parallel.py --collectives):
{"device", "gpus", "backend", "torch", "dtype", "nvls_disabled", "results": [{"op",
"group_size", "bytes", "ms", "algbw_gbs", "busbw_gbs"}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megafp8.collectives import (
    all_gather_into,
    backends_without_reduce_scatter,
    reduce_scatter_into,
)
from megafp8.planner.throughput import (
    BUS_FACTOR,  # the planner reads busbw back with the same factors
)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def group_sizes(args, world: int) -> list[int]:
    """The group sizes to measure; a ValueError naming the flag for what cannot run."""
    if any(size <= 0 for size in args.sizes_mb):
        raise ValueError(
            f"--sizes-mb must be positive (got {' '.join(map(str, args.sizes_mb))}): "
            "give sizes in MiB such as 1 16 256"
        )
    if args.warmup < 0 or args.iters < 1:
        raise ValueError("--warmup must be 0 or more and --iters 1 or more")
    if world < 2:
        raise ValueError(
            "collectives need 2 or more ranks (world size 1): run under torchrun with 2 or more "
            "processes, e.g. torchrun --standalone --nproc-per-node 8 benchmarks/bench_collectives.py "
            "--output coll.json"
        )
    if args.group_sizes is None:
        sizes = [k for k in (2**i for i in range(1, world.bit_length())) if world % k == 0]
        if not sizes:
            raise ValueError(
                f"no power of two divides the world size {world}: give --group-sizes (e.g. {world})"
            )
        return sizes
    bad = [k for k in args.group_sizes if k < 2 or world % k]
    if bad:
        fitting = " ".join(str(k) for k in range(2, world + 1) if world % k == 0)
        raise ValueError(
            f"--group-sizes {' '.join(map(str, bad))} does not divide the world size {world} into "
            f"groups of 2 or more ranks: give sizes among {fitting}"
        )
    return sorted(set(args.group_sizes))


def measure(call, warmup: int, iters: int, device: torch.device) -> float:
    """The slowest rank's mean milliseconds per `call()`."""
    for _ in range(warmup):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()  # every rank starts together: a late rank would count as slow collectives
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / iters
    else:
        began = time.perf_counter()
        for _ in range(iters):
            call()
        ms = (time.perf_counter() - began) * 1e3 / iters
    slowest = torch.tensor(ms, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def op_call(op: str, numel: int, k: int, group, dtype, device):
    """A no-argument call of `op` on `numel` elements (S) within this rank's `group` of `k`."""
    full = torch.zeros(numel, dtype=dtype, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "send_recv":  # the even rank of each pair sends to the odd one
        rank = dist.get_rank()
        return (
            (lambda: dist.send(full, rank + 1))
            if rank % 2 == 0
            else (lambda: dist.recv(full, rank - 1))
        )
    part = torch.zeros(numel // k, dtype=dtype, device=device)
    if op == "all_gather":
        return lambda: all_gather_into(full, part, group)
    return lambda: reduce_scatter_into(part, full, group)


def run(args, device: torch.device, sizes: list[int]) -> list[dict]:
    """Measure every op, group size and message size; the records, alike on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {}
    for k in sizes:  # new_group is collective: every rank makes every group, in the same order
        for first in range(0, world, k):
            group = dist.new_group(list(range(first, first + k)))
            if first <= rank < first + k:
                groups[k] = group
    element = DTYPES[args.dtype].itemsize
    results = []
    for op in args.ops:
        # send_recv: pairs, k = 2
        for k in sizes if op != "send_recv" else [k for k in sizes if k == 2]:
            for mib in args.sizes_mb:
                numel = max(k, round(mib * 2**20 / element / k) * k)
                size = numel * element
                ms = measure(
                    op_call(op, numel, k, groups[k], DTYPES[args.dtype], device),
                    args.warmup,
                    args.iters,
                    device,
                )
                backend = dist.get_backend(groups[k])
                if op == "reduce_scatter" and backend in backends_without_reduce_scatter:
                    # megafp8 fell back to an all-reduce, alike on every rank: that is not the collective
                    # said once, by rank 0
                    raise SystemExit(
                        f"bench_collectives: error: the {backend} backend has no reduce-scatter (megafp8 "
                        "runs an all-reduce instead); leave reduce_scatter out of --ops"
                        if rank == 0
                        else 1
                    )
                algbw = size / ms / 1e6  # bytes per ms / 1e6 = GB/s
                results.append(
                    {
                        "op": op,
                        "group_size": k,
                        "bytes": size,
                        "ms": ms,
                        "algbw_gbs": algbw,
                        "busbw_gbs": algbw * BUS_FACTOR[op](k),
                    }
                )
                if rank == 0:
                    print(
                        f"{op:14} k={k:<3} {size / 2**20:10.3f} MiB {ms:9.3f} ms "
                        f"busbw {results[-1]['busbw_gbs']:8.2f} GB/s",
                        flush=True,
                    )
    if "send_recv" in args.ops and 2 not in sizes and rank == 0:
        print(
            "bench_collectives: send_recv skipped: it pairs ranks, as group size 2, not among --group-sizes"
        )
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", required=True, type=Path, help="JSON file rank 0 writes")
    parser.add_argument(
        "--sizes-mb", nargs="+", type=float, default=[1, 4, 16, 64, 256, 1024], help="MiB"
    )
    parser.add_argument(
        "--group-sizes", nargs="+", type=int, help="default: powers of two dividing the world size"
    )
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    own_group = not dist.is_initialized()  # tests start the group themselves
    rank = int(os.environ.get("RANK", "0")) if own_group else dist.get_rank()
    world = int(os.environ.get("WORLD_SIZE", "1")) if own_group else dist.get_world_size()
    try:
        sizes = group_sizes(args, world)
    except ValueError as error:  # every rank finds the same problem: said once, by rank 0
        raise SystemExit(f"bench_collectives: error: {error}" if rank == 0 else 1) from None
    if own_group:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            device_id=torch.device("cuda", torch.cuda.current_device()) if cuda else None,
        )
    backend = dist.get_backend()
    # A group started with gloo (the tests) stays on the CPU even where there are GPUs.
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    try:
        results = run(args, device, sizes)
    finally:
        if own_group:
            dist.destroy_process_group()
    if rank == 0:
        report = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "gpus": world,
            "backend": backend,
            "torch": torch.__version__,
            "dtype": args.dtype,
            "nvls_disabled": os.environ.get("NCCL_NVLS_ENABLE") == "0",
            "results": results,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
