"""Where the host (Python + launch) time of an Fp8Linear step goes, on a GPU.

    python benchmarks/profile_fp8_linear_host.py [--recipe delayed|current] [--steps 200]

The GPU is kept busy by a queued sleep kernel so the host never waits on it; the table is
cProfile's, sorted by own time. Use it when a layer step is launch-bound (bench_fp8_linear.py
reports host time per step next to GPU time).
"""
import argparse
import cProfile
import pstats
import time

import torch

from megafp8 import CurrentScaling, DelayedScaling, Fp8Linear, fp8_autocast


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", choices=["delayed", "current"], default="delayed")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    recipe = DelayedScaling() if args.recipe == "delayed" else CurrentScaling()
    layer = Fp8Linear(2048, 2048, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)

    def step():
        layer.weight.grad = layer.bias.grad = x.grad = None
        with fp8_autocast(recipe=recipe):
            y = layer(x)
        y.backward(dy)

    for _ in range(10):
        step()
    # Short windows: more than ~1000 queued launches would make the host wait for the GPU.
    window = 8
    profiler = cProfile.Profile()
    elapsed = 0.0
    for _ in range(args.steps // window):
        torch.cuda.synchronize()
        torch.cuda._sleep(500_000_000)
        start = time.perf_counter()
        profiler.enable()
        for _ in range(window):
            step()
        profiler.disable()
        elapsed += time.perf_counter() - start
    torch.cuda.synchronize()
    elapsed = elapsed / (args.steps // window * window) * 1e3
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    print(f"host time per step under cProfile: {elapsed:.3f} ms ({args.recipe})")
    print("(cProfile roughly doubles Python-heavy code; bench_fp8_linear.py gives the unprofiled figure)")


if __name__ == "__main__":
    main()
