"""Command-line arguments: Megatron-LM's flag names, one namespace, checked at start-up.

    args = parse_args()                  # flags and --config file.yaml; every check that needs no world size
    validate_args(args, world_size)      # parallel layout, batch sizes, iteration counts
    _, saved = checkpointing.latest_model_config(args.load) or (None, None)  # the --load checkpoint's model
    config = model_config(args, tokenizer.vocab_size, saved)
    recipe = fp8_recipe(args)            # None without --fp8-format

A --load checkpoint that records its model (megafp8.json's "model") is the model: shape flags and
--model may be left out, and one that contradicts it is an error.

Each flag's dest is its name with underscores (`--fp8-format` -> `args.fp8_format`). Errors raise
ArgumentsError (a ValueError) whose message names the flags involved and what to give instead.
docs/training.md lists the flags and where they differ from Megatron-LM's.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import os
import re
import warnings
from pathlib import Path

import torch

from megafp8.data.gpt_dataset import parse_split
from megafp8.data.tokenizers import TOKENIZER_TYPES
from megafp8.fp8.formats import Format
from megafp8.fp8.recipe import CurrentScaling, DelayedScaling, OverrideLinearPrecision
from megafp8.messages import check_integer
from megafp8.models.config import PRESETS, TransformerConfig
from megafp8.parallel.data_parallel import DEFAULT_BUCKET_SIZE
from megafp8.training import checkpointing


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
        type=_POSITIVE,
        help="layers of the first pipeline stage, which also holds the embedding (interleaved: of the "
        "first virtual stage, the first rank's first chunk); the other stages split the rest evenly",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=_POSITIVE,
        help="layers of the last pipeline stage, which also holds the output layer and loss "
        "(interleaved: of the last virtual stage, the last rank's last chunk)",
    )
    g.add_argument(
        "--balance-pipeline-split",
        action="store_true",
        help="give the first and last virtual pipeline stages their own layer counts so that every "
        "pipeline rank has about the same work, the last one's output layer and loss counted at "
        "their FLOPs in layers (at FP8's speed-up where the layers run FP8); the split is printed",
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
        "--distributed-timeout-minutes",
        type=_number(float, above=0.0),
        default=10.0,
        help="how long a rank waits in a collective for the others before the run fails (a rank "
        "that died or hangs); Megatron's default",
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

    g = p.add_argument_group("precision")
    g.add_argument(
        "--bf16", action="store_true", help="bf16 parameters (fp32 master weights); default fp32"
    )
    g.add_argument("--fp16", action="store_true", help="not supported: use --bf16")
    g.add_argument("--fp8-format", choices=("hybrid", "e4m3"), help="turns FP8 on; absent: no FP8")
    g.add_argument(
        "--fp8-recipe",
        choices=("delayed", "current", "tensorwise"),
        default="delayed",
        help="tensorwise is Megatron's name for current scaling",
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
        help="under delayed FP8 scaling, fuse the norms before the QKV and fc1 GEMMs and the MLP "
        "activation into those GEMMs' FP8 input casts, and the activation's backward into fc1's "
        "gradient cast (Transformer Engine's LayerNormLinear / LayerNormMLP)",
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


# ---- parsing: the YAML file first, then the command line over it -------------------------------


def _given_only(parser):
    """The same parser, but a namespace holds only the flags actually given."""
    # not set_defaults: it would put the marker itself in the namespace
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return parser


def _reject_unknown(parser, extras) -> None:
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


def _yaml_tokens(path, parser) -> list:
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


def parse_args(argv=None) -> argparse.Namespace:
    """Flags (argv, default sys.argv[1:]) over an optional --config YAML file, resolved against
    the --model preset and checked; raises ArgumentsError naming the flags at fault."""
    probe = _given_only(build_parser())
    explicit, extras = probe.parse_known_args(argv)
    if extras:
        _reject_unknown(probe, extras)
    from_file = {}
    if getattr(explicit, "config", None):
        tokens = _yaml_tokens(explicit.config, probe)
        try:
            from_file = vars(_given_only(build_parser()).parse_args(tokens))
        except ArgumentsError as error:  # a bad value: say which file it came from
            raise ArgumentsError(f"--config {explicit.config}: {error}") from None
    parser = build_parser()
    parser.set_defaults(**from_file)
    args = parser.parse_args(argv)
    _check_and_resolve(args, given=set(vars(explicit)) | set(from_file))
    return args


# ---- checks that need no world size -------------------------------------------------------------


def _flags(*dests) -> str:
    return " and ".join("--" + d.replace("_", "-") for d in dests)


def _apply(stray) -> str:
    return "applies" if len(stray) == 1 else "apply"


# (flag dest, TransformerConfig field, flag value -> field value, field value -> flag value)
_SHAPE = [
    ("num_layers", "num_layers", None, None),
    ("hidden_size", "hidden_size", None, None),
    ("num_attention_heads", "num_attention_heads", None, None),
    ("num_query_groups", "num_kv_heads", None, None),
    ("ffn_hidden_size", "ffn_hidden_size", None, None),
    ("max_position_embeddings", "max_position_embeddings", None, None),
    (
        "position_embedding_type",
        "position_embedding",
        {"learned_absolute": "learned", "rope": "rope"}.get,
        {"learned": "learned_absolute", "rope": "rope"}.get,
    ),
    (
        "normalization",
        "normalization",
        {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}.get,
        {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get,
    ),
    ("norm_epsilon", "norm_epsilon", None, None),
    ("swiglu", "activation", None, lambda activation: activation == "swiglu"),
    ("disable_bias_linear", "bias", lambda flag: not flag, lambda bias: not bias),
    (
        "untie_embeddings_and_output_weights",
        "tie_embeddings",
        lambda flag: not flag,
        lambda tied: not tied,
    ),
    ("init_method_std", "init_method_std", None, None),
    ("hidden_dropout", "hidden_dropout", None, None),
    ("attention_dropout", "attention_dropout", None, None),
    ("make_vocab_size_divisible_by", "make_vocab_size_divisible_by", None, None),
    ("rotary_base", "rope_theta", None, None),
]
# TransformerConfig's error messages name fields; say which flag sets each.
_FIELD_FLAGS = {field: "--" + dest.replace("_", "-") for dest, field, _, _ in _SHAPE}
_FIELD_FLAGS.update(
    kv_heads="--num-query-groups",
    ffn_size="--ffn-hidden-size",
    head_dim="--hidden-size / --num-attention-heads",
    tp_size="--tensor-model-parallel-size",
)


# Fields a run may set otherwise than the checkpoint it loads, since no weight depends on them:
# the vocabulary is the tokenizer's (the trainer checks it against the checkpoint's), dropout is
# a training choice. (RoPE's position range too: its tables are computed, see _check_saved_model.)
_FREE_FIELDS = ("vocab_size", "hidden_dropout", "attention_dropout")
_SWITCHES = ("swiglu", "disable_bias_linear", "untie_embeddings_and_output_weights")


def _sizes(fields: dict, field: str):
    """A field's value with the defaulted sizes spelled out (None key/value heads = one per head)."""
    if field == "num_kv_heads":
        return fields[field] or fields["num_attention_heads"]
    if field == "ffn_hidden_size":
        return fields[field] or 4 * fields["hidden_size"]
    return fields[field]


def _shown(value) -> str:
    return str(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)


def _check_saved_model(args, saved: TransformerConfig, checkpoint) -> None:
    """The shape flags given and the --model preset must describe the model the --load checkpoint
    recorded (they may be left out: that model is the base); a contradiction is an error naming
    both values, since the weights loaded have the checkpoint's shape."""
    names = [f.name for f in dataclasses.fields(TransformerConfig)]
    have = {name: getattr(saved, name) for name in names}
    asked, source = dict(have), {}
    if args.model is not None:
        for name in names:
            asked[name], source[name] = getattr(PRESETS[args.model], name), None
    for dest, field, to_field, _ in _SHAPE:
        value = getattr(args, dest)
        if value is not None:  # given: the switches are only ever True here
            asked[field] = "swiglu" if dest == "swiglu" else to_field(value) if to_field else value
            source[field] = _flags(dest) if dest in _SWITCHES else f"{_flags(dest)} {value}"
    free = _FREE_FIELDS + (
        ("max_position_embeddings",) if saved.position_embedding == "rope" else ()
    )
    wrong = [
        name for name in source if name not in free and _sizes(asked, name) != _sizes(have, name)
    ]
    if not wrong:
        return
    flags = [source[name] for name in wrong if source[name] is not None]
    from_preset = [name for name in wrong if source[name] is None]
    if from_preset:
        flags.append(
            f"--model {args.model} ({', '.join(f'{n} {_shown(_sizes(asked, n))}' for n in from_preset)})"
        )
    theirs = ", ".join(f"{name} {_shown(_sizes(have, name))}" for name in wrong)
    one = len(flags) == 1
    said = flags[0] if one else f"{', '.join(flags[:-1])} and {flags[-1]}"
    raise ArgumentsError(
        f"{said} {'contradicts' if one else 'contradict'} the checkpoint's model in {checkpoint} ({theirs}): "
        f"drop {'it' if one else 'them'} to train on the saved model, or --save to a new folder without "
        f"--load {args.load} to train another"
    )


def _resolve_model(args, given) -> TransformerConfig | None:
    """Fill the shape flags not given from the model the --load checkpoint recorded, else from
    the --model preset (or TransformerConfig's defaults), so that args alone describe the model.
    Returns the checkpoint's model config (None without one)."""
    if args.model is not None and args.model not in PRESETS:
        close = difflib.get_close_matches(args.model, list(PRESETS), n=1)
        raise ArgumentsError(
            f"--model {args.model!r} is not a preset"
            + (f" (did you mean {close[0]}?)" if close else "")
            + f"; presets: {', '.join(PRESETS)}"
        )
    # A first run of `--save X --load X` finds no checkpoint: then the flags describe the model.
    checkpoint, saved = checkpointing.latest_model_config(args.load) or (None, None)
    if saved is not None:
        _check_saved_model(args, saved, checkpoint)
        base = {f.name: getattr(saved, f.name) for f in dataclasses.fields(TransformerConfig)}
    elif args.model is not None:
        base = {
            f.name: getattr(PRESETS[args.model], f.name)
            for f in dataclasses.fields(TransformerConfig)
        }
    else:
        base = {
            f.name: f.default
            for f in dataclasses.fields(TransformerConfig)
            if f.default is not dataclasses.MISSING
        }
        missing = [
            d
            for d in ("num_layers", "hidden_size", "num_attention_heads")
            if getattr(args, d) is None
        ]
        if missing:
            raise ArgumentsError(
                f"no model: give --model (one of {', '.join(PRESETS)}) or the shape "
                f"flags; missing {', '.join(_flags(d) for d in missing)}"
            )
    for dest, field, _, from_field in _SHAPE:
        if getattr(args, dest) is None and field in base:
            value = base[field]
            setattr(args, dest, from_field(value) if from_field and value is not None else value)

    if args.seq_length is None:
        if args.max_position_embeddings is None:
            raise ArgumentsError("no sequence length: give --seq-length")
        args.seq_length = args.max_position_embeddings
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if (
        args.position_embedding_type == "learned_absolute"
        and args.seq_length > args.max_position_embeddings
    ):
        source = (
            ""
            if "max_position_embeddings" in given
            else f" (the checkpoint's model in {checkpoint})"
            if saved is not None
            else f" (from --model {args.model})"
            if args.model
            else ""
        )
        raise ArgumentsError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}{source}: learned positions have no row past it; lower --seq-length"
            + ("" if saved is not None else " or raise --max-position-embeddings")
        )
    if args.group_query_attention and args.num_query_groups is None:
        raise ArgumentsError(
            "--group-query-attention needs --num-query-groups (the number of key/value heads)"
        )

    try:  # the shape's own rules (heads divide hidden, tp divides heads ...), before any GPU is touched
        model_config(args, 2, saved).validate_tensor_parallel(args.tensor_model_parallel_size)
    except ValueError as error:
        message = str(error)
        named = [
            f"{field} is {flag}"
            for field, flag in _FIELD_FLAGS.items()
            if re.search(rf"\b{field}\b", message)
        ]
        preset_note = (
            f" (the checkpoint's model in {checkpoint})"
            if saved is not None
            else f" (--model {args.model})"
            if args.model
            else ""
        )
        raise ArgumentsError(
            f"invalid model shape{preset_note}: {message}"
            + (f" [{'; '.join(named)}]" if named else "")
        ) from None
    return saved


def _check_pipeline(args) -> None:
    pp, vpp_layers = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    stages = args.num_virtual_stages_per_pipeline_rank
    uneven = first is not None or last is not None
    if stages is not None and vpp_layers is not None:
        raise ArgumentsError(
            "--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage "
            "say the same thing; give one"
        )
    if args.balance_pipeline_split and uneven:
        raise ArgumentsError(
            "--balance-pipeline-split chooses the first and last stages' layers itself; give it or "
            "--decoder-first/last-pipeline-num-layers, not both"
        )
    if pp == 1:
        for flag, value in (
            (f"--num-virtual-stages-per-pipeline-rank {stages}", (stages or 1) > 1),
            (f"--num-layers-per-virtual-pipeline-stage {vpp_layers}", vpp_layers is not None),
            ("--decoder-first/last-pipeline-num-layers", uneven),
            ("--balance-pipeline-split", args.balance_pipeline_split),
        ):
            if value:
                raise ArgumentsError(f"{flag} needs --pipeline-model-parallel-size > 1")
    args.virtual_pipeline_model_parallel_size = None
    if uneven or args.balance_pipeline_split:
        if vpp_layers is not None:
            raise ArgumentsError(
                "with stages of their own sizes (--decoder-first/last-pipeline-num-layers, "
                "--balance-pipeline-split) virtual stages differ in layers: give their number per "
                "rank, --num-virtual-stages-per-pipeline-rank, not "
                "--num-layers-per-virtual-pipeline-stage"
            )
        vpp = stages or 1
        from megafp8.parallel.stages import balanced_stage_split, stage_layers

        try:  # the split the trainer will make (or, balanced, that one exists), before any process starts
            if uneven:
                stage_layers(args.num_layers, pp, 0, vpp, first, last)
            else:
                balanced_stage_split(args.num_layers, pp, vpp)
        except ValueError as error:
            flags = (
                "--decoder-first/last-pipeline-num-layers" if uneven else "--balance-pipeline-split"
            )
            raise ArgumentsError(f"{flags}: {error}") from None
        if vpp > 1:
            args.virtual_pipeline_model_parallel_size = vpp
        return _check_sequence_parallel(args)
    if stages is not None and stages > 1:
        per_rank = args.num_layers // pp
        if args.num_layers % pp == 0 and per_rank % stages:
            raise ArgumentsError(
                f"--num-layers {args.num_layers} / --pipeline-model-parallel-size {pp} = {per_rank} "
                f"layers per rank do not split into --num-virtual-stages-per-pipeline-rank "
                f"{stages} equal virtual stages; give a divisor of {per_rank} (1: not interleaved), "
                "or --balance-pipeline-split"
            )
        vpp_layers = args.num_layers_per_virtual_pipeline_stage = per_rank // stages
    if args.num_layers % pp:
        raise ArgumentsError(
            f"--num-layers {args.num_layers} is not divisible by "
            f"--pipeline-model-parallel-size {pp}; give --decoder-first/last-pipeline-num-layers "
            "or --balance-pipeline-split to size the first and last stages apart"
        )
    if vpp_layers is not None:
        if (args.num_layers // pp) % vpp_layers:
            raise ArgumentsError(
                f"--num-layers {args.num_layers} / --pipeline-model-parallel-size {pp} = "
                f"{args.num_layers // pp} layers per stage is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage {vpp_layers}"
            )
        args.virtual_pipeline_model_parallel_size = args.num_layers // pp // vpp_layers
    _check_sequence_parallel(args)


def _check_sequence_parallel(args) -> None:
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and tp == 1:
        # Megatron's behaviour: nothing to shard, so not an error.
        warnings.warn(
            "--sequence-parallel has no effect with --tensor-model-parallel-size 1; turned off",
            stacklevel=4,
        )
        args.sequence_parallel = False
    if args.tp_comm_overlap and not args.sequence_parallel:
        raise ArgumentsError(
            "--tp-comm-overlap overlaps the sequence-parallel collectives with the GEMMs: give "
            "--sequence-parallel too (with --tensor-model-parallel-size > 1)"
        )
    if args.tp_comm_overlap_transport != "auto" and not args.tp_comm_overlap:
        raise ArgumentsError(
            f"--tp-comm-overlap-transport {args.tp_comm_overlap_transport} chooses how "
            "--tp-comm-overlap moves its blocks: give --tp-comm-overlap too"
        )
    if args.sequence_parallel and args.seq_length % tp:
        raise ArgumentsError(
            f"--sequence-parallel splits the sequence over the tensor-parallel ranks: "
            f"--seq-length {args.seq_length} must be divisible by "
            f"--tensor-model-parallel-size {tp}"
        )


def _check_schedule(args, given) -> None:
    if (args.train_iters is None) == (args.train_samples is None):
        both = args.train_iters is not None
        raise ArgumentsError(
            f"--train-iters and --train-samples: give exactly one, not "
            f"{'both' if both else 'neither'}"
        )
    if args.micro_batch_size is None:
        raise ArgumentsError(
            "no batch size: give --micro-batch-size (and --global-batch-size, default "
            "micro batch size x data-parallel size)"
        )
    if args.lr is None:
        raise ArgumentsError("no learning rate: give --lr (e.g. --lr 3e-4)")
    if args.min_lr > args.lr:
        raise ArgumentsError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if {"lr_warmup_iters", "lr_warmup_fraction"} <= given:
        raise ArgumentsError("--lr-warmup-iters and --lr-warmup-fraction are both given; give one")
    if args.lr_decay_style == "wsd":
        if args.lr_wsd_decay_iters is None:
            raise ArgumentsError(
                "--lr-decay-style wsd needs --lr-wsd-decay-iters (the length of the final decay)"
            )
    else:
        stray = [d for d in ("lr_wsd_decay_iters", "lr_wsd_decay_style") if d in given]
        if stray:
            raise ArgumentsError(
                f"{_flags(*stray)} {_apply(stray)} only with --lr-decay-style wsd "
                f"(it is {args.lr_decay_style})"
            )


_FP8_KNOBS = (
    "fp8_recipe",
    "fp8_margin",
    "fp8_interval",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "no_fp8_wgrad",
    "fp8_output_layer",
    "first_last_layers_bf16",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
    "fp8_check_interval",
    "log_fp8_layers",
)
_SENTINEL = ("fp8_check_iters", "fp8_check_tolerance", "fp8_fallback_iters", "fp8_max_fallbacks")
_DELAYED_ONLY = ("fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo", "no_fp8_wgrad")


def _check_precision(args, given) -> None:
    args.params_dtype = "bfloat16" if args.bf16 else "float32"
    if args.fp8_recipe == "tensorwise":
        args.fp8_recipe = "current"
    if args.fp8_format is None:
        stray = [d for d in _FP8_KNOBS + _SENTINEL if d in given]
        if stray:
            raise ArgumentsError(
                f"{', '.join(_flags(d) for d in stray)} given without --fp8-format; "
                "add --fp8-format hybrid (or e4m3) to train in FP8, or drop them"
            )
        args.first_last_layers_bf16 = 0
        args.num_layers_at_start_in_bf16 = args.num_layers_at_end_in_bf16 = 0
        return
    stray = [d for d in _SENTINEL if d in given]
    if stray and not args.fp8_check_interval:
        raise ArgumentsError(
            f"{', '.join(_flags(d) for d in stray)} {_apply(stray)} only to the bf16 sentinel: "
            "add --fp8-check-interval N (a check every N iterations), or drop them"
        )
    if args.fp8_recipe == "current":
        stray = [d for d in _DELAYED_ONLY if d in given]
        if stray:
            raise ArgumentsError(
                f"{', '.join(_flags(d) for d in stray)} {_apply(stray)} only to --fp8-recipe delayed; "
                "current scaling keeps no amax history and runs every GEMM in FP8"
            )

    # The model keeps the same N layers at each end; Megatron's start/end counts must agree.
    n, start, end = (
        args.first_last_layers_bf16,
        args.num_layers_at_start_in_bf16,
        args.num_layers_at_end_in_bf16,
    )
    if n is True:  # Megatron's switch: counts default to 1 each
        start, end = (1 if start is None else start), (1 if end is None else end)
        if start != end:
            raise ArgumentsError(
                f"--num-layers-at-start-in-bf16 {start} and --num-layers-at-end-in-bf16 {end} differ; "
                "megafp8 keeps the same number of layers at each end: give equal counts"
            )
        n = start
    elif n == 0 and (start is not None or end is not None):
        raise ArgumentsError(
            "--num-layers-at-start-in-bf16/--num-layers-at-end-in-bf16 need "
            "--first-last-layers-bf16"
        )
    elif any(count is not None and count != n for count in (start, end)):
        raise ArgumentsError(
            f"--first-last-layers-bf16 {n} disagrees with --num-layers-at-start-in-bf16/"
            "--num-layers-at-end-in-bf16; give one or the other"
        )
    if 2 * n > args.num_layers:
        raise ArgumentsError(
            f"--first-last-layers-bf16 {n} keeps {2 * n} layers out of FP8, "
            f"more than --num-layers {args.num_layers}"
        )
    args.first_last_layers_bf16 = args.num_layers_at_start_in_bf16 = (
        args.num_layers_at_end_in_bf16
    ) = n


def _check_data(args, saved: TransformerConfig | None) -> None:
    per_split = [
        f"--{split}-data-path"
        for split in ("train", "valid", "test")
        if getattr(args, f"{split}_data_path")
    ]
    if per_split and args.data_path:
        raise ArgumentsError(
            f"--data-path and {', '.join(per_split)} are both given: give --data-path (cut into "
            "splits by --split) or a data path per split, not both"
        )
    if per_split and not args.train_data_path:
        raise ArgumentsError(
            f"{', '.join(per_split)} without --train-data-path: give the training data too"
        )
    if args.mock_data and (args.data_path or per_split):
        raise ArgumentsError(
            f"--mock-data and {'--data-path' if args.data_path else per_split[0]} are both "
            "given; drop one"
        )
    if not args.mock_data and not args.data_path and not per_split:
        raise ArgumentsError(
            "no training data: give --data-path PREFIX (preprocessed .bin/.idx; or "
            "--train-data-path with --valid-data-path), or --mock-data for synthetic tokens"
        )
    try:
        parse_split(args.split)
    except ValueError as error:
        raise ArgumentsError(str(error)) from None
    kind = args.tokenizer_type
    if kind in ("HuggingFaceTokenizer", "SentencePieceTokenizer") and not args.tokenizer_model:
        raise ArgumentsError(f"--tokenizer-type {kind} needs --tokenizer-model")
    if kind == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        raise ArgumentsError(
            "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"
        )
    if kind == "NullTokenizer" and args.vocab_size is None:
        raise ArgumentsError("--tokenizer-type NullTokenizer needs --vocab-size")
    if (args.data_path or per_split) and kind is None:
        raise ArgumentsError(
            f"{'--data-path' if args.data_path else per_split[0]} needs --tokenizer-type (and its "
            "files): the vocabulary size and end-of-document token come from it; one of "
            f"{', '.join(TOKENIZER_TYPES)}"
        )
    if args.mock_data and kind is None and args.vocab_size is None:
        # Mock tokens are drawn from [0, vocab_size); the last id is the end-of-document token.
        if saved is not None:
            args.vocab_size = saved.vocab_size
        elif args.model is None:
            raise ArgumentsError(
                "--mock-data without a tokenizer needs --vocab-size (or a --model preset's)"
            )
        else:
            args.vocab_size = PRESETS[args.model].vocab_size


def _check_run(args, given) -> None:
    if args.save_interval is not None and args.save is None:
        raise ArgumentsError("--save-interval needs --save (the checkpoint directory)")
    if args.keep_last_checkpoints is not None and args.save is None:
        raise ArgumentsError("--keep-last-checkpoints needs --save (the checkpoint directory)")
    if args.recompute_granularity != "full":
        stray = [d for d in ("recompute_method", "recompute_num_layers") if d in given]
        if stray:
            raise ArgumentsError(
                f"{_flags(*stray)} {_apply(stray)} only with --recompute-granularity full"
            )
    else:  # Megatron asks for both; one layer at a time is the plain meaning of "full"
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = args.recompute_num_layers or 1
    if args.overwrite_save and args.save is None:
        raise ArgumentsError("--overwrite-save needs --save (the checkpoint folder to write over)")
    stray = [d for d in ("wandb_exp_name", "wandb_save_dir") if d in given]
    if stray and not args.wandb_project:
        raise ArgumentsError(f"{_flags(*stray)} {_apply(stray)} only with --wandb-project")
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ArgumentsError(
            "--wandb-project needs the wandb package, which is not installed: "
            "pip install wandb, or drop --wandb-project"
        )


def _absolute_paths(args) -> None:
    """Input files as absolute paths, so that the run's record in each checkpoint still finds
    them from another working directory (--save and --load stay as given: they name outputs)."""

    def absolute(path):
        return os.path.abspath(os.path.expanduser(path))

    for dest in ("tokenizer_model", "vocab_file", "merge_file", "data_cache_path"):
        if getattr(args, dest):
            setattr(args, dest, absolute(getattr(args, dest)))

    def is_number(text):
        try:
            float(text)
            return True
        except ValueError:
            return False

    for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if getattr(args, dest):  # Megatron's list: weights (numbers) and prefixes
            setattr(
                args,
                dest,
                [item if is_number(item) else absolute(item) for item in getattr(args, dest)],
            )


def _check_profile(args, given) -> None:
    options = [
        d
        for d in ("use_pytorch_profiler", "profile_step_start", "profile_step_end", "profile_ranks")
        if d in given
    ]
    if not args.profile:
        if options:
            raise ArgumentsError(f"{_flags(*options)} {_apply(options)} only with --profile")
        return
    if args.profile_step_end <= args.profile_step_start:
        raise ArgumentsError(
            f"--profile-step-end {args.profile_step_end} must be after --profile-step-start "
            f"{args.profile_step_start} (steps start+1 .. end are profiled)"
        )
    if not args.use_pytorch_profiler and not torch.cuda.is_available():
        raise ArgumentsError(
            "--profile without --use-pytorch-profiler marks a CUDA profiler range for "
            "`nsys profile --capture-range=cudaProfilerApi` and needs a GPU; add "
            "--use-pytorch-profiler for a torch.profiler trace"
        )


def _check_and_resolve(args, given: set) -> None:
    if args.fp16:
        raise ArgumentsError("--fp16 is not supported (it needs loss scaling); use --bf16")
    saved = _resolve_model(args, given)
    _check_precision(args, given)
    _check_pipeline(args)
    _check_schedule(args, given)
    _check_data(args, saved)
    _check_run(args, given)
    _check_profile(args, given)
    _check_param_gather(args)
    _absolute_paths(args)


def _check_param_gather(args) -> None:
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentsError(
            "--overlap-param-gather overlaps the distributed optimizer's parameter all-gather with "
            "the forward: give --use-distributed-optimizer too"
        )


# ---- checks against the world size --------------------------------------------------------------


def _check_cuda_graph(args) -> None:
    """What --enable-cuda-graph cannot capture, said at start-up."""
    if args.torch_compile:
        raise ArgumentsError("--enable-cuda-graph and --torch-compile do not combine: choose one")
    if not torch.cuda.is_available():
        raise ArgumentsError("--enable-cuda-graph needs a CUDA GPU; leave it out on the CPU")


def validate_args(args, world_size: int) -> argparse.Namespace:
    """Check the parallel layout and batch sizes against `world_size` (all ranks of the run) and
    fill the derived sizes: world_size, data_parallel_size, global_batch_size (default micro
    batch x dp), num_micro_batches (per optimizer step, per data-parallel rank), train_iters
    (from --train-samples), data_seed (default seed), lr_decay_iters (default train_iters) and
    lr_warmup_iters (from --lr-warmup-fraction). Changes args in place and returns it; calling it
    again is harmless."""
    try:
        check_integer("world size", world_size)
    except ValueError as error:
        raise ArgumentsError(str(error)) from None
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ArgumentsError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} does not "
            f"divide the world size {world_size}; choose sizes whose product divides the number of GPUs"
        )
    dp = world_size // (tp * pp)
    args.world_size, args.data_parallel_size = world_size, dp
    if args.enable_cuda_graph:
        _check_cuda_graph(args)

    per_pass = args.micro_batch_size * dp
    if args.global_batch_size is None:
        args.global_batch_size = per_pass
    if args.global_batch_size % per_pass:
        below = args.global_batch_size // per_pass * per_pass
        hint = f"{below} or {below + per_pass}" if below else f"{per_pass}"
        raise ArgumentsError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp} (world size {world_size} / "
            f"(tensor {tp} x pipeline {pp})) = {per_pass}; use a multiple of {per_pass}, e.g. {hint}"
        )
    args.num_micro_batches = args.global_batch_size // per_pass
    if args.virtual_pipeline_model_parallel_size is not None and args.num_micro_batches % pp:
        raise ArgumentsError(
            f"the interleaved schedule (--num-layers-per-virtual-pipeline-stage, "
            f"--num-virtual-stages-per-pipeline-rank) needs the micro-batches per step ({args.num_micro_batches} = "
            f"--global-batch-size / (--micro-batch-size x data-parallel size)) to be a multiple of "
            f"--pipeline-model-parallel-size {pp}; change the batch sizes or leave the schedule uninterleaved "
            f"(--num-virtual-stages-per-pipeline-rank 1; VPP=1 in the recipes)"
        )

    if args.train_samples is not None:  # Megatron's rule, with no batch-size ramp-up
        args.train_iters = args.train_samples // args.global_batch_size
        if args.train_iters == 0:
            raise ArgumentsError(
                f"--train-samples {args.train_samples} is less than one step of "
                f"--global-batch-size {args.global_batch_size}"
            )
    if args.data_seed is None:
        args.data_seed = args.seed
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:  # Megatron's rule: a fraction of the decay iterations
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_decay_style != "constant" and args.lr_warmup_iters >= args.lr_decay_iters:
        raise ArgumentsError(
            f"warmup ({args.lr_warmup_iters} iterations, --lr-warmup-iters or "
            f"--lr-warmup-fraction) must end before --lr-decay-iters {args.lr_decay_iters} "
            "(which defaults to the training iterations)"
        )
    if (
        args.lr_decay_style == "wsd"
        and args.lr_wsd_decay_iters > args.lr_decay_iters - args.lr_warmup_iters
    ):
        raise ArgumentsError(
            f"--lr-wsd-decay-iters {args.lr_wsd_decay_iters} is longer than what follows "
            f"warmup: --lr-decay-iters {args.lr_decay_iters} - warmup {args.lr_warmup_iters}"
        )
    return args


# ---- what the trainer builds from the arguments -------------------------------------------------


def model_config(
    args, vocab_size: int, saved: TransformerConfig | None = None
) -> TransformerConfig:
    """The model of `args` for the tokenizer's `vocab_size`: the shape flags applied to `saved`
    (the model a --load checkpoint recorded, `checkpointing.latest_model_config`) if given, else
    to the --model preset, so that fields without a flag (rope_scaling, erf GELU) are kept. With
    RoPE the position range grows to cover --seq-length: rotary tables are computed, not learned."""
    fields = {
        field: (to_field(getattr(args, dest)) if to_field else getattr(args, dest))
        for dest, field, to_field, _ in _SHAPE
        if dest != "swiglu"
    }
    base = saved if saved is not None else PRESETS.get(args.model)
    plain = base.activation if base is not None and base.activation != "swiglu" else "gelu_tanh"
    fields["activation"] = "swiglu" if args.swiglu else plain
    if fields["position_embedding"] == "rope":
        fields["max_position_embeddings"] = max(fields["max_position_embeddings"], args.seq_length)
    fields["vocab_size"] = vocab_size
    return base.replace(**fields) if base is not None else TransformerConfig(**fields)


def balance_pipeline_split(args, config: TransformerConfig) -> float:
    """--balance-pipeline-split, once the model (its vocabulary) is known: set
    --decoder-first/last-pipeline-num-layers to the split that evens out the pipeline ranks' work
    (`balanced_stage_split`), the output layer counted at its estimated cost in layers
    (`metrics.output_layer_cost`); returns that cost."""
    from megafp8.parallel.stages import balanced_stage_split
    from megafp8.training.metrics import output_layer_cost

    cost = output_layer_cost(
        config,
        args.seq_length,
        args.tensor_model_parallel_size,
        fp8_layers=args.fp8_format is not None,
        fp8_output_layer=args.fp8_output_layer,
    )
    args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers = (
        balanced_stage_split(
            config.num_layers,
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size or 1,
            cost,
        )
    )
    return cost


def fp8_recipe(args) -> DelayedScaling | CurrentScaling | None:
    """The FP8 recipe of --fp8-*, or None without --fp8-format."""
    if args.fp8_format is None:
        return None
    fmt = Format(args.fp8_format)
    if args.fp8_recipe == "current":
        return CurrentScaling(fp8_format=fmt, margin=args.fp8_margin)
    return DelayedScaling(
        margin=args.fp8_margin,
        interval=args.fp8_interval,
        fp8_format=fmt,
        amax_history_len=args.fp8_amax_history_len,
        amax_compute_algo=args.fp8_amax_compute_algo,
        override_linear_precision=OverrideLinearPrecision(wgrad=args.no_fp8_wgrad),
    )


def args_to_dict(args) -> dict:
    """The arguments as JSON values, for a checkpoint."""
    result = dict(vars(args))
    for key, value in result.items():
        try:
            json.dumps(value)
        except TypeError:
            raise TypeError(f"argument {key}={value!r} is not JSON-serialisable") from None
    return result


def args_from_dict(values: dict) -> argparse.Namespace:
    """A namespace from args_to_dict's output. Flags added since it was saved take their
    defaults; the values are not checked again (parse_args checked them when the run began)."""
    return argparse.Namespace(**{**vars(build_parser().parse_args([])), **values})
