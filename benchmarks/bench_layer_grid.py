"""Where FP8 pays: one transformer layer's forward + backward in bf16, FP8 delayed and FP8 current
scaling over model width x sequence length x micro-batch, as the FP8-maturity seed article shows
for Transformer Engine (a GPT-3 layer's FP8/bf16 speed-up as a coloured grid).

    python benchmarks/bench_layer_grid.py --output grid.json [--archs gpt llama]
        [--hidden-sizes 768 ... 12288] [--seq-lengths 1024 2048 4096 8192] [--micro-batches 1 2 4 8]
    torchrun --nproc-per-node 2 benchmarks/bench_layer_grid.py --output grid_tp2.json   # tp 2, SP
        [--no-tp-comm-overlap]
    python benchmarks/bench_layer_grid.py --plot grid.json [grid_tp2.json] --plot-dir docs/img [--table grid.md]
    python benchmarks/bench_layer_grid.py --model llama2-7b --seq-lengths 4096 --micro-batches 1 2 \
        --output llama2-7b.json   # one preset's layer and output layer: the planner's input

The layer is megafp8's own (models.transformer.TransformerLayer, FP8 linears with the fused
norm and activation casts), one per point, in bf16 parameters; with several processes it is
tensor parallel over all of them with sequence parallelism and, as the recipes run it, its
collectives beside the GEMMs (`--tp-comm-overlap`: on the copy engines in the graphed timings
where the GPUs allow, through NCCL in the eager ones, as the trainer's `auto` transport; each
point says `tp_comm_overlap`). Each step (forward and backward) is
captured in a CUDA graph and replayed, so the times are the GPU's, not the host's; the median of
CUDA-event timings (median_ms: do_bench's method, with run counts the ranks agree on). The
weights' FP8 casts stay out of the step, as in the trainer's graphs (made once per optimizer step,
before the first replay, or by the optimizer's own pass under delayed scaling): a graph capture
may not make them. Widths follow the GPT-3 family (GPT: 4h MLP, LayerNorm, GELU; Llama: SwiGLU
of about 8h/3, RMSNorm, RoPE; head dim 64 below 2048, 128 from 2048; Llama with 8 KV heads from
8192). A point that does not fit is recorded as such. Each point also holds the forward alone
(`{recipe}_fwd_ms`: what full recomputation repeats).

`--model PRESET` times that preset's own layer instead (its hidden size, heads, KV heads and
MLP width) and, per point, the host's time for an eager step (Python and launches with the GPU
kept busy: what a layout that cannot be graphed, such as a pipeline-parallel one, waits on where
it exceeds the GPU's time): of one layer (`{recipe}_host_ms`) and, from a stack of HOST_STACK
layers under one autocast, split into each further layer's share (`{recipe}_host_layer_ms`) and
the pass's own (`{recipe}_host_pass_ms`: FP8's scaling updates run once per pass, not per layer),
its output end
(`head_{recipe}_ms`: embedding, final norm, output layer and loss, forward + backward, as the
trainer runs them: a one-layer model's step less the layer's), the step with selective
recomputation (`{recipe}_selective_ms`), and once the device's copy bandwidth (`copy_gbs`, bytes
read and written per second, for the optimizer's memory-bound pass): what
tools/plan_parallel.py's throughput model reads.

`--plot` draws, per architecture and tensor-parallel size, heat maps of the FP8/bf16 speed-up
(delayed and current) with hidden size down and (sequence, micro-batch) across, in the seed's
colours: red below 1x, blue 1-1.3x, green above 1.3x.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from megafp8.models.config import PRESETS, preset

from megafp8.planner import layer_map

GPT3_HIDDEN_SIZES = (768, 1024, 1536, 2048, 2560, 4096, 5120, 12288)  # 125M ... 175B
RECIPES = ("bf16", "delayed", "current")  # the default columns; --recipes adds the others
FINE_GRAINED = ("rowwise", "blockwise")  # E4M3; blockwise: every dimension a multiple of 128
# layers in the stack whose eager host time splits into per-layer and per-pass shares
HOST_STACK = 4
BANDS = (
    (1.0, "below 1x", "#d73027"),
    (1.3, "1-1.3x", "#4575b4"),
    (float("inf"), "above 1.3x", "#1a9850"),
)


def layer_config(arch: str, hidden: int, seq_length: int):
    """The TransformerConfig of one layer of width `hidden` in the GPT-3 family's proportions."""
    from megafp8.models.config import gpt_config, llama_config

    head_dim = 64 if hidden < 2048 else 128
    heads = hidden // head_dim
    if arch == "gpt":
        return gpt_config(1, hidden, heads, max_position_embeddings=seq_length)
    if arch == "llama":
        ffn = 256 * ((8 * hidden // 3 + 255) // 256)  # Llama's SwiGLU width, a multiple of 256
        kv_heads = 8 if hidden >= 8192 else heads
        return llama_config(
            1, hidden, heads, kv_heads, ffn, vocab_size=32000, max_position_embeddings=seq_length
        )
    raise ValueError(f"unknown architecture {arch!r}: give gpt or llama")


def shapes(args) -> list[tuple[str, int]]:
    """(architecture, hidden size) of the layers to time: the preset's with --model, else each of
    --archs at each of --hidden-sizes."""
    if args.model:
        config = preset(args.model)
        return [(layer_map.arch_of(config), config.hidden_size)]
    return [(arch, hidden) for arch in args.archs for hidden in args.hidden_sizes]


def layer_flops(config, tokens: int, seq_length: int) -> float:
    """Forward + backward FLOPs of one layer over `tokens` in sequences of `seq_length` (linears
    and causal attention; backward twice forward)."""
    h, heads, kv, d = (
        config.hidden_size,
        config.num_attention_heads,
        config.kv_heads,
        config.head_dim,
    )
    ffn = config.ffn_size * (3 if config.activation == "swiglu" else 2)
    linear = 2 * tokens * h * ((heads + 2 * kv) * d + heads * d + ffn)
    # QK^T and PV, half of each under the causal mask
    attention = 2 * tokens * seq_length * heads * d
    return 3 * (linear + attention)


def scaling(name: str):
    """The FP8 recipe a grid column names (None: bf16)."""
    from megafp8.fp8 import BlockwiseScaling, CurrentScaling, DelayedScaling, RowwiseScaling

    return {
        "bf16": None,
        "delayed": DelayedScaling(),
        "current": CurrentScaling(),
        "rowwise": RowwiseScaling(),
        "blockwise": BlockwiseScaling(),
    }[name]


@contextmanager
def graphed_transfers(tp_group, overlap: bool):
    """Inside: the overlapped blocks travel on the copy engines, as the trainer's graphs move them
    (its default SMs left free), where the group can (megafp8.symmetric_memory); NCCL otherwise,
    and outside."""
    from megafp8 import symmetric_memory

    use = overlap and tp_group is not None and symmetric_memory.unavailable_reason(tp_group) is None
    if use:
        symmetric_memory.use_copy_engines(tp_group, symmetric_memory.DEFAULT_SM_CARVEOUT)
    try:
        yield
    finally:
        if use:
            symmetric_memory.stop_using_copy_engines()


def time_point(config, seq, micro_batch, recipes, tp_group, planner=False, overlap=False) -> dict:
    """{kind: {recipe: ms}} for one grid point of layer `config` (None where it did not fit), on
    this process's GPU: "ms" (forward + backward, graphed), "fwd_ms" (the forward alone) and, for
    the planner (--model), "host_ms" (an eager step's host time), "host_layer_ms" and
    "host_pass_ms" (that of a HOST_STACK-layer stack, split per layer and per pass), "selective_ms" (the step with
    selective recomputation, the attention core run again in backward, graphed as the trainer
    graphs it) and "head" (the output end); `overlap`: the layers' --tp-comm-overlap."""
    # the benchmarks' shared CUDA-graph helper
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_fp8_linear import graphed
    from megafp8.models.rope import rotary_tables
    from megafp8.models.transformer import TransformerLayer

    from megafp8.collectives import group_size
    from megafp8.fp8 import fp8_autocast

    tp = group_size(tp_group)
    kinds = layer_map.KINDS if planner else ("ms", "fwd_ms")
    times = {kind: {} for kind in kinds}
    torch.cuda.empty_cache()  # the last point's layer and graphs are gone: give their memory back
    try:
        torch.manual_seed(0)
        overlap = overlap and tp > 1
        layer = TransformerLayer(
            config, tp_group, tp > 1, torch.bfloat16, "cuda", tp_comm_overlap=overlap
        )
        selective = (
            TransformerLayer(
                config,
                tp_group,
                tp > 1,
                torch.bfloat16,
                "cuda",
                recompute="selective",
                tp_comm_overlap=overlap,
            )
            if planner
            else None
        )
        stack = (
            [layer]
            + [
                TransformerLayer(
                    config, tp_group, tp > 1, torch.bfloat16, "cuda", tp_comm_overlap=overlap
                )
                for _ in range(HOST_STACK - 1)
            ]
            if planner
            else None
        )
        x = torch.randn(
            seq // tp,
            micro_batch,
            config.hidden_size,
            device="cuda",
            dtype=torch.bfloat16,
            requires_grad=True,
        )
        dy = torch.randn_like(x)
        rotary = (
            tuple(t.cuda() for t in rotary_tables(seq, config.head_dim, config.rope_theta))
            if config.position_embedding == "rope"
            else None
        )
        for name in recipes:
            recipe = scaling(name)

            def forward(modules=(layer,)):  # one pass through the layers, as a pipeline stage's
                with fp8_autocast(
                    enabled=recipe is not None, recipe=recipe, amax_reduction_group=tp_group
                ):
                    y = x
                    for module in modules:
                        y = module(y, rotary)
                    return y

            def step(modules=(layer,)):
                for module in modules:
                    for p in module.parameters():
                        p.grad = None
                x.grad = None
                forward(modules).backward(dy)

            try:
                if planner:  # eager, as pipeline-parallel layouts run (no graphs)
                    one, many = eager_host_ms(step), eager_host_ms(lambda: step(stack))
                    times["host_ms"][name] = one
                    layer_share = (
                        None
                        if one is None or many is None
                        else max(0.0, (many - one) / (HOST_STACK - 1))
                    )
                    times["host_layer_ms"][name] = layer_share
                    times["host_pass_ms"][name] = (
                        None if layer_share is None else max(0.0, one - layer_share)
                    )
                with graphed_transfers(tp_group, overlap):
                    times["ms"][name] = median_ms(graphed(step), tp_group)
                    times["fwd_ms"][name] = median_ms(graphed(forward), tp_group)
                    if planner:
                        times["selective_ms"][name] = selective_ms(
                            lambda: step((selective,)), tp_group
                        )
            except torch.cuda.OutOfMemoryError:
                for kind in kinds:
                    times[kind][name] = None
            torch.cuda.empty_cache()
        if planner:
            times["head"] = time_head(
                config, seq, micro_batch, recipes, tp_group, times["ms"], overlap
            )
    except torch.cuda.OutOfMemoryError:
        times = {
            kind: {name: None for name in recipes}
            for kind in kinds + (("head",) if planner else ())
        }
    return times


def selective_ms(step, tp_group) -> float | None:
    """The graphed step of the layer with selective recomputation, or None (said on stderr) where
    it cannot be graphed here: the planner then flags selective layouts as stretched rather than
    the whole map being lost."""
    from bench_fp8_linear import graphed

    try:
        return median_ms(graphed(step), tp_group)
    except RuntimeError as error:
        print(
            f"warning: the layer with selective recomputation was not timed: {error}",
            file=sys.stderr,
        )
        return None


def median_ms(fn, tp_group=None, warmup_ms=25.0, rep_ms=100.0) -> float:
    """Median CUDA-event time of `fn` in ms, as triton.testing.do_bench's, except that the ranks of
    `tp_group` agree on the number of runs: do_bench sizes them from each rank's own estimate, and
    ranks that replay a different number of graphs with collectives in them wait on each other
    forever."""
    import torch.distributed as dist

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = torch.tensor([start.elapsed_time(end) / 5], device="cuda")
    if tp_group is not None:
        dist.all_reduce(estimate, op=dist.ReduceOp.MAX, group=tp_group)
    estimate = max(float(estimate), 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(max(1, int(rep_ms / estimate)))]
    ends = [torch.cuda.Event(enable_timing=True) for _ in starts]
    for begin, finish in zip(starts, ends):
        begin.record()
        fn()
        finish.record()
    torch.cuda.synchronize()
    return float(torch.tensor([b.elapsed_time(f) for b, f in zip(starts, ends)]).median())


def eager_host_ms(step, steps=10) -> float | None:
    """The host's median time for an eager `step` while the GPU is kept busy
    (bench_fp8_linear.host_step_times), or None where a step waited on the GPU all the same (it
    took half the sleep queued before it): then the host's own time cannot be told apart."""
    import statistics

    from bench_fp8_linear import HOST_WAIT_MS, host_step_times

    times = host_step_times(step, steps, sleep_per_step=True)
    if max(times) >= HOST_WAIT_MS:
        print(
            f"warning: an eager step took {max(times):.0f} ms of host time: it waits on the GPU "
            "somewhere, so its host time is not recorded",
            file=sys.stderr,
        )
        return None
    return statistics.median(times)


def time_head(config, seq, micro_batch, recipes, tp_group, layer_times, overlap=False):
    """{recipe: ms} of the model's output end (embedding, final norm, output layer, loss; forward
    + backward): a one-layer model's training step less its layer's time (`layer_times`)."""
    from bench_fp8_linear import graphed
    from megafp8.models.transformer import TransformerLM

    from megafp8.collectives import group_size
    from megafp8.fp8 import fp8_autocast

    tp = group_size(tp_group)
    torch.manual_seed(0)
    model = TransformerLM(
        config.replace(num_layers=1),
        tp_group=tp_group,
        sequence_parallel=tp > 1,
        tp_comm_overlap=overlap and tp > 1,
        dtype=torch.bfloat16,
        device="cuda",
    )
    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq), device="cuda")
    head_times = {}
    for name in recipes:
        recipe = scaling(name)

        def step():
            for p in model.parameters():
                p.grad = None
            with fp8_autocast(
                enabled=recipe is not None, recipe=recipe, amax_reduction_group=tp_group
            ):
                loss = model(tokens, tokens).mean()
            loss.backward()

        try:
            with graphed_transfers(tp_group, overlap and tp > 1):
                whole = median_ms(graphed(step), tp_group)
            head_times[name] = whole - layer_times[name] if layer_times[name] else None
        except torch.cuda.OutOfMemoryError:
            head_times[name] = None
        torch.cuda.empty_cache()
    return head_times


def copy_bandwidth() -> float:
    """The device's copy rate, bytes read and written per second (GB/s) over a 1 GiB copy: the
    optimizer's fused pass is bound by it."""
    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), warmup_ms=10, rep_ms=50)
    return 2 * source.numel() / ms / 1e6


def run_grid(args) -> dict:
    import torch.distributed as dist
    import triton

    tp_group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        tp_group = dist.group.WORLD
    tp = dist.get_world_size() if tp_group is not None else 1
    rank = dist.get_rank() if tp_group is not None else 0
    points = []
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tp": tp,
        "points": points,
    }
    for arch, hidden in shapes(args):
        for seq in args.seq_lengths:
            for micro_batch in args.micro_batches:
                config = (
                    preset(
                        args.model,
                        max_position_embeddings=max(
                            seq, preset(args.model).max_position_embeddings
                        ),
                    )
                    if args.model
                    else layer_config(arch, hidden, seq)
                )
                measured = time_point(
                    config,
                    seq,
                    micro_batch,
                    args.recipes,
                    tp_group,
                    planner=args.model is not None,
                    overlap=args.tp_comm_overlap,
                )
                times = measured["ms"]
                point = layer_map.point(
                    config,
                    seq,
                    micro_batch,
                    tp,
                    args.tp_comm_overlap and tp > 1,
                    {kind: per_recipe for kind, per_recipe in measured.items() if kind != "head"},
                    head=measured.get("head"),
                    model=args.model,
                    flops=layer_flops(config, seq * micro_batch, seq) / tp,
                )
                fp8_recipes = [name for name in args.recipes if name != "bf16"]
                for name in fp8_recipes:
                    point[f"speedup_{name}"] = (
                        times["bf16"] / times[name] if times.get("bf16") and times[name] else None
                    )
                points.append(point)
                if rank == 0:
                    # after every point: a grid cut short keeps what it measured
                    layer_map.write(result, args.output)
                    print(
                        f"{arch:5} h={hidden:5} s={seq:5} b={micro_batch} tp={tp}: "
                        + "  ".join(
                            f"{n} {times[n]:.3f} ms" if times[n] else f"{n} no fit"
                            for n in args.recipes
                        )
                        + "".join(
                            f"  {n} {point[f'speedup_{n}']:.2f}x"
                            for n in fp8_recipes
                            if point[f"speedup_{n}"]
                        ),
                        flush=True,
                    )
    if args.model:
        result["copy_gbs"] = copy_bandwidth()
    if tp_group is not None:
        dist.destroy_process_group()
    return result if rank == 0 else None


def read_points(paths) -> list[dict]:
    """The points of grid JSON files, in order, each with its file's GPU (`device`, without the
    vendor's name; "?" where the file does not say)."""
    points = []
    for path in paths:
        try:
            data = layer_map.read(path)
        except ValueError as error:
            sys.exit(f"bench_layer_grid.py --plot: {error}")
        device = data.get("device", "?").removeprefix("NVIDIA ")
        points += [{**point, "device": device} for point in data["points"]]
    return points


def raw_table(points: list[dict]) -> str:
    """Every point as a Markdown table row (ms of forward + backward, speed-ups, FP8 delayed's
    TFLOP/s) and the GPU that measured it, by architecture, tensor-parallel size, width, sequence
    and micro-batch; rowwise and blockwise columns where a point has them."""

    def number(value, spec):
        return "–" if value is None else format(value, spec)

    recipes = [*RECIPES] + [r for r in FINE_GRAINED if any(p.get(f"{r}_ms") for p in points)]
    fp8 = recipes[1:]
    lines = [
        "| layer | tp | hidden | sequence | micro-batch | "
        + " | ".join(f"{r} ms" for r in recipes)
        + " | "
        + " | ".join(f"{r} / bf16" for r in fp8)
        + " | delayed TFLOP/s | GPU |",
        "|---|---|---|---|---|" + "---|" * (len(recipes) + len(fp8)) + "---|---|",
    ]
    for p in sorted(
        points, key=lambda p: (p["arch"], p["tp"], p["hidden"], p["seq"], p["micro_batch"])
    ):
        lines.append(
            f"| {p.get('model', p['arch'])} | {p['tp']} | {p['hidden']} | {p['seq']} | {p['micro_batch']} | "
            + " | ".join(number(p.get(f"{r}_ms"), ".3f") for r in recipes)
            + " | "
            + " | ".join(number(p.get(f"speedup_{r}"), ".2f") for r in fp8)
            + " | "
            + f"{number(p.get('delayed_tflops'), '.0f')} | {p.get('device', '?')} |"
        )
    return "\n".join(lines) + "\n"


def plot(points: list[dict], plot_dir: Path) -> list[Path]:
    """Heat maps of the FP8/bf16 speed-up of grid points (read_points): one PNG per architecture
    and tensor-parallel size, delayed and current side by side. Where a map's points come from
    several GPUs, those of any but its most common GPU are starred, and a note names both."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("bench_layer_grid.py --plot needs matplotlib (pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import BoundaryNorm, ListedColormap

    plot_dir.mkdir(parents=True, exist_ok=True)
    colours = ListedColormap([colour for *_, colour in BANDS])
    norm = BoundaryNorm([0.0, 1.0, 1.3, 10.0], colours.N)
    written = []
    for arch, tp in sorted({(p["arch"], p["tp"]) for p in points}):
        mine = [p for p in points if p["arch"] == arch and p["tp"] == tp]
        hiddens = sorted({p["hidden"] for p in mine})
        columns = sorted({(p["seq"], p["micro_batch"]) for p in mine})
        devices = [p.get("device", "?") for p in mine]
        main_device = max(sorted(set(devices)), key=devices.count)
        starred = {
            (p["hidden"], p["seq"], p["micro_batch"])
            for p in mine
            if p.get("device", "?") != main_device
        }
        figure, axes = plt.subplots(
            1, 2, figsize=(max(8, 0.55 * len(columns) * 2 + 3), 0.5 * len(hiddens) + 2.5)
        )
        for axis, recipe in zip(axes, ("delayed", "current")):
            grid = [[float("nan")] * len(columns) for _ in hiddens]
            for p in mine:
                value = p.get(f"speedup_{recipe}")
                grid[hiddens.index(p["hidden"])][columns.index((p["seq"], p["micro_batch"]))] = (
                    value if value is not None else float("nan")
                )
            axis.set_facecolor("#d9d9d9")  # grey: not measured or did not fit
            axis.imshow(grid, cmap=colours, norm=norm, aspect="auto")
            for i, row in enumerate(grid):
                for j, value in enumerate(row):
                    star = "*" * ((hiddens[i], *columns[j]) in starred)
                    axis.text(
                        j,
                        i,
                        "–" if value != value else f"{value:.2f}{star}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="black" if value != value else "white",
                    )
            axis.set_xticks(
                range(len(columns)),
                [f"{s // 1024}k x{b}" for s, b in columns],
                rotation=90,
                fontsize=7,
            )
            axis.set_yticks(range(len(hiddens)), [str(h) for h in hiddens], fontsize=8)
            axis.set_xlabel("sequence x micro-batch")
            axis.set_ylabel("hidden size")
            axis.set_title(f"FP8 {recipe} / bf16")
        handles = [plt.Rectangle((0, 0), 1, 1, color=colour) for *_, colour in BANDS]
        figure.legend(
            handles, [label for _, label, _ in BANDS], loc="lower center", ncol=3, fontsize=8
        )
        others = sorted(set(devices) - {main_device})
        figure.suptitle(
            f"{arch.upper()} layer, forward + backward, tp {tp}, {main_device}"
            + (f" (* measured on {', '.join(others)})" if others else "")
        )
        figure.tight_layout(rect=(0, 0.06, 1, 1))
        out = plot_dir / f"layer_grid_{arch}_tp{tp}.png"
        figure.savefig(out, dpi=110)
        plt.close(figure)
        written.append(out)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", help="write the grid here (JSON)")
    parser.add_argument("--archs", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument(
        "--model",
        choices=sorted(PRESETS),
        help="time this preset's layer and output end instead of the GPT-3 family's widths",
    )
    parser.add_argument("--hidden-sizes", nargs="+", type=int, default=list(GPT3_HIDDEN_SIZES))
    parser.add_argument("--seq-lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=list(RECIPES),
        choices=[*RECIPES, *FINE_GRAINED],
        help="what each point is timed in (default: bf16 delayed current; rowwise and blockwise "
        "in E4M3, blockwise where every dimension splits into 128s); bf16 gives the speed-ups",
    )
    parser.add_argument(
        "--tp-comm-overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with tp > 1, the layers' collectives beside their GEMMs, as the recipes run them "
        "(default: on)",
    )
    parser.add_argument(
        "--plot", nargs="+", metavar="GRID_JSON", help="draw heat maps from grid files instead"
    )
    parser.add_argument("--plot-dir", default=".", help="where --plot writes its PNGs")
    parser.add_argument(
        "--table", metavar="FILE", help="with --plot, also write every point as a Markdown table"
    )
    args = parser.parse_args(argv)
    if args.table and not args.plot:
        parser.error("--table goes with --plot GRID.json ... (the files it tabulates)")
    if args.plot:
        points = read_points(args.plot)
        for path in plot(points, Path(args.plot_dir)):
            print(f"wrote {path}")
        if args.table:
            Path(args.table).write_text(raw_table(points))
            print(f"wrote {args.table}")
        return
    if not args.output:
        parser.error("give --output GRID.json (or --plot GRID.json ...)")
    if not torch.cuda.is_available():
        sys.exit(
            "bench_layer_grid.py times layers on a CUDA GPU and this machine has none (--plot works anywhere)"
        )
    result = run_grid(args)
    if result is not None:
        layer_map.write(result, args.output)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
