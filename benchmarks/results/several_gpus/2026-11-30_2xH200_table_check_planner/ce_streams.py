# Copy-engine bandwidth of a pull from the peer's symmetric buffer, the block split over 1, 2 or 4 streams at once
# (each stream's cudaMemcpy may take its own copy engine). torchrun --nproc-per-node 2 ce_streams.py
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
group = dist.group.WORLD
buf = symm.empty(64 << 20, dtype=torch.uint8, device="cuda")
handle = symm.rendezvous(buf, group.group_name)
peer = handle.get_buffer(1 - rank, (buf.numel(),), torch.uint8)
dst = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
streams = [torch.cuda.Stream() for _ in range(4)]
for size_mb in (8, 16):
    n = size_mb << 20
    for ways in (1, 2, 4):
        chunk = n // ways

        def pull():
            main = torch.cuda.current_stream()
            for i in range(ways):
                streams[i].wait_stream(main)
                with torch.cuda.stream(streams[i]):
                    dst[i * chunk : (i + 1) * chunk].copy_(peer[i * chunk : (i + 1) * chunk])
            for i in range(ways):
                main.wait_stream(streams[i])

        for _ in range(5):
            pull()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                pull()
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1000 / 200
        if rank == 0:
            print(
                f"{size_mb} MB pulled in {ways} chunk(s) on {ways} stream(s): {us:.1f} us, {n / us / 1e3:.0f} GB/s",
                flush=True,
            )
dist.destroy_process_group()
