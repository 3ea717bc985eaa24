"""Fp8Linear vs nn.Linear (bf16), forward + backward, at GPT-1.3B shapes; quantization included.

    python benchmarks/bench_fp8_linear.py [--tokens 16384] [--json results.json] [--sweep-tiles]

Prints the device ceilings (bf16 and FP8 GEMM rates, copy bandwidth), the fused vs eager
quantization time, each GEMM alone, and the whole layer step. Times are medians of CUDA-event
timings (triton.testing.do_bench, L2 flushed between runs).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
from triton.testing import do_bench

from megafp8 import CurrentScaling, DelayedScaling, Fp8Linear, fp8_autocast
from megafp8.fp8 import triton_kernels
from megafp8.fp8.gemm import fp8_gemm
from megafp8.fp8.quantize import _quantize_torch, quantize

SHAPES = [(2048, 6144), (2048, 2048), (2048, 8192), (8192, 2048)]  # GPT-1.3B: QKV, proj, fc1, fc2
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def ms(fn):
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def ceilings():
    n = 8192
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bf16 = 2 * n**3 / ms(lambda: a @ b) / 1e9
    one = torch.ones((), device="cuda")
    a8, b8 = a.to(E4M3), b.to(E4M3)
    fp8 = {fast: 2 * n**3 / ms(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=fast)) / 1e9
           for fast in (True, False)}
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_tbps = 2 * src.numel() / ms(lambda: dst.copy_(src)) / 1e9  # bytes read + written
    return {"bf16_tflops": bf16, "fp8_fast_accum_tflops": fp8[True], "fp8_tflops": fp8[False], "copy_TBps": copy_tbps}


def quantize_times(tokens):
    rows = []
    for k in (2048, 8192):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor(10.0, device="cuda")
        moved = x.numel() * (2 + 1 + 1)
        eager = ms(lambda: _quantize_torch(x, E4M3, scale, 0, True, True, None))
        fused = ms(lambda: triton_kernels.quantize(x, E4M3, scale, 0, True, True, None, None, False))
        current = ms(lambda: triton_kernels.quantize(x, E4M3, None, 0, True, True, None, None, False))
        rows.append({"shape": f"{tokens}x{k}", "eager_ms": eager, "fused_ms": fused, "fused_current_ms": current,
                     "fused_TBps": moved / fused / 1e9})
    return rows


def sweep_tiles(tokens):
    x = torch.randn(tokens, 8192, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(10.0, device="cuda")
    saved = triton_kernels.BLOCK_M, triton_kernels.BLOCK_N, triton_kernels.NUM_WARPS
    rows = []
    for bm, bn, warps in [(32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 4),
                          (128, 128, 8), (64, 256, 8), (128, 256, 8), (32, 256, 4)]:
        triton_kernels.BLOCK_M, triton_kernels.BLOCK_N, triton_kernels.NUM_WARPS = bm, bn, warps
        t = ms(lambda: triton_kernels.quantize(x, E4M3, scale, 0, True, True, None, None, False))
        rows.append({"tile": f"{bm}x{bn}/w{warps}", "ms": t, "TBps": x.numel() * 4 / t / 1e9})
    triton_kernels.BLOCK_M, triton_kernels.BLOCK_N, triton_kernels.NUM_WARPS = saved
    return rows


def layer_step(layer, x, dy, recipe, recast_weight=False):
    def step():
        layer.weight.grad = x.grad = None
        if layer.bias is not None:
            layer.bias.grad = None
        if recast_weight:
            layer.clear_fp8_weight_cache()
        if recipe is None:
            y = layer(x)
        else:
            with fp8_autocast(recipe=recipe):
                y = layer(x)
        y.backward(dy)
    return step


def host_ms(step, steps=10):
    """Host (Python + launch) time per step: the GPU is kept busy by a queued sleep kernel, so
    the host never waits on it. A layer step is launch-bound when this exceeds its GPU time."""
    import time

    step()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU spinning
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = (time.perf_counter() - start) / steps * 1e3
    torch.cuda.synchronize()
    return elapsed


def gemm_breakdown(tokens, k, n):
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    qx, qw = quantize(x, E4M3, columnwise=True), quantize(w, E4M3, columnwise=True)
    qdy = quantize(dy, E5M2, columnwise=True)
    return {
        "bf16_fprop": ms(lambda: x @ w.t()), "bf16_dgrad": ms(lambda: dy @ w), "bf16_wgrad": ms(lambda: dy.t() @ x),
        "fp8_fprop": ms(lambda: fp8_gemm(qx.data, qw.data, qx.scale_inv, qw.scale_inv, torch.bfloat16, fast_accum=True)),
        "fp8_dgrad": ms(lambda: fp8_gemm(qdy.data, qw.data_t, qdy.scale_inv, qw.scale_inv, torch.bfloat16)),
        "fp8_wgrad": ms(lambda: fp8_gemm(qdy.data_t, qx.data_t, qdy.scale_inv, qx.scale_inv, torch.bfloat16)),
        "fp8_dgrad_fast": ms(lambda: fp8_gemm(qdy.data, qw.data_t, qdy.scale_inv, qw.scale_inv, torch.bfloat16, fast_accum=True)),
        "fp8_wgrad_fast": ms(lambda: fp8_gemm(qdy.data_t, qx.data_t, qdy.scale_inv, qx.scale_inv, torch.bfloat16, fast_accum=True)),
        "quant_x": ms(lambda: quantize(x, E4M3, x.new_ones((), dtype=torch.float32), rowwise=True, columnwise=True)),
        "quant_dy": ms(lambda: quantize(dy, E5M2, x.new_ones((), dtype=torch.float32), rowwise=True, columnwise=True)),
        "quant_dy_bias": ms(lambda: quantize(dy, E5M2, x.new_ones((), dtype=torch.float32), columnwise=True, col_sum=True)),
        "bias_grad": ms(lambda: dy.sum(0, dtype=torch.float32)),
    }


def layer_times(tokens):
    rows = []
    for k, n in SHAPES:
        torch.manual_seed(0)
        base = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        fp8 = Fp8Linear(k, n, device="cuda", dtype=torch.bfloat16)
        fp8.load_state_dict(base.state_dict(), strict=False)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        flop = 6 * tokens * k * n
        row = {"shape": f"{k}->{n}", "bf16_ms": ms(layer_step(base, x, dy, None))}
        row["fp8_delayed_ms"] = ms(layer_step(fp8, x, dy, DelayedScaling()))
        row["fp8_delayed_recast_ms"] = ms(layer_step(fp8, x, dy, DelayedScaling(), recast_weight=True))
        row["fp8_current_ms"] = ms(layer_step(fp8, x, dy, CurrentScaling()))
        row["host_ms"] = {"bf16": host_ms(layer_step(base, x, dy, None)),
                          "fp8_delayed": host_ms(layer_step(fp8, x, dy, DelayedScaling())),
                          "fp8_current": host_ms(layer_step(fp8, x, dy, CurrentScaling()))}
        for key in ("bf16", "fp8_delayed", "fp8_delayed_recast", "fp8_current"):
            row[f"{key}_tflops"] = flop / row[f"{key}_ms"] / 1e9
        row["speedup_delayed"] = row["bf16_ms"] / row["fp8_delayed_ms"]
        row["speedup_current"] = row["bf16_ms"] / row["fp8_current_ms"]
        row["breakdown"] = gemm_breakdown(tokens, k, n)
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--json", help="write all figures here")
    parser.add_argument("--sweep-tiles", action="store_true", help="time the quantize kernel's tile shapes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_linear needs a CUDA GPU")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "tokens": args.tokens, "ceilings": ceilings(), "quantize": quantize_times(args.tokens)}
    if args.sweep_tiles:
        results["tiles"] = sweep_tiles(args.tokens)
    results["layers"] = layer_times(args.tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)

    print(f"\n{results['device']}  torch {results['torch']}  triton {results['triton']}  tokens {args.tokens}")
    c = results["ceilings"]
    print(f"ceilings: bf16 {c['bf16_tflops']:.0f} TFLOP/s, fp8 {c['fp8_tflops']:.0f} "
          f"(fast accum {c['fp8_fast_accum_tflops']:.0f}), copy {c['copy_TBps']:.2f} TB/s")
    for q in results["quantize"]:
        print(f"quantize {q['shape']} bf16 -> e4m3 + transpose: eager {q['eager_ms']:.3f} ms, fused {q['fused_ms']:.3f} ms "
              f"({q['fused_TBps']:.2f} TB/s), fused current scaling {q['fused_current_ms']:.3f} ms")
    for t in results.get("tiles", []):
        print(f"  tile {t['tile']:>12}: {t['ms']:.3f} ms {t['TBps']:.2f} TB/s")
    print(f"\n{'layer':>11} {'bf16 ms':>8} {'fp8 ms':>8} {'recast':>8} {'current':>8} {'TFLOP/s':>14} {'speedup':>8} {'(current)':>9}")
    for r in results["layers"]:
        print(f"{r['shape']:>11} {r['bf16_ms']:8.3f} {r['fp8_delayed_ms']:8.3f} {r['fp8_delayed_recast_ms']:8.3f} "
              f"{r['fp8_current_ms']:8.3f} {r['bf16_tflops']:6.0f}/{r['fp8_delayed_tflops']:<6.0f} "
              f"{r['speedup_delayed']:7.2f}x {r['speedup_current']:8.2f}x")
    print("\nhost (launch) time per step, ms: " + "  ".join(
        f"{r['shape']}: " + "/".join(f"{v:.2f}" for v in r["host_ms"].values()) for r in results["layers"])
        + "  (bf16/fp8 delayed/fp8 current)")
    print("\nbreakdown (ms):")
    for r in results["layers"]:
        print(f"{r['shape']:>11} " + " ".join(f"{k}={v:.3f}" for k, v in r["breakdown"].items()))


if __name__ == "__main__":
    main()
