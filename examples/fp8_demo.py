"""FP8 demo: train a small next-byte model whose linear layers run in FP8, next to the same
model in high precision, and watch both losses fall together.

    python examples/fp8_demo.py [--steps 300] [--recipe delayed|current] [--format hybrid|e4m3]

The text is the Python standard library's own source (on every machine). The model is an
MLP over the previous 32 bytes; its three Fp8Linear layers run their forward, data-gradient
and weight-gradient GEMMs in FP8 (torch._scaled_mm) under fp8_autocast, on a GPU when there
is one (bf16) and on the CPU otherwise (fp32). Both models train on the same batches; the
demo prints their losses every 25 steps, then the mean of the last tenth and the FP8 scales
of the middle layer. The default 300 steps took 47 s on 2 AMD EPYC cores (torch 2.13), and
several minutes on the same cores while other processes kept them busy.

This is the FP8 core alone; examples/quickstart.sh runs the whole pretraining pipeline.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import textwrap
import time

import torch
import torch.nn.functional as F
from torch import nn

from megafp8 import CurrentScaling, DelayedScaling, Fp8Linear, fp8_autocast

CONTEXT = 32


def corpus() -> torch.Tensor:
    text = "\n".join(
        inspect.getsource(module) for module in (argparse, collections, json, textwrap)
    )
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


class NextByteModel(nn.Module):
    def __init__(self, width: int = 512):
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.fc1 = Fp8Linear(CONTEXT * 32, width)
        self.fc2 = Fp8Linear(width, width)
        self.head = Fp8Linear(width, 256)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        h = self.embed(context).flatten(1)
        h = F.gelu(self.fc1(h))
        h = F.gelu(self.fc2(h))
        return self.head(h)


def batches(data: torch.Tensor, batch: int, steps: int, device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, len(data) - CONTEXT - 1, (batch,), generator=generator)
        window = data[start[:, None] + torch.arange(CONTEXT + 1)]
        yield window[:, :-1].to(device), window[:, -1].to(device)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256, help="a multiple of 16 (FP8 GEMM shapes)")
    parser.add_argument("--recipe", choices=["delayed", "current"], default="delayed")
    parser.add_argument("--format", choices=["hybrid", "e4m3"], default="hybrid")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    recipe = (
        DelayedScaling(fp8_format=args.format, amax_history_len=16)
        if args.recipe == "delayed"
        else CurrentScaling(fp8_format=args.format)
    )
    data = corpus()
    print(
        f"megafp8 FP8 demo on {device} ({dtype}): {len(data) / 1e6:.2f} MB of text, "
        f"{args.recipe} scaling, {args.format} format"
    )

    torch.manual_seed(0)
    fp8_model = NextByteModel().to(device, dtype)
    reference = NextByteModel().to(device, dtype)
    reference.load_state_dict(fp8_model.state_dict())
    runs = {"fp8": (fp8_model, True), "reference": (reference, False)}
    optimizers = {
        name: torch.optim.AdamW(model.parameters(), lr=2e-3) for name, (model, _) in runs.items()
    }
    losses = {name: [] for name in runs}

    print(f"{'step':>6} {'fp8 loss':>9} {'ref loss':>9}")
    start = time.time()
    for step, (context, target) in enumerate(
        batches(data, args.batch, args.steps, device, seed=1), 1
    ):
        for name, (model, fp8) in runs.items():
            with fp8_autocast(enabled=fp8, recipe=recipe):
                logits = model(context)
            loss = F.cross_entropy(logits.float(), target)
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            losses[name].append(loss.item())
        if step % 25 == 0 or step == 1:
            print(f"{step:6d} {losses['fp8'][-1]:9.4f} {losses['reference'][-1]:9.4f}")

    tail = max(1, args.steps // 10)
    fp8_final = sum(losses["fp8"][-tail:]) / tail
    ref_final = sum(losses["reference"][-tail:]) / tail
    print(
        f"\nmean loss over the last {tail} steps: fp8 {fp8_final:.4f}, reference {ref_final:.4f} "
        f"(from {losses['fp8'][0]:.2f}; gap {100 * (fp8_final - ref_final) / ref_final:+.2f}%), "
        f"{time.time() - start:.0f} s"
    )
    scaling = fp8_model.fc2.fp8_scaling
    print(
        "fc2 scales: "
        + ", ".join(f"{role} {state.scale.item():.4g}" for role, state in scaling.items())
    )


if __name__ == "__main__":
    main()
