"""Can the gradient norm hide under backward? One layer's FP8 backward GEMMs + cuDNN attention
backward on the main stream, the layer's gradient norms on a side stream after each layer."""
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
dev = "cuda"
T, H, FFN = 8192, 4096, 16384
e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
one = torch.ones((), device=dev)
def fp8(*s, dt=e4): return torch.randn(*s, device=dev).to(dt)
# dgrad: dy[T,N] (e5m2) x W^T stored [K,N] ; wgrad: dy^T [N,T] x x^T stored [K,T]
shapes = [(12288, H), (H, H), (FFN, H), (H, FFN)]  # (out, in) of qkv, proj, fc1, fc2
ops = []
for n, k in shapes:
    dy, wt, dyt, xt = fp8(T, n, dt=e5), fp8(k, n), fp8(n, T, dt=e5), fp8(k, T)
    mg = torch.empty(n, k, device=dev)
    ops.append((dy, wt, dyt, xt, mg))
q = torch.randn(2, 32, 4096, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
k_, v_ = (torch.randn_like(q).requires_grad_() for _ in range(2))
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    o = F.scaled_dot_product_attention(q, k_, v_, is_causal=True)
go = torch.randn_like(o)
def layer_backward():
    for dy, wt, dyt, xt, mg in ops:
        torch._scaled_mm(dy, wt.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        torch._scaled_mm(dyt, xt.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, out=mg)
    torch.autograd.grad(o, (q, k_, v_), go, retain_graph=True)
grads = [[torch.randn(n, k, device=dev) for n, k in shapes] + [torch.randn(n, device=dev) for n in (12288, H, H, FFN, H)] for _ in range(8)]
out = torch.zeros(8 * 9, device=dev)
def norms(i):
    out[9 * i:9 * i + 9] = torch.stack(torch._foreach_norm(grads[i], 2)).square()
def timed(fn, n=5):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n
def main_only():
    for i in range(8): layer_backward()
def side_only():
    for i in range(8): norms(i)
def serial():
    for i in range(8): layer_backward(); norms(i)
def parallel(stream):
    def run():
        main = torch.cuda.current_stream()
        for i in range(8):
            layer_backward()
            stream.wait_stream(main)
            with torch.cuda.stream(stream): norms(i)
        main.wait_stream(stream)
    return run
lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
res = {"main only": timed(main_only), "norms only": timed(side_only), "serial": timed(serial),
       "side stream": timed(parallel(torch.cuda.Stream())),
       "side stream low prio": timed(parallel(torch.cuda.Stream(priority=0)))}
hp = torch.cuda.Stream(priority=-1)
def hi_main():
    with torch.cuda.stream(hp):
        parallel(torch.cuda.Stream(priority=0))()
res["main high prio, side low"] = timed(hi_main)
for k, v in res.items(): print(f"{k:28s} {v:8.2f} ms")
print(f"hidden: {res['serial'] - res['side stream']:.2f} / {res['serial'] - res['main high prio, side low']:.2f} of {res['norms only']:.2f} ms")
