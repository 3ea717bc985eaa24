"""The SDPA backends at the side-by-side shapes and the AdamW kernel's tiles, on one GPU."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megafp8.training import adamw_kernel as ak


def t(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1000


print("## SDPA fwd+bwd us (b, heads, s, d)")
for b, h, s in ((2, 32, 4096), (8, 16, 2048)):
    qkv = torch.randn(s, b, h, 3, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16)
    for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def run():
            q, k, v = (qkv[..., i, :].permute(1, 2, 0, 3) for i in range(3))
            with sdpa_kernel(be):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(go)

        def fwd():
            q, k, v = (qkv[..., i, :].permute(1, 2, 0, 3) for i in range(3))
            with sdpa_kernel(be), torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
        print(f"{b}x{h}x{s} {be.name}: fwd {t(fwd):.0f} fwd+bwd {t(run):.0f}")
    q, k, v = (qkv[..., i, :].permute(1, 2, 0, 3) for i in range(3))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), go)
    print("grad strides", dq.shape, dq.stride(), dk.stride(), dv.stride())
del qkv, go

print("## copy roof, 4 GiB fp32")
a = torch.empty(2**30, device="cuda")
c = torch.empty_like(a)
us = t(lambda: c.copy_(a), 10)
print(f"copy {us:.0f} us = {2 * 4 * 2**30 / us / 1e6:.2f} TB/s")
del a, c

print("## AdamW kernel sweep, 1.8B params in 100 tensors")
n = 1_800_000_000 // 100
masters = [torch.randn(n, device="cuda") for _ in range(100)]
grads = [torch.randn(n, device="cuda") * 1e-3 for _ in range(100)]
ms = [torch.zeros(n, device="cuda") for _ in range(100)]
vs = [torch.zeros(n, device="cuda") for _ in range(100)]
outs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(100)]
steps = torch.zeros(100, device="cuda")
nbytes = 100 * n * 30
for block, chunk_blocks, warps in ((1024, 16, 4), (1024, 4, 4), (2048, 8, 8), (2048, 4, 4), (4096, 4, 8),
                                   (512, 32, 4), (1024, 16, 8)):
    ak.BLOCK, ak.CHUNK, ak.NUM_WARPS = block, block * chunk_blocks, warps
    opt = ak.MultiTensorAdamW(masters, grads, ms, vs, steps, outs, [True] * 100, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.1)
    us = t(lambda: opt.step(1e-4), 5)
    print(f"BLOCK {block} CHUNK {block * chunk_blocks} warps {warps}: {us / 1000:.2f} ms = {nbytes / us / 1e6:.2f} TB/s")
