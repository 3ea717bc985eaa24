"""Session-19 probe: is the map's host time (each step behind its own sleep, the GPU drained
first) inflated by the method, or was the 2026-11-26 host slower? Same host, same layer:
(a) ten steps back to back behind one sleep (the old method), (b) each step alone after a
synchronize (the current one), (c) each timed step after an untimed one in the same burst.
Prediction if the method is the cause: (b) about 1.3-2x (a), (c) within 15% of (a).
bench_fp8_linear.host_step_times(sleep_per_step=True) now does (c)."""
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_fp8_linear import RUN_SLEEP_CYCLES, STEP_SLEEP_CYCLES  # noqa: E402
from bench_layer_grid import layer_config, scaling  # noqa: E402

from megafp8.fp8 import fp8_autocast  # noqa: E402
from megafp8.models.transformer import TransformerLayer  # noqa: E402


def measure(step, mode, steps=10):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    if mode == "back_to_back":
        torch.cuda._sleep(RUN_SLEEP_CYCLES)
    for _ in range(steps):
        if mode != "back_to_back":
            torch.cuda.synchronize()
            torch.cuda._sleep(STEP_SLEEP_CYCLES)
            if mode == "burst":
                step()
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


config = layer_config("gpt", 2048, 2048)
for mb in (1, 4):
    layers = [TransformerLayer(config, None, False, torch.bfloat16, "cuda") for _ in range(4)]
    x = torch.randn(2048, mb, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    for name in ("bf16", "delayed", "current"):
        recipe = scaling(name)

        def step(modules):
            for m in modules:
                for p in m.parameters():
                    p.grad = None
            with fp8_autocast(enabled=recipe is not None, recipe=recipe):
                y = x
                for m in modules:
                    y = m(y, None)
            y.backward(dy)

        row = {mode: measure(lambda: step(layers[:1]), mode) for mode in ("back_to_back", "per_step", "burst")}
        stack = {mode: measure(lambda: step(layers), mode) for mode in ("per_step", "burst")}
        print(f"mb {mb} {name:8s} one layer: " + " ".join(f"{k} {v:.2f}" for k, v in row.items())
              + " | stack of 4: " + " ".join(f"{k} {v:.2f}" for k, v in stack.items()), flush=True)

# Launches per step (the GPU's queue holds about a thousand): the burst queues two steps at once.
from torch.profiler import ProfilerActivity, profile  # noqa: E402

for name in ("bf16", "delayed"):
    recipe = scaling(name)

    def stack_step():
        for m in layers:
            for p in m.parameters():
                p.grad = None
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = x
            for m in layers:
                y = m(y, None)
        y.backward(dy)

    stack_step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stack_step()
        torch.cuda.synchronize()
    kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    print(f"{name}: {kernels} GPU kernels/copies per step of the stack of 4 (mb {mb})", flush=True)
