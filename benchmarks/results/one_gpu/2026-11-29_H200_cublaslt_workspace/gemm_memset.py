"""Which GEMMs does cuBLASLt precede with a memset, and what does it cost inside a CUDA graph?
A GPT-1.3B layer's GEMMs (MBS 4, seq 2048: 8192 tokens) fwd+bwd, FP8 tensorwise and bf16, graphed."""
import json, os, sys, tempfile
import torch
d = "cuda"; T, H, F = 8192, 2048, 8192
f8, f5 = torch.float8_e4m3fn, torch.float8_e5m2
one = torch.ones((), device=d)
def mk(r, c, dt): return torch.randn(r, c, device=d).to(dt)
# (A [m,k] row-major, B given as [n,k] row-major then .t(): column-major [k,n]) as _scaled_mm wants
shapes = []
for n_out, k_in in ((3 * H, H), (H, H), (F, H), (H, F)):
    shapes.append(("fwd", T, n_out, k_in, f8, f8))    # y = x W^T
    shapes.append(("dgrad", T, k_in, n_out, f5, f8))  # dx = dy W
    shapes.append(("wgrad", n_out, k_in, T, f5, f8))  # dW = dy^T x
fp8_ops, bf_ops = [], []
for name, m, n, k, da, db in shapes:
    a, b = mk(m, k, da), mk(n, k, db).t()
    fp8_ops.append((name, m, n, k, lambda a=a, b=b: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)))
    ab, bb = a.bfloat16(), b.bfloat16()
    bf_ops.append((name, m, n, k, lambda a=ab, b=bb: a @ b))
def graph_of(ops, reps=8):
    for *_, fn in ops: fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for *_, fn in ops: fn()
    return g
def time_graph(g, n=20):
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(5):
        s.record()
        for _ in range(n): g.replay()
        e.record(); e.synchronize(); best = min(best, s.elapsed_time(e) / n)
    return best
mode = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "default")
for label, ops in (("fp8", fp8_ops), ("bf16", bf_ops)):
    g = graph_of(ops)
    ms = time_graph(g)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.replay(); torch.cuda.synchronize()
    path = tempfile.mktemp(suffix=".json"); prof.export_chrome_trace(path)
    ev = sorted((e for e in json.load(open(path))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memset")), key=lambda e: e["ts"])
    memsets = [e for e in ev if e["cat"] == "gpu_memset"]
    kern = [e for e in ev if e["cat"] == "kernel"]
    busy = sum(e["dur"] for e in kern); span = ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]
    flops = sum(2 * m * n * k for _, m, n, k, _ in ops) * 8
    after = {}
    for x, y in zip(ev, ev[1:]):
        if x["cat"] == "gpu_memset": after[y["name"][:60]] = after.get(y["name"][:60], 0) + 1
    print(f"[{mode}] {label}: graph {ms:.3f} ms for {len(ops) * 8} GEMMs ({flops / ms / 1e9:.0f} TFLOPS); kernels busy {busy / 1000:.3f} ms of span {span / 1000:.3f}; "
          f"memsets {len(memsets)} ({sum(e['dur'] for e in memsets):.0f} us)")
    for k_, v in sorted(after.items(), key=lambda kv: -kv[1])[:6]: print(f"     memset before {v:3d} x {k_}")
    # per shape: which kernel and whether a memset precedes it (first repetition)
    if os.environ.get("DETAIL"):
        i = 0
        for x_prev, x in zip([None] + ev[:-1], ev):
            if x["cat"] == "kernel" and i < len(ops):
                print(f"       {ops[i][0]:5s} {ops[i][1]}x{ops[i][2]}x{ops[i][3]}: {x['dur']:7.1f} us {'M ' if x_prev and x_prev['cat']=='gpu_memset' else '  '}{x['name'][:70]}")
                i += 1
