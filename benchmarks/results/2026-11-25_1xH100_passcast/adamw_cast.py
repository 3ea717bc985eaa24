"""The fused AdamW pass with and without the FP8 weight casts, at 4 layers of the 7b shapes (call 1 of
adamw_cast_sweep.txt; with the tiles of that time, one per program). From the project root on a GPU:
`PYTHONPATH=. python benchmarks/results/2026-11-25_1xH100_passcast/adamw_cast.py`."""
import torch
from megafp8.training import adamw_kernel as ak
from megafp8.fp8.tensor import WeightCast
from megafp8.fp8 import triton_kernels
dev = "cuda"
H, FFN = 4096, 16384
shapes = [(3 * H, H), (H, H), (FFN, H), (H, FFN)] * 4
n = len(shapes)
masters = [torch.randn(r * c, device=dev) * 0.02 for r, c in shapes]
grads = [torch.randn_like(m) * 1e-3 for m in masters]
ms = [torch.zeros_like(m) for m in masters]
vs = [torch.zeros_like(m) for m in masters]
outs = [m.to(torch.bfloat16) for m in masters]
steps = torch.zeros(n, device=dev)
casts = [WeightCast(torch.empty(r, c, device=dev, dtype=torch.float8_e4m3fn), torch.empty(c, r, device=dev, dtype=torch.float8_e4m3fn),
                    torch.full((), 100.0, device=dev), torch.zeros((), device=dev), torch.zeros((), device=dev)) for r, c in shapes]
control = torch.tensor([1.0, 1.0], device=dev)
numel = sum(m.numel() for m in masters)
def timed(fn, k=5):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(k): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / k
def make(with_casts):
    return ak.MultiTensorAdamW(masters, grads, ms, vs, steps, outs, [True] * n, betas=(0.9, 0.95), eps=1e-8,
                               weight_decay=0.1, casts=casts if with_casts else None)
plain = make(False)
t_plain = timed(lambda: plain.step(1e-4, control))
def sep_casts():
    for out, (r, c), cast in zip(outs, shapes, casts):
        triton_kernels.quantize(out.view(r, c), torch.float8_e4m3fn, cast.scale, 0, True, True, None, cast.amax, False,
                                None, None)
t_casts = timed(sep_casts)
print(f"{numel/1e9:.2f}B params: plain pass {t_plain:.2f} ms ({numel*30/t_plain/1e9:.2f} TB/s), separate casts {t_casts:.2f} ms, sum {t_plain+t_casts:.2f}")
for rows, cols, warps in [(64, 128, 4), (32, 128, 4), (32, 64, 4), (32, 32, 4), (64, 64, 8), (16, 128, 4), (32, 128, 8), (64, 128, 8)]:
    ak.TILE_ROWS, ak.TILE_COLS, ak.NUM_WARPS = rows, cols, warps
    fused = make(True)
    t = timed(lambda: fused.step(1e-4, control))
    print(f"tile {rows}x{cols} warps {warps}: {t:.2f} ms ({numel*32/t/1e9:.2f} TB/s at 32 B/param)")
ak.NUM_WARPS = 4
