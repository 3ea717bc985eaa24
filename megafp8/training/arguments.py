"""Command-line arguments: Megatron-LM's flag names, one namespace, checked at start-up.

    args = parse_args()                  # flags and --config file.yaml; every check that needs no world size
    validate_args(args, world_size)      # parallel layout, batch sizes, iteration counts
    _, saved = checkpointing.latest_model_config(args.load) or (None, None)  # the --load checkpoint's model
    config = model_config(args, tokenizer.vocab_size, saved)
    recipe = fp8_recipe(args)            # None without --fp8-format

A --load checkpoint that records its model (megafp8.json's "model") is the model: shape flags and
--model may be left out, and one that contradicts it is an error.

The flags and their --config YAML spelling are in flags.py, the model they describe in
model_flags.py; this module checks them together and is the trainer's entry to both. Each flag's
dest is its name with underscores (`--fp8-format` -> `args.fp8_format`). Errors raise
ArgumentsError (a ValueError) whose message names the flags involved and what to give instead.
docs/training.md lists the flags and where they differ from Megatron-LM's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import warnings

import torch

from megafp8.data.gpt_dataset import parse_split
from megafp8.data.tokenizers import TOKENIZER_TYPES
from megafp8.fp8.formats import Format
from megafp8.fp8.recipe import (
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    OverrideLinearPrecision,
    Recipe,
    RowwiseScaling,
)
from megafp8.messages import check_integer
from megafp8.models.config import PRESETS, TransformerConfig

from .flags import ArgumentsError, build_parser, flag_names, given_only, reject_unknown, yaml_tokens
from .model_flags import model_config, resolve_model

__all__ = [
    "ArgumentsError",
    "args_from_dict",
    "args_to_dict",
    "balance_pipeline_split",
    "build_parser",
    "fp8_recipe",
    "model_config",
    "parse_args",
    "validate_args",
]


def parse_args(argv=None) -> argparse.Namespace:
    """Flags (argv, default sys.argv[1:]) over an optional --config YAML file, resolved against
    the --model preset and checked; raises ArgumentsError naming the flags at fault."""
    probe = given_only(build_parser())
    explicit, extras = probe.parse_known_args(argv)
    if extras:
        reject_unknown(probe, extras)
    from_file = {}
    if getattr(explicit, "config", None):
        tokens = yaml_tokens(explicit.config, probe)
        try:
            from_file = vars(given_only(build_parser()).parse_args(tokens))
        except ArgumentsError as error:  # a bad value: say which file it came from
            raise ArgumentsError(f"--config {explicit.config}: {error}") from None
    parser = build_parser()
    parser.set_defaults(**from_file)
    args = parser.parse_args(argv)
    _check_and_resolve(args, given=set(vars(explicit)) | set(from_file))
    return args


# ---- checks that need no world size -------------------------------------------------------------


def _apply(stray) -> str:
    return "applies" if len(stray) == 1 else "apply"


def _check_pipeline(args) -> None:
    pp, vpp_layers = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    layout = args.pipeline_stage_layers
    stages = args.num_virtual_stages_per_pipeline_rank
    uneven = first is not None or last is not None
    if stages is not None and vpp_layers is not None:
        raise ArgumentsError(
            "--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage "
            "say the same thing; give one"
        )
    given = [
        flag
        for flag, on in (
            ("--pipeline-stage-layers", layout is not None),
            ("--decoder-first/last-pipeline-num-layers", uneven),
            ("--balance-pipeline-split", args.balance_pipeline_split),
        )
        if on
    ]
    if len(given) > 1:
        raise ArgumentsError(
            f"{' and '.join(given)} each choose the stages' layers: give one of them"
        )
    if pp == 1:
        for flag, value in (
            (f"--num-virtual-stages-per-pipeline-rank {stages}", (stages or 1) > 1),
            (f"--num-layers-per-virtual-pipeline-stage {vpp_layers}", vpp_layers is not None),
            *((flag, True) for flag in given),
        ):
            if value:
                raise ArgumentsError(f"{flag} needs --pipeline-model-parallel-size > 1")
    args.virtual_pipeline_model_parallel_size = None
    if given:
        if vpp_layers is not None:
            raise ArgumentsError(
                f"with stages of their own sizes ({given[0]}) virtual stages differ in layers: "
                "give their number per rank, --num-virtual-stages-per-pipeline-rank, not "
                "--num-layers-per-virtual-pipeline-stage"
            )
        vpp = stages or 1
        from megafp8.parallel.stages import balanced_stage_split, stage_layers

        try:  # the split the trainer will make (or, balanced, that one exists), before any process starts
            if args.balance_pipeline_split:
                balanced_stage_split(args.num_layers, pp, vpp)
            else:
                stage_layers(args.num_layers, pp, 0, vpp, first, last, layout)
        except ValueError as error:
            raise ArgumentsError(f"{given[0]}: {error}") from None
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
    if args.tp_comm_overlap and args.fp8_format and args.fp8_recipe in FINE_GRAINED:
        warnings.warn(
            f"--tp-comm-overlap: --fp8-recipe {args.fp8_recipe} runs its FP8 linears' "
            "sequence-parallel collectives before and after their GEMMs, not beside them",
            stacklevel=4,
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
                f"{flag_names(*stray)} {_apply(stray)} only with --lr-decay-style wsd "
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
# --fp8-recipe values with a scale per row or block (megafp8.fp8.fine_grained)
FINE_GRAINED = {"rowwise": RowwiseScaling, "blockwise": BlockwiseScaling}
_DELAYED_ONLY = ("fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo", "no_fp8_wgrad")


def _check_precision(args, given) -> None:
    args.params_dtype = "bfloat16" if args.bf16 else "float32"
    if args.fp8_recipe == "tensorwise":
        args.fp8_recipe = "current"
    if args.fp8_format is None:
        stray = [d for d in _FP8_KNOBS + _SENTINEL if d in given]
        if stray:
            raise ArgumentsError(
                f"{', '.join(flag_names(d) for d in stray)} given without --fp8-format; "
                "add --fp8-format hybrid (or e4m3) to train in FP8, or drop them"
            )
        args.first_last_layers_bf16 = 0
        args.num_layers_at_start_in_bf16 = args.num_layers_at_end_in_bf16 = 0
        return
    stray = [d for d in _SENTINEL if d in given]
    if stray and not args.fp8_check_interval:
        raise ArgumentsError(
            f"{', '.join(flag_names(d) for d in stray)} {_apply(stray)} only to the bf16 sentinel: "
            "add --fp8-check-interval N (a check every N iterations), or drop them"
        )
    if args.fp8_recipe in ("current", *FINE_GRAINED):
        # fine-grained scaling may keep the weight gradient in high precision (torchao's option)
        allowed = ("no_fp8_wgrad",) if args.fp8_recipe in FINE_GRAINED else ()
        stray = [d for d in _DELAYED_ONLY if d in given and d not in allowed]
        if stray:
            raise ArgumentsError(
                f"{', '.join(flag_names(d) for d in stray)} {_apply(stray)} only to --fp8-recipe delayed; "
                f"{args.fp8_recipe} scaling keeps no amax history"
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
                f"{flag_names(*stray)} {_apply(stray)} only with --recompute-granularity full"
            )
    else:  # Megatron asks for both; one layer at a time is the plain meaning of "full"
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = args.recompute_num_layers or 1
    if args.overwrite_save and args.save is None:
        raise ArgumentsError("--overwrite-save needs --save (the checkpoint folder to write over)")
    stray = [d for d in ("wandb_exp_name", "wandb_save_dir") if d in given]
    if stray and not args.wandb_project:
        raise ArgumentsError(f"{flag_names(*stray)} {_apply(stray)} only with --wandb-project")
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
            raise ArgumentsError(f"{flag_names(*options)} {_apply(options)} only with --profile")
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
    saved = resolve_model(args, given)
    _check_precision(args, given)
    _check_pipeline(args)
    _check_schedule(args, given)
    _check_data(args, saved)
    _check_run(args, given)
    _check_profile(args, given)
    _check_param_gather(args)
    _check_optimizer_states(args)
    _resolve_fp8_primary_weights(args)
    _absolute_paths(args)


def _resolve_fp8_primary_weights(args) -> None:
    """--fp8-primary-weights: on by default where it applies (with the distributed optimizer only
    when asked for: it saves memory there at a cost in step time, each rank transposing the
    gathered weights); asked for where it cannot, refused."""
    blockers = [
        flag
        for flag, on in (
            ("--fp8-recipe current", args.fp8_recipe == "current"),
            (f"--fp8-recipe {args.fp8_recipe}", args.fp8_recipe in FINE_GRAINED),
            ("--store-param-remainders", args.store_param_remainders),
            ("--exp-avg-dtype fp8", args.exp_avg_dtype == "fp8"),
            ("--fp8-check-interval", bool(args.fp8_check_interval)),
            ("--no-gradient-accumulation-fusion", not args.gradient_accumulation_fusion),
            ("--torch-compile", args.torch_compile),
        )
        if on
    ]
    if args.fp8_param_gather:
        if not args.use_distributed_optimizer or args.fp8_primary_weights is False:
            raise ArgumentsError(
                "--fp8-param-gather all-gathers the distributed optimizer's FP8 primary weights in "
                "FP8: give --use-distributed-optimizer, and leave out --no-fp8-primary-weights"
            )
        args.fp8_primary_weights = True
    if args.fp8_format is None:
        if args.fp8_primary_weights:
            raise ArgumentsError(
                "--fp8-primary-weights holds the FP8 linears' weights in FP8: add --fp8-format"
            )
        args.fp8_primary_weights = False
    elif args.fp8_primary_weights is None:
        args.fp8_primary_weights = not blockers and not args.use_distributed_optimizer
    elif args.fp8_primary_weights and blockers:
        raise ArgumentsError(
            f"--fp8-primary-weights does not combine with {', '.join(blockers)}: the optimizer "
            "writes FP8 weights from fp32 masters, with the delayed scale, and the layers hand "
            "their gradients to the gradient buffer; drop one or the other"
        )


def _check_optimizer_states(args) -> None:
    if args.store_param_remainders and not args.bf16:
        raise ArgumentsError(
            "--store-param-remainders keeps the fp32 master weight as the bf16 parameter and a "
            "16-bit remainder: give --bf16 too (these parameters are fp32, their own masters)"
        )


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
    if args.recompute_granularity and (args.hidden_dropout or args.attention_dropout):
        raise ArgumentsError(
            "--enable-cuda-graph with --recompute-granularity needs the model without dropout (a "
            "captured recomputation cannot replay the forward's random mask): give --hidden-dropout "
            "0 --attention-dropout 0, or leave one of the two flags out"
        )
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


def fp8_recipe(args) -> Recipe | None:
    """The FP8 recipe of --fp8-*, or None without --fp8-format."""
    if args.fp8_format is None:
        return None
    fmt = Format(args.fp8_format)
    if args.fp8_recipe == "current":
        return CurrentScaling(fp8_format=fmt, margin=args.fp8_margin)
    if args.fp8_recipe in FINE_GRAINED:
        return FINE_GRAINED[args.fp8_recipe](
            fp8_format=fmt,
            margin=args.fp8_margin,
            override_linear_precision=OverrideLinearPrecision(wgrad=args.no_fp8_wgrad),
        )
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
