# Probe: sequence-parallel all-gather / reduce-scatter beside an FP8 GEMM, NCCL vs copy engines
# (symmetric memory). torchrun --nproc-per-node 2 .dev/ce_probe.py
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm

from megafp8.collective_gemm import gathered_gemm, gemm_reduce_scatter
from megafp8.collectives import all_gather_into, reduce_scatter_into

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
G = dist.group.WORLD
W = dist.get_world_size()
name = G.group_name
try:
    symm.enable_symm_mem_for_group(name)
except Exception as e:  # noqa
    print("enable_symm_mem_for_group:", e)
buf = symm.empty(64 << 20, dtype=torch.uint8, device="cuda")
h = symm.rendezvous(buf, name)
side = torch.cuda.Stream()
one = torch.ones((), device="cuda")
R = 4096
out_lines = []


def say(*a):
    if rank == 0:
        print(*a, flush=True)


def timed(fn, reps=40):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    t = torch.tensor([s.elapsed_time(e) / reps * 1000], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def graphed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    return timed(g.replay, reps=5) / reps


def ce_gather(local, out, rows, cols):
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        h.get_buffer(rank, (rows, cols), torch.uint8).copy_(local.view(torch.uint8))
        h.barrier(channel=0)
        ob = out.view(torch.uint8)
        for p in range(W):
            if p != rank:
                ob[p * rows:(p + 1) * rows].copy_(h.get_buffer(p, (rows, cols), torch.uint8))
        h.barrier(channel=1)
    ev = torch.cuda.Event()
    ev.record(side)
    return ev


for N in (3072, 4096):
    K = 2048
    x = (torch.randn(R, K, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    w = (torch.randn(N, K, device="cuda") * 0.05).to(torch.float8_e4m3fn)
    full = torch.cat([x] * W)
    y = torch.empty(W * R, N, dtype=torch.bfloat16, device="cuda")
    gathered = torch.empty(W * R, K, dtype=torch.float8_e4m3fn, device="cuda")

    def gemm(rows, out):
        torch._scaled_mm(rows, w.t(), one, one, out_dtype=torch.bfloat16, out=out)

    def nccl_ag():
        all_gather_into(gathered, x, G)

    def ce_ag():
        torch.cuda.current_stream().wait_event(ce_gather(x, gathered, R, K))

    def nccl_ov():
        gathered_gemm(x, G, gemm, y)

    def ce_ov():
        ev = ce_gather(x, gathered, R, K)
        mine = slice(rank * R, (rank + 1) * R)
        gemm(x, y[mine])
        torch.cuda.current_stream().wait_event(ev)
        for o in (slice(0, mine.start), slice(mine.stop, W * R)):
            if o.stop > o.start:
                gemm(gathered[o], y[o])

    # correctness of the CE gather
    ref = torch.empty_like(gathered)
    all_gather_into(ref, (x.float() + rank).to(torch.float8_e4m3fn), G)
    xr = (x.float() + rank).to(torch.float8_e4m3fn)
    torch.cuda.current_stream().wait_event(ce_gather(xr, gathered, R, K))
    gathered[rank * R:(rank + 1) * R] = xr
    torch.cuda.synchronize()
    say(f"AG N={N}: CE gather equals NCCL: {torch.equal(ref.view(torch.uint8), gathered.view(torch.uint8))}")
    row = {"gemm_full": lambda: gemm(full, y), "gemm_half": lambda: gemm(x, y[:R]), "nccl_ag": nccl_ag,
           "ce_ag": ce_ag, "nccl_overlap": nccl_ov, "ce_overlap": ce_ov}
    res = {k: timed(f) for k, f in row.items()}
    for k in ("gemm_full", "nccl_overlap", "ce_overlap", "nccl_ag", "ce_ag"):
        try:
            res[k + "_graphed"] = graphed(row[k])
        except Exception as e:  # noqa
            say(f"graph {k}: {type(e).__name__}: {str(e)[:300]}")
    say(f"AG+GEMM rows {W}x{R} K={K} N={N} (us): " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))

# reduce-scatter after the row-parallel GEMM: out (R, 2048) summed
for K in (1024, 4096):
    N = 2048
    a = (torch.randn(W * R, K, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    w = (torch.randn(N, K, device="cuda") * 0.05).to(torch.float8_e4m3fn)
    yfull = torch.empty(W * R, N, dtype=torch.bfloat16, device="cuda")
    ymine = torch.empty(R, N, dtype=torch.bfloat16, device="cuda")
    recv = torch.empty(R, N, dtype=torch.bfloat16, device="cuda")

    def gemm(rows, out):
        torch._scaled_mm(rows, w.t(), one, one, out_dtype=torch.bfloat16, out=out)

    def plain_rs():
        gemm(a, yfull)
        reduce_scatter_into(ymine, yfull, G)

    def ring():
        gemm_reduce_scatter(a, G, gemm, N, torch.bfloat16)

    def ce_rs():  # tp2 only
        peer = 1 - rank
        slot = h.get_buffer(rank, (R, N), torch.bfloat16)
        side.wait_stream(torch.cuda.current_stream())  # the slot is free (last barrier(1) on side)
        torch.cuda.current_stream().wait_stream(side)
        gemm(a[peer * R:(peer + 1) * R], slot)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            h.barrier(channel=0)
            recv.copy_(h.get_buffer(peer, (R, N), torch.bfloat16))
            h.barrier(channel=1)
        gemm(a[rank * R:(rank + 1) * R], ymine)
        torch.cuda.current_stream().wait_stream(side)
        ymine.add_(recv)

    # correctness
    ring_out = gemm_reduce_scatter(a, G, gemm, N, torch.bfloat16).clone()
    ce_rs()
    torch.cuda.synchronize()
    say(f"RS K={K}: CE equals ring: {torch.equal(ring_out, ymine)}; max diff {(ring_out.float() - ymine.float()).abs().max().item()}")
    row = {"gemm_full": lambda: gemm(a, yfull), "plain_rs": plain_rs, "nccl_ring": ring, "ce_rs": ce_rs}
    res = {k: timed(f) for k, f in row.items()}
    for k in ("gemm_full", "nccl_ring", "ce_rs"):
        try:
            res[k + "_graphed"] = graphed(row[k])
        except Exception as e:  # noqa
            say(f"graph {k}: {type(e).__name__}: {str(e)[:300]}")
    say(f"GEMM+RS rows {W}x{R} K={K} N={N} (us): " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))

dist.barrier()
dist.destroy_process_group()
sys.exit(0)
