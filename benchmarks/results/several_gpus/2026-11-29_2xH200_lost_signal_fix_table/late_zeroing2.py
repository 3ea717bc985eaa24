# The workspace's SECOND growth with rank 0's legacy default stream (the trainer's compute stream)
# busy: does rank 1's first signal into the new pad get erased by rank 0's late cudaMemset?
# torchrun --nproc-per-node 2 .dev/late_zeroing2.py [sleep_on_legacy_only]
import os, sys, torch, torch.distributed as dist
from megafp8 import symmetric_memory
rank = int(os.environ["RANK"]); torch.cuda.set_device(rank)
dist.init_process_group("nccl"); group = dist.group.WORLD
symmetric_memory.use_copy_engines(group, timeout_s=20)
space = symmetric_memory.workspace(group)
small = torch.full((4, 8), float(rank + 1), device="cuda")
space.all_gather_into(small.new_empty(8, 8), small).wait()  # first allocation (grows from 0)
torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
big = torch.full((4096, 1024), float(rank + 1), device="cuda")
out = big.new_empty(8192, 1024)
if rank == 0:  # the compute stream is the legacy default stream, as in the trainer
    torch.cuda._sleep(2 * 10**9)
try:
    got = space.all_gather_into(out, big).wait()  # the second growth
    torch.cuda.synchronize()
    ok = bool((got[:4096] == 1).all() and (got[4096:] == 2).all())
    print(f"rank {rank}: gathered {ok}", flush=True)
except RuntimeError as error:
    print(f"rank {rank} stopped: {error}", flush=True)
os._exit(0)
