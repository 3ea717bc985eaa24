# weight squares cast at PARTS 1/2/4, interleaved, 5 rounds; plus the pair cast at 1/2 for reference
import sys; sys.path.insert(0, "benchmarks")
import torch
from bench_fine_grained import ms, E4M3
from megafp8.fp8 import fine_grained_kernels as fk
torch.manual_seed(0)
shapes = [(4096, 16384), (16384, 4096), (4096, 4096), (12288, 4096)]
ws = {s: torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in shapes}
res = {}
for rnd in range(5):
    for p in (1, 2, 4):
        fk.PARTS = p
        for s, w in ws.items():
            res.setdefault((s, p), []).append(ms(lambda: fk.quantize_squares(w, E4M3)))
for s in shapes:
    print(s, "  ".join(f"P{p}: " + " ".join(f"{t:.3f}" for t in res[(s, p)]) for p in (1, 2, 4)))
