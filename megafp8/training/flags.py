"""The trainer's flags: Megatron-LM's names with their types, defaults and help (`build_parser`),
and a --config YAML file's keys turned into the same flags (`yaml_tokens`), so that argparse checks
both alike. `arguments.parse_args` puts them together; errors raise ArgumentsError."""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

from megafp8.data.tokenizers import TOKENIZER_TYPES
from megafp8.models.config import PRESETS
from megafp8.parallel.data_parallel import DEFAULT_BUCKET_SIZE
from megafp8.parallel.stages import half_layers
from megafp8.symmetric_memory import DEFAULT_SM_CARVEOUT

# Every lean optimizer state at once (docs/training.md): what the planner's
# --lean-optimizer-states plans with
LEAN_OPTIMIZER_STATES = (
    "--exp-avg-dtype",
    "bf16",
    "--exp-avg-sq-dtype",
    "bf16",
    "--main-grads-dtype",
    "bf16",
    "--store-param-remainders",
)


class ArgumentsError(ValueError):
    """Flags, a flag combination or a --config file that cannot run; the message says which."""


class _Parser(argparse.ArgumentParser):
    # Raise instead of printing usage and exiting, so callers and tests see the message.
    def error(self, message):
        raise ArgumentsError(message)


def _number(kind, minimum=None, below=None, above=None):
    """An argparse type: `kind` (int or float) with bounds, whose error says the allowed range."""
    parts = [
        f">= {minimum}" if minimum is not None else "",
        f"> {above}" if above is not None else "",
        f"< {below}" if below is not None else "",
    ]
    wanted = f"{'an integer' if kind is int else 'a number'} {' and '.join(p for p in parts if p)}".strip()

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if (
            (minimum is not None and value < minimum)
            or (above is not None and value <= above)
            or (below is not None and value >= below)
        ):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


_POSITIVE = _number(int, minimum=1)
_NON_NEGATIVE = _number(int, minimum=0)
_PROBABILITY = _number(float, minimum=0.0, below=1.0)  # dropout, Adam betas


def _layer_count(text):
    """A pipeline stage's layers: a positive multiple of 0.5 (a stage may end after a layer's
    attention), an int where whole."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if not half_layers(value):
        raise argparse.ArgumentTypeError(
            f"expected a positive number of layers, whole or ending in .5 (a stage may end after a "
            f"layer's attention), got {text!r}"
        )
    return int(value) if value % 1 == 0 else value


class _FirstLastLayers(argparse.Action):
    """`--first-last-layers-bf16` alone is Megatron's switch (counts from --num-layers-at-*-in-bf16);
    `--first-last-layers-bf16 N` is megafp8's short form."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, True if value is None else value)


def build_parser() -> argparse.ArgumentParser:
    """The parser with every flag and its default; parse_args adds the checks."""
    p = _Parser(
        prog="megafp8-train",
        allow_abbrev=False,  # an abbreviation would hide a typo
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Pretrain a GPT or Llama model with FP8 (Megatron-LM's flag names).",
    )
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="flags as YAML keys (dashes or underscores); flags on the command line win",
    )

    g = p.add_argument_group(
        "model (a --model preset, or the shape flags; shape flags override the preset)"
    )
    g.add_argument("--model", help=f"preset: {', '.join(PRESETS)}")
    g.add_argument("--num-layers", type=_POSITIVE)
    g.add_argument("--hidden-size", type=_POSITIVE)
    g.add_argument("--num-attention-heads", type=_POSITIVE)
    g.add_argument(
        "--num-query-groups", type=_POSITIVE, help="key/value heads (GQA); default: one per head"
    )
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="accepted for Megatron scripts; --num-query-groups alone turns GQA on",
    )
    g.add_argument("--ffn-hidden-size", type=_POSITIVE, help="default 4 x hidden size")
    g.add_argument("--max-position-embeddings", type=_POSITIVE, help="default: --seq-length")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"))
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"))
    g.add_argument("--norm-epsilon", type=_number(float, above=0.0))
    # None = not given, so a preset's value stays; after parsing these are True/False.
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--disable-bias-linear", action="store_true", default=None)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    g.add_argument("--init-method-std", type=_number(float, above=0.0))
    g.add_argument("--hidden-dropout", type=_PROBABILITY)
    g.add_argument("--attention-dropout", type=_PROBABILITY)
    g.add_argument("--make-vocab-size-divisible-by", type=_POSITIVE)
    g.add_argument("--rotary-base", type=_number(float, above=0.0))

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=_POSITIVE, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=_POSITIVE, default=1)
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=_POSITIVE,
        help="interleaved 1F1B: layers per virtual stage",
    )
    g.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=_POSITIVE,
        help="interleaved 1F1B: virtual stages per pipeline rank (1: not interleaved), the layers of a "
        "rank split evenly among them; or give --num-layers-per-virtual-pipeline-stage",
    )
    g.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=_layer_count,
        help="layers of the first pipeline stage, which also holds the embedding (interleaved: of the "
        "first virtual stage, the first rank's first chunk); the other stages split the rest evenly. "
        "A count ending in .5 ends the stage after a layer's attention, the next begins at its MLP",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=_layer_count,
        help="layers of the last pipeline stage, which also holds the output layer and loss "
        "(interleaved: of the last virtual stage, the last rank's last chunk)",
    )
    g.add_argument(
        "--pipeline-stage-layers",
        type=_layer_count,
        nargs="+",
        metavar="LAYERS",
        help="every virtual pipeline stage's layers, in order: pipeline size x virtual stages per "
        "rank counts adding up to --num-layers (interleaved: virtual stage c x pp + r is rank r's "
        "chunk c); a count ending in .5 ends its stage after a layer's attention",
    )
    g.add_argument(
        "--balance-pipeline-split",
        action="store_true",
        help="give the first and last virtual pipeline stages their own layer counts so that every "
        "pipeline rank has about the same work, the last one's output layer and loss counted at "
        "their estimated cost in layers; a stage may end after a layer's attention where that "
        "evens the ranks further; the split is printed",
    )
    g.add_argument(
        "--overlap-p2p-communication",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pipeline stages post their activations and gradients to each other without waiting: a "
        "forward waits only for the activation it takes, a backward for its gradient, so transfers "
        "run beside the other passes",
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument(
        "--tp-comm-overlap",
        action="store_true",
        help="with --sequence-parallel: the tensor-parallel linears' all-gathers and reduce-scatters run "
        "block by block beside their GEMMs, forward and backward, instead of before or after them",
    )
    g.add_argument(
        "--tp-comm-overlap-transport",
        choices=("auto", "copy-engine", "nccl"),
        default="auto",
        help="how --tp-comm-overlap moves the blocks: copy-engine (symmetric memory over NVLink, no SMs "
        "taken from the GEMMs; GPUs of one node), nccl (NCCL kernels), or auto: copy engines with "
        "--enable-cuda-graph where the GPUs allow, else NCCL",
    )
    g.add_argument(
        "--tp-comm-sm-carveout",
        type=_number(int, minimum=0),
        default=DEFAULT_SM_CARVEOUT,
        help="with --tp-comm-overlap on copy engines: cuBLAS GEMMs leave this many SMs free, where "
        "the transfers' one-block barriers and local copies run beside a GEMM (one that holds "
        "every SM holds them up until it ends); 2 measured best for GPT-1.3B at tp 2 on H200",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=_number(float, above=0.0),
        default=10.0,
        help="how long a rank waits in a collective, or a copy-engine barrier of "
        "--tp-comm-overlap, for the others before the run fails (a rank that died or hangs); "
        "Megatron's default",
    )
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="with --use-distributed-optimizer: the updated parameters' all-gather runs bucket by bucket "
        "beside the next forward, each layer waiting only for its own",
    )
    g.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument(
        "--ddp-bucket-size",
        type=_POSITIVE,
        default=DEFAULT_BUCKET_SIZE,
        help="elements per data-parallel gradient bucket (reduced as soon as it is complete)",
    )
    g.add_argument(
        "--gradient-accumulation-fusion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the linear layers' GEMMs write their weight gradients into the fp32 gradient buffer "
        "(FP8: on a step's first micro-batch; bf16 on a GPU: every one) instead of returning "
        "bf16 gradients for a separate accumulation pass",
    )

    g = p.add_argument_group("batch")
    g.add_argument("--micro-batch-size", type=_POSITIVE)
    g.add_argument(
        "--global-batch-size", type=_POSITIVE, help="default: micro batch size x data-parallel size"
    )
    g.add_argument(
        "--seq-length", type=_POSITIVE, help="default: the model's max position embeddings"
    )

    g = p.add_argument_group("duration and evaluation")
    g.add_argument("--train-iters", type=_POSITIVE)
    g.add_argument("--train-samples", type=_POSITIVE)
    g.add_argument("--eval-interval", type=_POSITIVE, default=1000)
    g.add_argument("--eval-iters", type=_NON_NEGATIVE, default=100, help="0: no evaluation")

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--lr", type=_number(float, minimum=0.0))
    g.add_argument("--min-lr", type=_number(float, minimum=0.0), default=0.0)
    g.add_argument("--lr-warmup-iters", type=_NON_NEGATIVE, default=0)
    g.add_argument(
        "--lr-warmup-fraction",
        type=_number(float, minimum=0.0, below=1.0),
        help="warmup as a fraction of --lr-decay-iters",
    )
    g.add_argument("--lr-decay-iters", type=_POSITIVE, help="default: the training iterations")
    g.add_argument(
        "--lr-decay-style", choices=("constant", "linear", "cosine", "wsd"), default="linear"
    )
    g.add_argument(
        "--lr-wsd-decay-iters",
        type=_POSITIVE,
        help="wsd: the final decay phase, the last iterations of --lr-decay-iters",
    )
    g.add_argument(
        "--lr-wsd-decay-style",
        choices=("linear", "cosine", "exponential", "minus_sqrt"),
        default="exponential",
    )
    g.add_argument("--weight-decay", type=_number(float, minimum=0.0), default=0.01)
    g.add_argument("--adam-beta1", type=_PROBABILITY, default=0.9)
    g.add_argument("--adam-beta2", type=_PROBABILITY, default=0.999)
    g.add_argument("--adam-eps", type=_number(float, above=0.0), default=1e-8)
    g.add_argument(
        "--clip-grad", type=_number(float, minimum=0.0), default=1.0, help="0: no clipping"
    )
    g.add_argument(
        "--exp-avg-dtype",
        choices=("fp32", "bf16", "fp8"),
        default="fp32",
        help="Adam's first moment (Megatron's precision-aware optimizer): bf16 keeps 2 bytes a "
        "parameter instead of 4, updated in fp32 and rounded to nearest; fp8, E4M3 with a "
        "power-of-two scale per 128 elements, 1.03 (MS-AMP's; fused optimizer pass: a CUDA GPU "
        "with triton)",
    )
    g.add_argument(
        "--exp-avg-sq-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="Adam's second moment, as --exp-avg-dtype (not fp8: E4M3's range within a block "
        "cannot hold squared gradients)",
    )
    g.add_argument(
        "--main-grads-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="the gradient buffer: bf16 halves it and the data-parallel reduction's bytes, and "
        "accumulates micro-batches and sums data-parallel ranks in bf16 (Megatron's "
        "--accumulate-allreduce-grads-in-fp32 off; fused optimizer pass)",
    )
    g.add_argument(
        "--store-param-remainders",
        action="store_true",
        help="with --bf16: the fp32 master weight is the bf16 parameter plus a 16-bit remainder "
        "(exact, 2 bytes a parameter instead of 4; Transformer Engine's FusedAdam option); the "
        "parameter is the master rounded half away from zero (fused optimizer pass)",
    )

    g = p.add_argument_group("precision")
    g.add_argument(
        "--bf16", action="store_true", help="bf16 parameters (fp32 master weights); default fp32"
    )
    g.add_argument("--fp16", action="store_true", help="not supported: use --bf16")
    g.add_argument("--fp8-format", choices=("hybrid", "e4m3"), help="turns FP8 on; absent: no FP8")
    g.add_argument(
        "--fp8-recipe",
        choices=("delayed", "current", "tensorwise", "rowwise", "blockwise"),
        default="delayed",
        help="tensorwise is Megatron's name for current scaling; rowwise: a scale per row of each "
        "GEMM operand (torchao's rowwise); blockwise: per 1x128 block of activations and "
        "gradients and 128x128 block of weights (DeepSeek-V3's; its GEMMs emulated for now). "
        "docs/fp8.md; neither's casts are fused yet",
    )
    g.add_argument("--fp8-margin", type=_NON_NEGATIVE, default=0)
    g.add_argument("--fp8-interval", type=_POSITIVE, default=1)
    g.add_argument("--fp8-amax-history-len", type=_POSITIVE, default=1)
    g.add_argument("--fp8-amax-compute-algo", choices=("max", "most_recent"), default="most_recent")
    g.add_argument(
        "--no-fp8-wgrad", action="store_true", help="weight-gradient GEMM in high precision"
    )
    g.add_argument(
        "--fp8-neighbour-fusion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compute neighbours in the FP8 casts: under delayed scaling the norms before the QKV "
        "and fc1 GEMMs and the MLP activation in those GEMMs' input casts, the activation's "
        "backward in fc1's gradient cast (Transformer Engine's LayerNormLinear / LayerNormMLP); "
        "under fine-grained scaling the activations the recipe fuses (blockwise: SwiGLU) and "
        "QKV's gradient cast reading q, k and v's gradients in place",
    )
    g.add_argument(
        "--fp8-primary-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="hold the FP8 linears' weights only in FP8 (E4M3 and its transpose, written from the "
        "fp32 master by the optimizer with the delayed scale): no bf16 copy, 2 bytes a parameter "
        "less (Transformer Engine's fp8_model_init); with --use-distributed-optimizer the "
        "parameter all-gather moves those weights in FP8. Default: on under delayed scaling "
        "wherever it applies (fp32 masters: not with --store-param-remainders, --exp-avg-dtype "
        "fp8, --fp8-check-interval, --no-gradient-accumulation-fusion or --torch-compile), but "
        "with --use-distributed-optimizer only when asked for",
    )
    g.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help="Megatron's name for --fp8-primary-weights with --use-distributed-optimizer: the "
        "FP8 linears' weights held and all-gathered in FP8",
    )
    g.add_argument("--fp8-output-layer", action="store_true", help="the output layer in FP8 too")
    g.add_argument(
        "--first-last-layers-bf16",
        action=_FirstLastLayers,
        nargs="?",
        type=_NON_NEGATIVE,
        default=0,
        metavar="N",
        help="keep the first and last N layers out of FP8",
    )
    g.add_argument("--num-layers-at-start-in-bf16", type=_NON_NEGATIVE)
    g.add_argument("--num-layers-at-end-in-bf16", type=_NON_NEGATIVE)
    g.add_argument(
        "--fp8-check-interval",
        type=_NON_NEGATIVE,
        default=0,
        metavar="N",
        help="the bf16 sentinel: every N iterations evaluate held-out micro-batches with FP8 on and "
        "off, and train in bf16 for a while when FP8's loss strays (0: off)",
    )
    g.add_argument(
        "--fp8-check-iters",
        type=_POSITIVE,
        default=1,
        help="global batches of validation data per check (the same ones every time)",
    )
    g.add_argument(
        "--fp8-check-tolerance",
        type=_number(float, above=0.0),
        default=0.02,
        help="how far FP8's check loss may exceed bf16's, relative, before the run falls back",
    )
    g.add_argument(
        "--fp8-fallback-iters",
        type=_POSITIVE,
        default=100,
        help="iterations trained in bf16 after a failed check, before FP8 returns (scales re-seeded)",
    )
    g.add_argument(
        "--fp8-max-fallbacks",
        type=_POSITIVE,
        default=3,
        help="fallbacks in a row (FP8 failing again within an interval of its return) after which "
        "the run stays in bf16",
    )

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ...")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights")
    for split in ("train", "valid", "test"):
        g.add_argument(
            f"--{split}-data-path",
            nargs="*",
            help=f"the {split} split's own PREFIX (or W1 PREFIX1 ...), all of its documents: with "
            "--train/valid/test-data-path instead of --data-path and --split",
        )
    g.add_argument("--data-cache-path")
    g.add_argument("--mock-data", action="store_true", help="synthetic random tokens, no files")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--vocab-size", type=_number(int, minimum=2))
    g.add_argument("--eod-token", help="end-of-document token, when the tokenizer's is not found")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--num-workers", type=_NON_NEGATIVE, default=2)

    g = p.add_argument_group("checkpointing")
    g.add_argument(
        "--save",
        help="checkpoint folder; one holding another run's checkpoints is refused "
        "(resume it with --load of the same folder, or see --overwrite-save)",
    )
    g.add_argument(
        "--load",
        help="resume from this checkpoint folder (or one iter_N checkpoint); a folder "
        "that does not exist is an error unless it is also --save",
    )
    g.add_argument(
        "--overwrite-save",
        action="store_true",
        help="let this new run replace the checkpoints already in --save (they are deleted once "
        "its first checkpoint is written)",
    )
    g.add_argument("--save-interval", type=_POSITIVE)
    g.add_argument(
        "--keep-last-checkpoints",
        type=_POSITIVE,
        metavar="N",
        help="after each save, delete this run's older checkpoints in --save but the newest N "
        "(torchtitan's keep_latest_k; default: keep all)",
    )
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument(
        "--finetune", action="store_true", help="load weights only; iteration starts at 0"
    )
    g.add_argument("--exit-interval", type=_POSITIVE)
    g.add_argument("--exit-duration-in-mins", type=_number(float, above=0.0))

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=_POSITIVE, default=100)
    g.add_argument("--tensorboard-dir")
    g.add_argument(
        "--wandb-project", help="log to Weights & Biases in this project (pip install wandb)"
    )
    g.add_argument("--wandb-exp-name", help="the W&B run's name")
    g.add_argument(
        "--wandb-save-dir", help="where wandb keeps its local files (default: <run dir>/wandb)"
    )
    g.add_argument(
        "--log-throughput", action="store_true", help="print TFLOP/s per GPU in the log line"
    )
    g.add_argument(
        "--log-fp8-layers",
        action="store_true",
        help="with FP8, also write each layer's scales and saturated and underflowed fractions, per "
        "role, to metrics.jsonl at every log step (fp8_layers, gathered over all ranks)",
    )
    g.add_argument(
        "--profile",
        action="store_true",
        help="profile steps --profile-step-start..--profile-step-end on --profile-ranks: "
        "torch.profiler with --use-pytorch-profiler, else a CUDA profiler range for nsys",
    )
    g.add_argument("--use-pytorch-profiler", action="store_true")
    g.add_argument("--profile-step-start", type=_NON_NEGATIVE, default=10)
    g.add_argument("--profile-step-end", type=_POSITIVE, default=12)
    g.add_argument("--profile-ranks", type=_NON_NEGATIVE, nargs="+", default=[0])

    g = p.add_argument_group("run")
    g.add_argument("--seed", type=_NON_NEGATIVE, default=1234)
    g.add_argument(
        "--data-seed",
        type=_NON_NEGATIVE,
        help="seed of the data order (the datasets' shuffles and the loader's workers); default "
        "--seed. Another --seed with the same --data-seed changes only the initialisation and "
        "dropout: the run-to-run spread a numerics change is measured against",
    )
    g.add_argument(
        "--recompute-granularity", choices=("full", "selective"), help="absent: no recomputation"
    )
    g.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        help="full recomputation: uniform = layers in groups of --recompute-num-layers, each group's "
        "input kept; block = only the first --recompute-num-layers layers of each pipeline "
        "stage (default uniform)",
    )
    g.add_argument("--recompute-num-layers", type=_POSITIVE, help="default 1")
    g.add_argument(
        "--torch-compile",
        action="store_true",
        help="torch.compile each transformer layer (the FP8 linears stay eager); the first steps "
        "compile",
    )
    g.add_argument(
        "--enable-cuda-graph",
        action="store_true",
        help="replay each transformer layer's forward and backward as CUDA graphs, captured after "
        "--cuda-graph-warmup-steps eager steps (FP8 included): the host launches a layer at once",
    )
    g.add_argument(
        "--cuda-graph-scope",
        choices=("full",),
        default="full",
        help="what one graph holds: full = a whole transformer layer (a group recomputed together "
        "under --recompute-granularity full)",
    )
    g.add_argument(
        "--cuda-graph-warmup-steps",
        type=_POSITIVE,
        default=3,
        help="eager steps before the capture (at least 1: delayed scaling needs a history)",
    )
    g.add_argument(
        "--skip-nonfinite-steps-max",
        type=_POSITIVE,
        default=10,
        help="abort after this many optimizer steps in a row skipped for inf/NaN gradients",
    )
    return p


# ---- what parse_args reads: the flags given, a YAML file's keys ----------------------------------


def given_only(parser):
    """The same parser, but a namespace holds only the flags actually given."""
    # not set_defaults: it would put the marker itself in the namespace
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return parser


def reject_unknown(parser, extras) -> None:
    flags = [token.split("=", 1)[0] for token in extras if token.startswith("-")]
    if not flags:
        raise ArgumentsError(f"unexpected argument {extras[0]!r}: every value follows its flag")
    known = list(parser._option_string_actions)
    hints = []
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=1)
        hints.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
    raise ArgumentsError(
        f"unknown flag{'s' if len(flags) > 1 else ''} {', '.join(hints)}; see --help for the flags"
    )


def yaml_tokens(path, parser) -> list:
    """The YAML file as command-line tokens, so argparse types, choices and actions apply to it."""
    try:
        import yaml
    except ImportError:
        raise ArgumentsError("--config needs PyYAML: pip install pyyaml") from None
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise ArgumentsError(f"--config {path}: cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise ArgumentsError(f"--config {path}: not valid YAML: {error}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ArgumentsError(
            f"--config {path}: expected a mapping of flag names to values, "
            f"got a {type(data).__name__}"
        )
    actions = parser._option_string_actions
    tokens = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if flag == "--config":
            raise ArgumentsError(
                f"--config {path}: config files do not nest; remove the key {key!r}"
            )
        if flag not in actions:
            close = difflib.get_close_matches(flag, list(actions), n=1)
            raise ArgumentsError(
                f"--config {path}: unknown key {key!r}"
                + (f" (did you mean {close[0].lstrip('-')}?)" if close else "")
            )
        if value is None:  # `key:` with no value means "leave the default"
            continue
        action = actions[flag]
        if action.nargs == 0 or (action.nargs == "?" and isinstance(value, bool)):
            if not isinstance(value, bool):
                raise ArgumentsError(
                    f"--config {path}: {key} is a switch; give true or false, not {value!r}"
                )
            if isinstance(action, argparse.BooleanOptionalAction):  # false is the --no- form
                flag = next(s for s in action.option_strings if (s == flag) == value)
            elif not value:
                continue
            tokens.append(flag)
        elif action.nargs == "*":
            items = value.split() if isinstance(value, str) else value
            if not isinstance(items, list):
                raise ArgumentsError(f"--config {path}: {key} takes a list, got {value!r}")
            tokens += [flag, *map(str, items)]
        elif isinstance(value, (list, dict)):
            raise ArgumentsError(f"--config {path}: {key} takes one value, got {value!r}")
        else:
            tokens.append(f"{flag}={value}")  # '=' keeps values such as -1 from looking like flags
    return tokens


def flag_names(*dests) -> str:
    """How a message names the flags of some dests: '--seq-length and --max-position-embeddings'."""
    return " and ".join("--" + d.replace("_", "-") for d in dests)
