"""Session-19 probe: the eager wall time of a stack of GPT-1.3B layers (forward + backward,
steps back to back, the GPU synchronized only around the run), per layer, against what the
tp 2 x pp 2 (5.8 ms/layer delayed, 4.8 current, 3.5 bf16) and tp 1 x pp 2 (4.4 delayed) runs
took per layer. If the eager wall time of a 12-layer stack (a pp 2 stage) reproduces them, the
planner should time pipelines' layers eagerly instead of max(GPU, host).
    python probe/eager_wall.py  |  torchrun --nproc-per-node 2 probe/eager_wall.py"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, "benchmarks")
from bench_layer_grid import layer_config, scaling  # noqa: E402

from megafp8.fp8 import fp8_autocast  # noqa: E402
from megafp8.models.transformer import TransformerLayer  # noqa: E402

tp_group, tp = None, 1
if "LOCAL_RANK" in os.environ:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    tp_group, tp = dist.group.WORLD, dist.get_world_size()
config = layer_config("gpt", 2048, 2048)
mb, seq = 4, 2048
torch.manual_seed(0)
layers = [TransformerLayer(config, tp_group, tp > 1, torch.bfloat16, "cuda") for _ in range(12)]
x = torch.randn(seq // tp, mb, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
for name in ("bf16", "delayed", "current"):
    recipe = scaling(name)
    row = []
    for depth in (1, 4, 12):
        modules = layers[:depth]

        def step():
            for m in modules:
                for p in m.parameters():
                    p.grad = None
            with fp8_autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=tp_group):
                y = x
                for m in modules:
                    y = m(y, None)
            y.backward(dy)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        if tp_group is not None:
            dist.barrier()
        start = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        row.append((time.perf_counter() - start) * 100 / depth)
    if tp_group is None or dist.get_rank() == 0:
        print(f"tp {tp} mb {mb} {name:8s} eager wall ms per layer, stacks of 1/4/12: "
              + " / ".join(f"{v:.2f}" for v in row), flush=True)
if tp_group is not None:
    dist.destroy_process_group()
