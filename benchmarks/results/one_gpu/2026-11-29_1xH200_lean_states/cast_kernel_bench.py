"""The fused AdamW pass over the 7B shape's FP8 weights (8 layers: QKV, proj, fc1, fc2; 1.61B elements), ms per
step: the pass that also writes the FP8 casts (32 x 32 tiles) with fp32 states and with each lean state, the plain
pass without casts, and the separate casts the forward then makes (megafp8.fp8.quantize, both layouts).
Run from the repository root on a GPU: python benchmarks/results/one_gpu/2026-11-29_1xH200_lean_states/cast_kernel_bench.py"""
import sys, torch
from megafp8.training.optimizer import adamw_kernel as K
from megafp8.fp8.tensor import WeightCast

SHAPES = [(12288, 4096), (4096, 4096), (16384, 4096), (4096, 16384)] * 8
BF16 = torch.bfloat16

def run(lean, tr, tc, tiles, warps, rem=None, mom=None, gr=None, nocast=False):
    K.TILE_ROWS, K.TILE_COLS, K.TILES, K.NUM_WARPS = tr, tc, tiles, warps
    dev = "cuda"
    masters, grads, m, v, outs, casts = [], [], [], [], [], []
    for r, c in SHAPES:
        n = r * c
        outs.append(torch.randn(n, device=dev).to(BF16))
        rem_, mom_, gr_ = (lean if x is None else x for x in (rem, mom, gr))
        masters.append(torch.zeros(n, dtype=torch.int16, device=dev) if rem_ else outs[-1].float())
        sd = BF16 if mom_ else torch.float32
        grads.append(torch.randn(n, device=dev).to(BF16 if gr_ else torch.float32) * 1e-3)
        m.append(torch.zeros(n, dtype=sd, device=dev)); v.append(torch.zeros(n, dtype=sd, device=dev))
        casts.append(WeightCast(torch.empty(r, c, dtype=torch.float8_e4m3fn, device=dev), torch.empty(c, r, dtype=torch.float8_e4m3fn, device=dev),
                                torch.ones(1, device=dev), torch.zeros(1, device=dev), torch.ones(1, device=dev)))
    steps = torch.zeros(len(SHAPES), device=dev)
    opt = K.MultiTensorAdamW(masters, grads, m, v, steps, outs, [True] * len(SHAPES), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, casts=None if nocast else casts)
    control = torch.tensor([1.0, 1.0], device=dev)
    for _ in range(3): opt.step(1e-4, control)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10): opt.step(1e-4, control)
    b.record(); torch.cuda.synchronize()
    ms = a.elapsed_time(b) / 10
    elems = sum(r * c for r, c in SHAPES)
    moved = elems * (20 if lean else 32)
    del opt, masters, grads, m, v, outs, casts; torch.cuda.empty_cache()
    return ms, moved / ms / 1e9

for name, kw in (
    ("fp32", {}),
    ("remainders", dict(rem=True, mom=False, gr=False)),
    ("bf16 moments", dict(rem=False, mom=True, gr=False)),
    ("bf16 grads", dict(rem=False, mom=False, gr=True)),
    ("all", dict(rem=True, mom=True, gr=True)),
    ("fp32 no cast", dict(nocast=True)),
    ("all no cast", dict(rem=True, mom=True, gr=True, nocast=True)),
):
    ms, _ = run(False, 32, 32, 4, 4, **kw)
    print(f"{name:14s} {ms:6.2f} ms", flush=True)
from megafp8.fp8.quantize import quantize
ws = [torch.randn(r, c, device="cuda").to(BF16) for r, c in SHAPES]
scale = torch.ones(1, device="cuda")
def casts():
    for w in ws:
        quantize(w, torch.float8_e4m3fn, scale, rowwise=True, columnwise=True)
for _ in range(2): casts()
torch.cuda.synchronize(); a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True); a.record()
for _ in range(5): casts()
b.record(); torch.cuda.synchronize(); print(f"separate casts {a.elapsed_time(b)/5:6.2f} ms")
