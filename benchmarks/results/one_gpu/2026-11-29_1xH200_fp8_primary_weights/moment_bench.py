"""The fused AdamW pass over the 7B shape's FP8 weights (8 layers: QKV, proj, fc1, fc2; 1.61B elements), ms per
step, plain pass (no casts), with lean states (int16 remainders, bf16 gradients, bf16 second moment) and the first
moment in bf16 or FP8: this tree's kernel, and the kernel given as a file (the one before, for the same call).
Run from the repository root on a GPU: python <this file> [path/to/adamw_kernel_before.py]"""
import importlib.util
import sys

import torch

from megafp8.training.optimizer import adamw_kernel

SHAPES = [(12288, 4096), (4096, 4096), (16384, 4096), (4096, 16384)] * 8
BF16 = torch.bfloat16


def kernels():
    yield "this tree", adamw_kernel
    if len(sys.argv) > 1:
        spec = importlib.util.spec_from_file_location("adamw_kernel_before", sys.argv[1])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield "before", module


def run(K, exp_avg_dtype):
    dev = "cuda"
    masters, grads, m, v, outs, scales = [], [], [], [], [], []
    for r, c in SHAPES:
        n = r * c
        outs.append(torch.randn(n, device=dev).to(BF16))
        masters.append(torch.zeros(n, dtype=torch.int16, device=dev))
        grads.append((torch.randn(n, device=dev) * 1e-3).to(BF16))
        m.append(torch.zeros(n, dtype=exp_avg_dtype, device=dev))
        v.append(torch.zeros(n, dtype=BF16, device=dev))
        scales.append(torch.ones(-(-n // K.MOMENT_BLOCK), device=dev))
    fp8 = exp_avg_dtype == torch.float8_e4m3fn
    steps = torch.zeros(len(SHAPES), device=dev)
    opt = K.MultiTensorAdamW(masters, grads, m, v, steps, outs, [True] * len(SHAPES), betas=(0.9, 0.95),
                             eps=1e-8, weight_decay=0.1, exp_avg_scales=scales if fp8 else None)
    control = torch.tensor([1.0, 1.0], device=dev)
    for _ in range(3):
        opt.step(1e-4, control)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        opt.step(1e-4, control)
    b.record()
    torch.cuda.synchronize()
    del opt, masters, grads, m, v, outs, scales
    torch.cuda.empty_cache()
    return a.elapsed_time(b) / 10


for name, K in kernels():
    for label, dtype in (("bf16 exp_avg", BF16), ("fp8 exp_avg", torch.float8_e4m3fn)):
        print(f"{name:10s} {label:13s} {run(K, dtype):6.2f} ms", flush=True)
