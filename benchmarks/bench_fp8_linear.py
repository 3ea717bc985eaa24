"""Fp8Linear vs nn.Linear (bf16), forward + backward, at GPT-1.3B shapes; quantization included.

    python benchmarks/bench_fp8_linear.py [--tokens 16384] [--json results.json] [--sweep-tiles]

Prints the device ceilings (bf16 and FP8 GEMM rates, copy bandwidth), the fused vs eager
quantization time, each GEMM alone, and the layer step three ways:
- eager: one layer's forward + backward, each under its own fp8_autocast (so each step also
  pays a whole pass's scale update); what a lone layer costs, launch overhead included;
- graphed: the same step captured in a CUDA graph and replayed: GPU time alone, what the
  layer costs when the host keeps ahead of the GPU (as in a full model, or with CUDA graphs);
- block: the four linears of one GPT-1.3B layer in one fp8_autocast, eager, as a model runs them.
Times are medians of CUDA-event timings (triton.testing.do_bench, L2 flushed between runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
from triton.testing import do_bench

from megafp8 import CurrentScaling, DelayedScaling, Fp8Linear, fp8_autocast, symmetric_memory
from megafp8.fp8 import triton_kernels
from megafp8.fp8.gemm import fp8_gemm
from megafp8.fp8.quantize import quantize, quantize_torch

SHAPES = [(2048, 6144), (2048, 2048), (2048, 8192), (8192, 2048)]  # GPT-1.3B: QKV, proj, fc1, fc2
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def ms(fn):
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def ceilings():
    n = 8192
    a, b = (
        torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
        torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
    )
    bf16 = 2 * n**3 / ms(lambda: a @ b) / 1e9
    one = torch.ones((), device="cuda")
    a8, b8 = a.to(E4M3), b.to(E4M3)
    fp8 = {
        fast: 2
        * n**3
        / ms(
            lambda: torch._scaled_mm(
                a8, b8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=fast
            )
        )
        / 1e9
        for fast in (True, False)
    }
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_tbps = 2 * src.numel() / ms(lambda: dst.copy_(src)) / 1e9  # bytes read + written
    return {
        "bf16_tflops": bf16,
        "fp8_fast_accum_tflops": fp8[True],
        "fp8_tflops": fp8[False],
        "copy_TBps": copy_tbps,
    }


def quantize_times(tokens):
    rows = []
    for k in (2048, 8192):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor(10.0, device="cuda")
        moved = x.numel() * (2 + 1 + 1)
        eager = ms(lambda: quantize_torch(x, E4M3, scale, 0, True, True, None))
        fused = ms(
            lambda: triton_kernels.quantize(x, E4M3, scale, 0, True, True, None, None, False)
        )
        current = ms(
            lambda: triton_kernels.quantize(x, E4M3, None, 0, True, True, None, None, False)
        )
        rows.append(
            {
                "shape": f"{tokens}x{k}",
                "eager_ms": eager,
                "fused_ms": fused,
                "fused_current_ms": current,
                "fused_TBps": moved / fused / 1e9,
            }
        )
    return rows


def sweep_tiles(tokens):
    x = torch.randn(tokens, 8192, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(10.0, device="cuda")
    saved = triton_kernels.BLOCK_M, triton_kernels.BLOCK_N, triton_kernels.NUM_WARPS
    rows = []
    for bm, bn, warps in [
        (32, 128, 4),
        (64, 64, 4),
        (64, 128, 4),
        (64, 128, 8),
        (128, 64, 4),
        (128, 128, 8),
        (64, 256, 8),
        (128, 256, 8),
        (32, 256, 4),
    ]:
        triton_kernels.BLOCK_M, triton_kernels.BLOCK_N, triton_kernels.NUM_WARPS = bm, bn, warps
        t = ms(lambda: triton_kernels.quantize(x, E4M3, scale, 0, True, True, None, None, False))
        rows.append({"tile": f"{bm}x{bn}/w{warps}", "ms": t, "TBps": x.numel() * 4 / t / 1e9})
    triton_kernels.BLOCK_M, triton_kernels.BLOCK_N, triton_kernels.NUM_WARPS = saved
    return rows


def layer_step(layers, xs, dys, recipe, recast_weight=False):
    """Forward + backward of `layers` (each on its own input) under one fp8_autocast."""
    layers, xs, dys = (list(v) if isinstance(v, (list, tuple)) else [v] for v in (layers, xs, dys))

    def step():
        for layer, x in zip(layers, xs):
            layer.weight.grad = layer.bias.grad = x.grad = None
            if recast_weight:
                layer.clear_fp8_weight_cache()
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            ys = [layer(x) for layer, x in zip(layers, xs)]
        torch.autograd.backward(ys, dys)

    return step


def graphed(step):
    """`step` captured in a CUDA graph; returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile kernels, build address tables, cache the weight casts
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
        symmetric_memory.join_copy_streams()  # a capture joins every stream it forked
    return graph.replay


# The sleep kernel that keeps the GPU busy while the host is timed: about a second for a run of
# steps, about 100 ms before each pair of steps of a big one (cycles, at the H100's ~2 GHz). A
# step whose host time reaches half of the latter waited on the GPU after all.
RUN_SLEEP_CYCLES, STEP_SLEEP_CYCLES = 2_000_000_000, 200_000_000
HOST_WAIT_MS = 50.0


def host_step_times(step, steps=10, warmup=3, sleep_per_step=False) -> list[float]:
    """Host (Python + launch) time of each of `steps` steps, in ms, while a queued sleep kernel
    keeps the GPU busy, so the host never waits on it, after `warmup` steps that compile and
    autotune every kernel the step reaches (delayed scaling's second step takes other paths than
    its first). `sleep_per_step`: queue each timed step behind its own sleep, for steps of many
    kernels, whose run would fill the GPU's launch queue (about a thousand launches: ten steps of
    a four-layer stack) and then wait for it to drain, which is not host time; an untimed step
    goes first behind the same sleep, so the timed one follows another step's launches, as in a
    training loop, and not a wait on the GPU."""
    import time

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    if not sleep_per_step:
        torch.cuda._sleep(RUN_SLEEP_CYCLES)
    times = []
    for _ in range(steps):
        if sleep_per_step:
            torch.cuda.synchronize()
            torch.cuda._sleep(STEP_SLEEP_CYCLES)
            step()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return times


def host_ms(step, steps=10):
    """Median host time per step (host_step_times; the median, since one garbage collection
    can double a step's): a layer step is launch-bound when this exceeds its GPU time."""
    return statistics.median(host_step_times(step, steps))


def gemm_breakdown(tokens, k, n):
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    qx, qw = quantize(x, E4M3, columnwise=True), quantize(w, E4M3, columnwise=True)
    qdy = quantize(dy, E5M2, columnwise=True)
    return {
        "bf16_fprop": ms(lambda: x @ w.t()),
        "bf16_dgrad": ms(lambda: dy @ w),
        "bf16_wgrad": ms(lambda: dy.t() @ x),
        "fp8_fprop": ms(
            lambda: fp8_gemm(
                qx.data, qw.data, qx.scale_inv, qw.scale_inv, torch.bfloat16, fast_accum=True
            )
        ),
        "fp8_dgrad": ms(
            lambda: fp8_gemm(qdy.data, qw.data_t, qdy.scale_inv, qw.scale_inv, torch.bfloat16)
        ),
        "fp8_wgrad": ms(
            lambda: fp8_gemm(qdy.data_t, qx.data_t, qdy.scale_inv, qx.scale_inv, torch.bfloat16)
        ),
        "fp8_dgrad_fast": ms(
            lambda: fp8_gemm(
                qdy.data, qw.data_t, qdy.scale_inv, qw.scale_inv, torch.bfloat16, fast_accum=True
            )
        ),
        "fp8_wgrad_fast": ms(
            lambda: fp8_gemm(
                qdy.data_t, qx.data_t, qdy.scale_inv, qx.scale_inv, torch.bfloat16, fast_accum=True
            )
        ),
        "quant_x": ms(
            lambda: quantize(
                x, E4M3, x.new_ones((), dtype=torch.float32), rowwise=True, columnwise=True
            )
        ),
        "quant_dy": ms(
            lambda: quantize(
                dy, E5M2, x.new_ones((), dtype=torch.float32), rowwise=True, columnwise=True
            )
        ),
        "quant_dy_bias": ms(
            lambda: quantize(
                dy, E5M2, x.new_ones((), dtype=torch.float32), columnwise=True, col_sum=True
            )
        ),
        "bias_grad": ms(lambda: dy.sum(0, dtype=torch.float32)),
    }


def make_layers(tokens, shapes):
    bf16, fp8, xs, dys = [], [], [], []
    for k, n in shapes:
        torch.manual_seed(0)
        base = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        layer = Fp8Linear(k, n, device="cuda", dtype=torch.bfloat16)
        layer.load_state_dict(base.state_dict(), strict=False)
        bf16.append(base)
        fp8.append(layer)
        xs.append(torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True))
        dys.append(torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16))
    return bf16, fp8, xs, dys


def variants(bf16, fp8, xs, dys, graph):
    """ms per step for bf16 and FP8 (delayed, current) eager, and graphed when `graph`."""
    row = {}
    for name, layers, recipe in [
        ("bf16", bf16, None),
        ("fp8_delayed", fp8, DelayedScaling()),
        ("fp8_current", fp8, CurrentScaling()),
    ]:
        step = layer_step(layers, xs, dys, recipe)
        row[f"{name}_ms"] = ms(step)
        if graph:
            row[f"{name}_graphed_ms"] = ms(graphed(step))
    return row


def layer_times(tokens):
    rows = []
    for k, n in SHAPES:
        bf16, fp8, xs, dys = make_layers(tokens, [(k, n)])
        row = {"shape": f"{k}->{n}", **variants(bf16, fp8, xs, dys, graph=True)}
        row["fp8_delayed_recast_ms"] = ms(
            layer_step(fp8, xs, dys, DelayedScaling(), recast_weight=True)
        )
        row["host_ms"] = {
            "bf16": host_ms(layer_step(bf16, xs, dys, None)),
            "fp8_delayed": host_ms(layer_step(fp8, xs, dys, DelayedScaling())),
            "fp8_current": host_ms(layer_step(fp8, xs, dys, CurrentScaling())),
        }
        flop = 6 * tokens * k * n
        for key in [k for k in row if k.endswith("_ms") and k != "host_ms"]:
            row[key.replace("_ms", "_tflops")] = flop / row[key] / 1e9
        for mode in ("", "_graphed"):
            for recipe in ("delayed", "current"):
                row[f"speedup_{recipe}{mode}"] = (
                    row[f"bf16{mode}_ms"] / row[f"fp8_{recipe}{mode}_ms"]
                )
        row["breakdown"] = gemm_breakdown(tokens, k, n)
        rows.append(row)
    return rows


def block_times(tokens):
    bf16, fp8, xs, dys = make_layers(tokens, SHAPES)
    row = variants(bf16, fp8, xs, dys, graph=False)
    row["speedup_delayed"] = row["bf16_ms"] / row["fp8_delayed_ms"]
    row["speedup_current"] = row["bf16_ms"] / row["fp8_current_ms"]
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--json", help="write all figures here")
    parser.add_argument(
        "--sweep-tiles", action="store_true", help="time the quantize kernel's tile shapes"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_linear needs a CUDA GPU")
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tokens": args.tokens,
        "ceilings": ceilings(),
        "quantize": quantize_times(args.tokens),
    }
    if args.sweep_tiles:
        results["tiles"] = sweep_tiles(args.tokens)
    results["layers"] = layer_times(args.tokens)
    results["block"] = block_times(args.tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)

    print(
        f"\n{results['device']}  torch {results['torch']}  triton {results['triton']}  tokens {args.tokens}"
    )
    c = results["ceilings"]
    print(
        f"ceilings: bf16 {c['bf16_tflops']:.0f} TFLOP/s, fp8 {c['fp8_tflops']:.0f} "
        f"(fast accum {c['fp8_fast_accum_tflops']:.0f}), copy {c['copy_TBps']:.2f} TB/s"
    )
    for q in results["quantize"]:
        print(
            f"quantize {q['shape']} bf16 -> e4m3 + transpose: eager {q['eager_ms']:.3f} ms, fused {q['fused_ms']:.3f} ms "
            f"({q['fused_TBps']:.2f} TB/s), fused current scaling {q['fused_current_ms']:.3f} ms"
        )
    for t in results.get("tiles", []):
        print(f"  tile {t['tile']:>12}: {t['ms']:.3f} ms {t['TBps']:.2f} TB/s")
    print("\nforward+backward per step, ms (speedup over bf16); fp8 = delayed scaling unless named")
    print(
        f"{'layer':>11} | {'eager: bf16':>11} {'fp8':>14} {'current':>14} {'recast':>7} | "
        f"{'graphed: bf16':>13} {'fp8':>14} {'current':>14}"
    )
    for r in results["layers"]:
        print(
            f"{r['shape']:>11} | {r['bf16_ms']:11.3f} {r['fp8_delayed_ms']:7.3f} ({r['speedup_delayed']:.2f}x) "
            f"{r['fp8_current_ms']:7.3f} ({r['speedup_current']:.2f}x) {r['fp8_delayed_recast_ms']:7.3f} | "
            f"{r['bf16_graphed_ms']:13.3f} {r['fp8_delayed_graphed_ms']:7.3f} ({r['speedup_delayed_graphed']:.2f}x) "
            f"{r['fp8_current_graphed_ms']:7.3f} ({r['speedup_current_graphed']:.2f}x)"
        )
    b = results["block"]
    print(
        f"{'1.3B layer':>11} | {b['bf16_ms']:11.3f} {b['fp8_delayed_ms']:7.3f} ({b['speedup_delayed']:.2f}x) "
        f"{b['fp8_current_ms']:7.3f} ({b['speedup_current']:.2f}x)   (all four linears, one autocast)"
    )
    print(
        "\nhost (launch) time per step, ms: "
        + "  ".join(
            f"{r['shape']}: " + "/".join(f"{v:.2f}" for v in r["host_ms"].values())
            for r in results["layers"]
        )
        + "  (bf16/fp8 delayed/fp8 current)"
    )
    print("\nbreakdown (ms):")
    for r in results["layers"]:
        print(f"{r['shape']:>11} " + " ".join(f"{k}={v:.3f}" for k, v in r["breakdown"].items()))


if __name__ == "__main__":
    main()
