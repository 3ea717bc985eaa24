"""The GEMMs of `--tp-comm-overlap` beside their transfers (megafp8.collective_gemm), transport by
transport, at a transformer layer's shapes under tensor + sequence parallelism: the column
GEMMs (QKV, fc1) with the all-gather of their input, the row GEMMs (proj, fc2) with the
reduce-scatter of their output.

    torchrun --nproc-per-node 2 benchmarks/bench_collective_gemm.py \\
        [--hidden 2048] [--ffn 8192] [--tokens 8192] [--transports nccl copy-engine] [--sm-carveout 2] \\
        [--eager] [--output gemms.json]

Per GEMM, microseconds per call: the GEMM over all its rows alone; the transfer alone (NCCL's
all-gather of the input, or reduce-scatter of the output); the two one after the other (what
runs without the overlap); and the overlapped call on each transport. `hidden` is the share
of the transfer the overlap took off the plain call: (plain - overlapped) / transfer. On the
copy engines the overlapped GEMMs leave `--sm-carveout` SMs free for the transfers' kernels, as
the trainer's `--tp-comm-sm-carveout` (same default); the other columns use every SM.

On GPUs the operands are FP8 E4M3 (the FP8 linears' GEMM, megafp8.fp8.fp8_gemm, bf16 out),
each call replayed `--calls` times from one CUDA graph (the recipes' setting; `--eager` times
eager calls instead) after a warm-up, timed with CUDA events, the slowest rank's mean. On the
CPU (gloo) the GEMM is fp32 and only the nccl transport (gloo's) runs, eagerly: for testing.
`--tokens` is the micro-batch's tokens (micro-batch x sequence), split over the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megafp8 import collective_gemm, symmetric_memory
from megafp8.collectives import all_gather_into, group_size, reduce_scatter_into
from megafp8.fp8.gemm import fp8_gemm

TRANSPORTS = ("nccl", "copy-engine")
# its siblings' timing helpers (microseconds)
sys.path.insert(0, str(Path(__file__).resolve().parent))


def shapes(hidden: int, ffn: int, tp: int) -> list:
    """(name, kind, in_features, out_features) of this rank's share of each linear of a layer."""
    return [
        ("QKV", "column", hidden, 3 * hidden // tp),
        ("fc1", "column", hidden, ffn // tp),
        ("proj", "row", hidden // tp, hidden),
        ("fc2", "row", ffn // tp, hidden),
    ]


def microseconds(fn, device, calls: int, graphed: bool) -> float:
    """The slowest rank's mean time of one `fn()`: eager calls, or `calls` calls replayed from one
    CUDA graph (bench_collectives' timing around bench_fp8_linear's capture)."""
    from bench_collectives import measure

    if not graphed:
        return 1000 * measure(fn, warmup=3, iters=calls, device=device)
    from bench_fp8_linear import graphed as captured  # triton: GPUs only

    def many():
        for _ in range(calls):
            fn()

    return 1000 * measure(captured(many), warmup=1, iters=3, device=device) / calls


def measure(
    group,
    device,
    hidden: int,
    ffn: int,
    tokens: int,
    transports,
    calls: int,
    graphed: bool,
    sm_carveout: int = symmetric_memory.DEFAULT_SM_CARVEOUT,
) -> list:
    """One record per GEMM of the layer (module docstring): microseconds of each way to run it."""
    generator = torch.Generator(device=device).manual_seed(dist.get_rank())
    return [
        _measure_gemm(
            group,
            device,
            name,
            kind,
            k,
            n,
            tokens,
            transports,
            calls,
            graphed,
            generator,
            sm_carveout,
        )
        for name, kind, k, n in shapes(hidden, ffn, group_size(group))
    ]


def _measure_gemm(
    group, device, name, kind, k, n, tokens, transports, calls, graphed, generator, sm_carveout
) -> dict:
    tp = group_size(group)
    rows = tokens // tp
    fp8 = device.type == "cuda"
    dtype, out_dtype = (
        (torch.float8_e4m3fn, torch.bfloat16) if fp8 else (torch.float32, torch.float32)
    )
    one = torch.ones((), device=device)
    weight = torch.randn(n, k, generator=generator, device=device).mul_(0.05).to(dtype)

    def gemm(a, out):
        if fp8:
            return fp8_gemm(a, weight, one, one, out_dtype, fast_accum=True, out=out)
        return torch.mm(a, weight.t(), out=out)

    if kind == "column":  # this rank's rows of the input, gathered
        local = torch.randn(rows, k, generator=generator, device=device).to(dtype)
        gathered = torch.empty(tp * rows, k, dtype=dtype, device=device)
        out = torch.empty(tp * rows, n, dtype=out_dtype, device=device)

        def transfer():
            all_gather_into(gathered, local, group)

        def alone():
            gemm(gathered, out)

        def plain():
            transfer()
            alone()

        def overlapped():
            collective_gemm.gathered_gemm(local, group, gemm, out)
    else:  # every row of a partial product, reduce-scattered
        a = torch.randn(tp * rows, k, generator=generator, device=device).to(dtype)
        partial = torch.empty(tp * rows, n, dtype=out_dtype, device=device)
        mine = torch.empty(rows, n, dtype=out_dtype, device=device)

        def transfer():
            reduce_scatter_into(mine, partial, group)

        def alone():
            gemm(a, partial)

        def plain():
            alone()
            transfer()

        def overlapped():
            collective_gemm.gemm_reduce_scatter(a, group, gemm, n, out_dtype)

    record = {
        "gemm": name,
        "kind": kind,
        "rows": tp * rows,
        "in_features": k,
        "out_features": n,
        "gemm_us": microseconds(alone, device, calls, graphed),
        "transfer_us": microseconds(transfer, device, calls, graphed),
        "plain_us": microseconds(plain, device, calls, graphed),
    }
    for transport in transports:
        if transport == "copy-engine":
            symmetric_memory.use_copy_engines(group, sm_carveout)
        try:
            record[f"{transport}_us"] = microseconds(overlapped, device, calls, graphed)
        finally:
            symmetric_memory.stop_using_copy_engines()
        record[f"{transport}_hidden"] = (record["plain_us"] - record[f"{transport}_us"]) / record[
            "transfer_us"
        ]
    return record


def table(records: list, transports) -> str:
    """Markdown: each GEMM's microseconds, and the share of its transfer each transport hid."""
    header = "| GEMM | rows x in -> out | GEMM alone | transfer alone | plain |" + "".join(
        f" overlapped, {t} | hidden, {t} |" for t in transports
    )
    lines = [header, "|" + "---|" * (5 + 2 * len(transports))]
    for r in records:
        cells = [
            r["gemm"],
            f"{r['rows']} x {r['in_features']} -> {r['out_features']}",
            *(f"{r[key]:.1f}" for key in ("gemm_us", "transfer_us", "plain_us")),
        ]
        for t in transports:
            cells += [f"{r[f'{t}_us']:.1f}", f"{100 * r[f'{t}_hidden']:.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument(
        "--tokens", type=int, default=8192, help="tokens of a micro-batch (micro-batch x sequence)"
    )
    parser.add_argument(
        "--transports",
        nargs="+",
        choices=TRANSPORTS,
        help="default: nccl, and copy-engine where the ranks can use it",
    )
    parser.add_argument("--calls", type=int, default=20, help="calls per timing (per graph)")
    parser.add_argument(
        "--eager", action="store_true", help="time eager calls, not CUDA graph replays"
    )
    parser.add_argument(
        "--sm-carveout",
        type=int,
        default=symmetric_memory.DEFAULT_SM_CARVEOUT,
        help="SMs the GEMMs leave free beside copy-engine transfers (0: every SM)",
    )
    parser.add_argument("--output", type=Path, help="a JSON file for the records (rank 0)")
    args = parser.parse_args(argv)
    if args.sm_carveout < 0:
        parser.error(f"--sm-carveout {args.sm_carveout}: give 0 or more SMs")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        group, device = dist.group.WORLD, torch.device("cuda" if cuda else "cpu")
        tp = group_size(group)
        if tp < 2 or args.tokens % tp or args.hidden % tp or args.ffn % tp:
            parser.error(
                f"needs at least 2 ranks dividing --tokens, --hidden and --ffn (got {tp} ranks)"
            )
        reason = symmetric_memory.unavailable_reason(group)
        if args.transports is None:
            args.transports = ["nccl"] + (["copy-engine"] if reason is None else [])
        elif "copy-engine" in args.transports and reason is not None:
            parser.error(f"--transports copy-engine: {reason}; give --transports nccl")
        records = measure(
            group,
            device,
            args.hidden,
            args.ffn,
            args.tokens,
            args.transports,
            args.calls,
            graphed=cuda and not args.eager,
            sm_carveout=args.sm_carveout,
        )
        if dist.get_rank() == 0:
            print(table(records, args.transports), flush=True)
            if args.output:
                args.output.write_text(
                    json.dumps(
                        {
                            "device": torch.cuda.get_device_name() if cuda else "cpu",
                            "ranks": tp,
                            "torch": torch.__version__,
                            "graphed": cuda and not args.eager,
                            "sm_carveout": args.sm_carveout
                            if "copy-engine" in args.transports
                            else None,
                            "records": records,
                        },
                        indent=1,
                    )
                    + "\n"
                )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
