"""The peer megafp8 is measured against on one GPU: the plain PyTorch GPT a PyTorch user trains instead.

The shapes of megafp8's GPT-1.3B preset (`1b`: 24 layers of hidden 2048, 16 heads, FFN 4x, tanh
GELU, LayerNorm, learned positions, tied embeddings, the vocabulary padded as megafp8 pads it;
sequence 2048, micro-batch 8) or 7B-shaped layers (`7b`: 8 layers of hidden 4096, FFN 16384, 32
heads; sequence 4096, micro-batch 2). fp32 master weights under bf16 autocast, AdamW (fused on
CUDA), random tokens, one micro-batch per optimizer step. Variants: `bf16` (eager),
`bf16_compile` (each transformer block torch.compile'd), `float8_tensorwise` and
`float8_rowwise` (torchao's convert_to_float8_training on the blocks' linears, then compiled; the
output layer stays bf16, as megafp8's does). torchao is optional: `pip install megafp8[peer]`.

    python benchmarks/peer_gpt.py --variant float8_tensorwise --shape 7b --output runs.jsonl

After --warmup-steps steps (compilation included) it times --steps steps with CUDA events and
prints one JSON line (appended to --output too): variant, shape, tokens/s, step ms, peak memory,
device, torch and torchao versions. `--trainer-flags` prints megafp8's trainer flags for the same
shape instead (benchmarks/side_by_side.sh runs both). On a CPU, with the sizes shrunk, for tests:

    python benchmarks/peer_gpt.py --device cpu --variant bf16 --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --vocab-size 1000
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import torch.nn.functional as F
from megafp8.models.config import TransformerConfig, preset
from torch import nn

PRESET = "gpt-1.3b"
# Per shape: the preset's fields changed, the sequence length and the micro-batch size.
SHAPES = {
    "1b": ({}, 2048, 8),
    "7b": (
        {"num_layers": 8, "hidden_size": 4096, "ffn_hidden_size": 16384, "num_attention_heads": 32},
        4096,
        2,
    ),
}
VARIANTS = ("bf16", "bf16_compile", "float8_tensorwise", "float8_rowwise")
# The config fields the command line may override, each with the trainer's flag of the same name.
SIZE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")
SIZE_FLAGS = SIZE_FIELDS + ("seq_length", "micro_batch_size")


class Block(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_attention_heads
        self.norm1 = nn.LayerNorm(h, eps=config.norm_epsilon)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h, eps=config.norm_epsilon)
        self.fc1 = nn.Linear(h, config.ffn_size)
        self.fc2 = nn.Linear(config.ffn_size, h)

    def forward(self, x):
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        h = config.hidden_size
        self.embedding = nn.Embedding(config.padded_vocab_size(), h)
        self.positions = nn.Embedding(config.max_position_embeddings, h)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(h, eps=config.norm_epsilon)
        self.output = nn.Linear(h, config.padded_vocab_size(), bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=config.init_method_std)
        self.output.weight = self.embedding.weight  # tied, as the preset's

    def forward(self, tokens):
        x = self.embedding(tokens) + self.positions(
            torch.arange(tokens.shape[1], device=tokens.device)
        )
        for block in self.blocks:
            x = block(x)
        return self.output(self.final_norm(x))


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=VARIANTS, default="bf16_compile")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="1b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--warmup-steps", type=int, default=4, help="untimed steps first (compilation)"
    )
    parser.add_argument("--steps", type=int, default=12, help="timed steps")
    parser.add_argument("--output", type=Path, help="JSON lines file to append the result to")
    parser.add_argument(
        "--trainer-flags",
        action="store_true",
        help="print megafp8's trainer flags for this shape and exit",
    )
    sizes = parser.add_argument_group(
        "the shape's sizes, overridden (tests shrink them to run on a CPU)"
    )
    for field in SIZE_FLAGS:
        sizes.add_argument("--" + field.replace("_", "-"), type=int)
    args = parser.parse_args(argv)
    if args.warmup_steps < 1 or args.steps < 1:
        parser.error("--warmup-steps and --steps must be at least 1")
    return args


def shape_of(args) -> tuple[TransformerConfig, int, int]:
    """The model config, sequence length and micro-batch size of --shape with the overrides."""
    fields, seq_length, micro_batch_size = SHAPES[args.shape]
    seq_length = args.seq_length or seq_length
    given = {
        field: getattr(args, field) for field in SIZE_FIELDS if getattr(args, field) is not None
    }
    config = preset(PRESET, **{**fields, **given, "max_position_embeddings": seq_length})
    return config, seq_length, args.micro_batch_size or micro_batch_size


def trainer_flags(config: TransformerConfig, seq_length: int, micro_batch_size: int) -> list[str]:
    """megafp8's flags for the same model, sequence and batch: one micro-batch per step."""
    base = preset(PRESET)
    flags = ["--model", PRESET]
    for field in SIZE_FIELDS + ("max_position_embeddings",):
        if getattr(config, field) != getattr(base, field):
            flags += ["--" + field.replace("_", "-"), str(getattr(config, field))]
    return flags + [
        "--seq-length",
        str(seq_length),
        "--micro-batch-size",
        str(micro_batch_size),
        "--global-batch-size",
        str(micro_batch_size),
    ]


def torchao_version() -> str | None:
    try:
        return version("torchao")
    except PackageNotFoundError:
        return None


def require_torchao(variant: str) -> None:
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"peer_gpt: --variant {variant} needs torchao ({error}): pip install 'megafp8[peer]', "
            "or offline its wheel: pip install --no-deps .whl/torchao-*.whl"
        )


def build(config: TransformerConfig, variant: str, device: torch.device) -> GPT:
    torch.manual_seed(0)
    model = GPT(config).to(device)
    if variant.startswith("float8_"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = Float8LinearConfig.from_recipe_name(variant.removeprefix("float8_"))
        # the blocks only: the output layer stays bf16
        convert_to_float8_training(model.blocks, config=recipe)
    if variant != "bf16":
        for block in model.blocks:
            block.compile()
    return model


def train_step(model: GPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def elapsed_ms(run, device: torch.device) -> float:
    """Wall time of run() in ms: between CUDA events on a GPU, so the queued work is counted."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    run()
    return (time.perf_counter() - begin) * 1e3


def measure(args) -> dict:
    config, seq_length, micro_batch_size = shape_of(args)
    device = torch.device(args.device)
    model = build(config, args.variant, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    # Drawn before the clock starts; seq + 1 tokens: inputs and their next-token labels.
    batches = torch.randint(
        0,
        config.vocab_size,
        (args.warmup_steps + args.steps, micro_batch_size, seq_length + 1),
        device=device,
    )
    losses = []

    def run(steps: range):
        for step in steps:
            losses.append(train_step(model, optimizer, batches[step]))

    warmup_ms = elapsed_ms(lambda: run(range(args.warmup_steps)), device)
    step_ms = (
        elapsed_ms(lambda: run(range(args.warmup_steps, args.warmup_steps + args.steps)), device)
        / args.steps
    )
    cuda = device.type == "cuda"
    return {
        "benchmark": "peer_gpt",
        "variant": args.variant,
        "shape": args.shape,
        "resized": any(getattr(args, field) is not None for field in SIZE_FLAGS),
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "ffn_hidden_size": config.ffn_size,
        "vocab_size": config.vocab_size,
        "padded_vocab_size": config.padded_vocab_size(),
        "seq_length": seq_length,
        "micro_batch_size": micro_batch_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "warmup_steps": args.warmup_steps,
        "steps": args.steps,
        "tokens_per_sec": micro_batch_size * seq_length / (step_ms / 1e3),
        "step_ms": step_ms,
        "warmup_s": warmup_ms / 1e3,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "loss": losses[-1].item(),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "torchao": torchao_version(),
    }


def main(argv=None):
    args = parse(argv)
    if args.trainer_flags:
        print(" ".join(trainer_flags(*shape_of(args))))
        return
    if args.variant.startswith("float8_"):
        require_torchao(args.variant)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "peer_gpt: no CUDA device (torch sees none); --device cpu runs it on the CPU, "
            "with the sizes shrunk (see --help)"
        )
    result = measure(args)
    line = json.dumps(result)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "a") as f:
            f.write(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
