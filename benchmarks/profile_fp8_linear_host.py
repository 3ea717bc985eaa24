"""Where the host (Python + launch) time of an Fp8Linear step goes, on a GPU.

    python benchmarks/profile_fp8_linear_host.py [--recipe delayed|current] [--steps 200]
    python benchmarks/profile_fp8_linear_host.py --ops    # host cost of each building block
    python benchmarks/profile_fp8_linear_host.py --per-linear   # host cost per linear in a model

The GPU is kept busy by a queued sleep kernel so the host never waits on it; the table is
cProfile's, sorted by own time. Use it when a layer step is launch-bound (bench_fp8_linear.py
reports host time per step next to GPU time).
"""

import argparse
import cProfile
import pstats
import time

import torch

# The script's own folder is on sys.path when it runs: share the layer benchmark's measuring.
from bench_fp8_linear import SHAPES, host_ms, layer_step, make_layers

from megafp8 import CurrentScaling, DelayedScaling, Fp8Linear, fp8_autocast


def op_costs(repeat=200):
    """Host time of one call of each building block of an FP8 step (GPU kept busy)."""
    from megafp8.fp8.formats import E4M3_DTYPE
    from megafp8.fp8.quantize import quantize
    from megafp8.fp8.scaling import AmaxPass, ScalingState

    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    a8 = a.to(E4M3_DTYPE)
    one = torch.ones((), device="cuda")
    states = [ScalingState().cuda() for _ in range(2)]
    recipe = DelayedScaling(amax_history_len=16)
    for s in states:
        s.fit_history(16)
    linear = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8Linear(64, 64, device="cuda", dtype=torch.bfloat16)

    def flush():
        amax_pass = AmaxPass()
        for s in states:
            amax_pass.record(s, 448.0, recipe)
        amax_pass.flush()

    def fp8_forward():
        with fp8_autocast(recipe=recipe):
            fp8(a)

    ops = {
        "torch.empty": lambda: torch.empty(64, 64, device="cuda"),
        "tensor.add_ (1 launch)": lambda: a.add_(0),
        "torch.mm bf16": lambda: torch.mm(a, a),
        "torch._scaled_mm": lambda: torch._scaled_mm(
            a8, a8.t(), one, one, out_dtype=torch.bfloat16
        ),
        "quantize (fused, delayed)": lambda: quantize(a, E4M3_DTYPE, one, columnwise=True),
        "flush of a pass (2 states)": flush,
        "nn.Linear forward": lambda: linear(a),
        "Fp8Linear forward in fp8_autocast": fp8_forward,
    }
    print(f"{'operation':36} host us/call")
    for name, op in ops.items():
        print(f"{name:36} {host_ms(op, steps=repeat) * 1e3:8.1f}")


def per_linear_costs(blocks=6, tokens=256, repeat=7):
    """Host time per linear, forward + backward, in a stack of GPT-1.3B blocks' four linears
    under one fp8_autocast (one scale update per pass, weights cached: as in a model), bf16 as
    nn.Linear. Few tokens and a busy GPU keep the GPU's own time out of it; few blocks keep the
    launches queued behind the sleep under the ~1000 at which the host would wait for the GPU."""
    bf16, fp8, xs, dys = make_layers(tokens, SHAPES * blocks)
    print(
        f"{'precision':12} host us per linear (forward + backward), {len(fp8)} linears, median of {repeat}"
    )
    for name, layers, recipe in [
        ("bf16", bf16, None),
        ("fp8 delayed", fp8, DelayedScaling()),
        ("fp8 current", fp8, CurrentScaling()),
    ]:
        step = layer_step(layers, xs, dys, recipe)
        times = sorted(host_ms(step, steps=1) * 1e3 / len(layers) for _ in range(repeat))
        print(f"{name:12} {times[repeat // 2]:8.1f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", choices=["delayed", "current"], default="delayed")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--ops", action="store_true", help="time each building block instead")
    parser.add_argument(
        "--per-linear", action="store_true", help="host time per linear in a model-like stack"
    )
    args = parser.parse_args()
    if args.ops:
        return op_costs()
    if args.per_linear:
        return per_linear_costs()
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
    print(
        "(cProfile roughly doubles Python-heavy code; bench_fp8_linear.py gives the unprofiled figure)"
    )


if __name__ == "__main__":
    main()
