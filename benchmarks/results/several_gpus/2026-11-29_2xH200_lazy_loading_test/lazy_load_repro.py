"""Does a first-time kernel launch (CUDA lazy loading) wait for a copy-engine barrier whose peer's
barrier is queued but not started? torchrun --nproc-per-node 2 .dev/lazy_load_repro.py MODE
MODE: lazy (the op's first launch while the barriers wait), preloaded (the op launched once before).
Each rank: copy stream = [sleep ~0.5 s on rank 1 only] -> barrier; then the host launches a kernel
of an op this process never ran (torch.special.bessel_j0: its module loads lazily)."""
import os, sys, time
import torch, torch.distributed as dist
import torch.distributed._symmetric_memory as symm
mode = sys.argv[1]
rank = int(os.environ["RANK"]); torch.cuda.set_device(rank)
dist.init_process_group("nccl")
t0 = time.time()
def log(msg): print(f"[rank {rank} {time.time() - t0:6.2f}s] {msg}", flush=True)
buf = symm.empty(1024, dtype=torch.uint8, device="cuda")
handle = symm.rendezvous(buf, dist.group.WORLD.group_name)
side = torch.cuda.Stream()
x = torch.randn(1 << 20, device="cuda")
torch.cuda._sleep(1000)                       # load the sleep kernel
with torch.cuda.stream(side):
    handle.barrier(channel=0, timeout_ms=60000)  # load the barrier kernel, meet once
torch.cuda.synchronize(); dist.barrier(); log("warm")
if mode == "preloaded":
    torch.special.bessel_j0(x); torch.cuda.synchronize(); log("op preloaded")
dist.barrier()
with torch.cuda.stream(side):
    if rank == 1:
        torch.cuda._sleep(int(1.98e9 * 0.5))    # rank 1's barrier queued behind ~0.5 s of work
    handle.barrier(channel=1, timeout_ms=20000)
log("barrier launched; first launch of the op next")
y = torch.special.bessel_j0(x)
log("op launched")
torch.cuda.synchronize()
log(f"done {y.sum().item():.3f}")
dist.destroy_process_group()
