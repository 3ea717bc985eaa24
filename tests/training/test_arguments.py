"""Command-line arguments: Megatron's flag names, presets, YAML configs, and start-up errors that
name the flags at fault."""

import argparse
import json
import os

import pytest
import torch
from megafp8.models.config import PRESETS, TransformerConfig, preset

from megafp8.fp8.formats import Format
from megafp8.fp8.recipe import CurrentScaling, DelayedScaling
from megafp8.training.arguments import (
    ArgumentsError,
    args_from_dict,
    args_to_dict,
    fp8_recipe,
    model_config,
    parse_args,
    validate_args,
)
from megafp8.training.checkpointing import CheckpointError

BASE = "--model gpt-tiny --mock-data --train-iters 10 --lr 1e-3 --micro-batch-size 2"


def parse(extra="", base=BASE):
    return parse_args(f"{base} {extra}".split())


def fails(extra, *flags, base=BASE, world_size=None):
    """Parsing (and validating for world_size) fails with a message naming every one of flags."""
    with pytest.raises(ArgumentsError) as error:
        args = parse(extra, base)
        if world_size is not None:
            validate_args(args, world_size)
    for flag in flags:
        assert flag in str(error.value), f"{flag!r} not in: {error.value}"
    return str(error.value)


# ---- model ------------------------------------------------------------------------------------


def test_preset_fills_the_shape_flags():
    args = parse()
    tiny = PRESETS["gpt-tiny"]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, 64, 4)
    assert args.max_position_embeddings == args.seq_length == tiny.max_position_embeddings
    assert args.position_embedding_type == "learned_absolute" and args.normalization == "LayerNorm"
    assert args.swiglu is False and args.disable_bias_linear is False
    assert model_config(args, tiny.vocab_size) == tiny

    llama = parse("--model llama-tiny")
    assert llama.swiglu and llama.disable_bias_linear and llama.untie_embeddings_and_output_weights
    assert llama.position_embedding_type == "rope" and llama.normalization == "RMSNorm"
    assert llama.num_query_groups == 2
    assert model_config(llama, 1000) == PRESETS["llama-tiny"]


def test_shape_flags_override_the_preset():
    args = parse(
        "--model llama-tiny --num-layers 4 --rotary-base 500000 --ffn-hidden-size 256 --hidden-dropout 0.1"
    )
    assert model_config(args, 500) == preset(
        "llama-tiny",
        num_layers=4,
        rope_theta=500000.0,
        ffn_hidden_size=256,
        hidden_dropout=0.1,
        vocab_size=500,
    )
    gpt = parse(
        "--swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear"
    )
    config = model_config(gpt, 1000)
    assert (config.activation, config.normalization, config.tie_embeddings, config.bias) == (
        "swiglu",
        "rmsnorm",
        False,
        False,
    )


def test_shape_flags_without_a_preset():
    base = "--mock-data --vocab-size 256 --train-iters 10 --lr 1e-3 --micro-batch-size 2"
    args = parse("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32", base)
    config = model_config(args, 256)
    assert config == TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=256,
        max_position_embeddings=32,
    )
    # RoPE has no table to outgrow: the position range follows --seq-length.
    rope = parse(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --position-embedding-type rope "
        "--max-position-embeddings 16 --seq-length 64",
        base,
    )
    assert model_config(rope, 256).max_position_embeddings == 64
    msg = fails("--num-layers 2", "--model", "--hidden-size", "--num-attention-heads", base=base)
    assert "--num-layers" not in msg.split("missing")[1]
    fails("--num-layers 2 --hidden-size 64 --num-attention-heads 4", "--seq-length", base=base)


def test_model_errors_name_the_flags():
    msg = fails("--model gpt-tny", "--model", "did you mean gpt-tiny?")
    assert all(name in msg for name in PRESETS)
    fails("--hidden-size 65", "--hidden-size", "--num-attention-heads")
    fails("--model llama-tiny --num-query-groups 3", "--num-query-groups")
    fails("--tensor-model-parallel-size 8", "--tensor-model-parallel-size")
    fails("--seq-length 256", "--seq-length 256", "--max-position-embeddings 128", "gpt-tiny")
    fails("--group-query-attention", "--group-query-attention", "--num-query-groups")
    parse("--model llama-tiny --group-query-attention")  # the preset has its key/value heads


# ---- --load of a checkpoint that records its model ----------------------------------------------

LOAD_BASE = "--mock-data --train-iters 10 --lr 1e-3 --micro-batch-size 2 --seq-length 32"


def saved_checkpoint(folder, config):
    """A checkpoint folder (iteration 10) whose megafp8.json records `config`, as a run's does."""
    import torch

    from megafp8.training import checkpointing

    return checkpointing.write_checkpoint(
        folder, 10, {"model/w": torch.zeros(1)}, train_state={}, args={}, model_config=config
    )


def test_load_without_shape_flags_trains_the_saved_model(tmp_path):
    saved = preset("llama-tiny", vocab_size=300, num_layers=3)
    saved_checkpoint(tmp_path, saved)
    for extra in (
        "",
        "--model llama-tiny --num-layers 3",
        "--num-layers 3 --swiglu --hidden-dropout 0.1 "
        "--max-position-embeddings 256 --seq-length 64",
    ):
        args = parse(f"--load {tmp_path} {extra}", LOAD_BASE)
        # The recorded args describe the model, and the mock tokens are the saved vocabulary's.
        assert (args.num_layers, args.hidden_size, args.num_query_groups, args.swiglu) == (
            3,
            64,
            2,
            True,
        )
        assert args.normalization == "RMSNorm" and args.untie_embeddings_and_output_weights
        assert args.vocab_size == 300
        if not extra:
            assert model_config(args, 300, saved) == saved
    # Dropout is a training choice; RoPE's range is computed, so --max-position-embeddings and a
    # longer --seq-length are no contradiction.
    assert model_config(args, 300, saved) == saved.replace(
        hidden_dropout=0.1, max_position_embeddings=256
    )
    # The vocabulary of a tokenizer is the trainer's to check, not the parser's.
    assert parse(f"--load {tmp_path} --vocab-size 500", LOAD_BASE).vocab_size == 500


def test_settings_without_a_flag_come_from_the_checkpoint(tmp_path):
    from megafp8.models.config import RopeScaling

    llama31 = preset("llama-tiny", rope_scaling=RopeScaling(original_max_position_embeddings=64))
    saved_checkpoint(tmp_path / "llama31", llama31)
    args = parse(f"--load {tmp_path / 'llama31'}", LOAD_BASE)
    assert model_config(args, 1000, llama31) == llama31
    # A preset without the setting is not that model.
    fails(
        f"--load {tmp_path / 'llama31'} --model llama-tiny",
        "--model llama-tiny (rope_scaling None)",
        "original_max_position_embeddings': 64",
        base=LOAD_BASE,
    )
    erf = preset("gpt-tiny", activation="gelu")
    saved_checkpoint(tmp_path / "erf", erf)
    assert model_config(parse(f"--load {tmp_path / 'erf'}", LOAD_BASE), 1000, erf) == erf


@pytest.mark.parametrize(
    "extra, named",
    [
        (
            "--hidden-size 128 --num-attention-heads 8",
            [
                "--hidden-size 128",
                "hidden_size 64",
                "--num-attention-heads 8",
                "num_attention_heads 4",
                "drop them",
            ],
        ),
        ("--num-layers 4", ["--num-layers 4", "num_layers 2", "drop it"]),
        ("--swiglu", ["--swiglu", "activation gelu_tanh"]),
        (
            "--model llama-tiny",
            [
                "--model llama-tiny (",
                "normalization rmsnorm",
                "activation swiglu",
                "normalization layernorm",
                "activation gelu_tanh",
            ],
        ),
        ("--model gpt-tiny --num-query-groups 2", ["--num-query-groups 2", "num_kv_heads 4"]),
        (
            "--max-position-embeddings 256",
            ["--max-position-embeddings 256", "max_position_embeddings 128"],
        ),
    ],
)
def test_a_flag_that_contradicts_the_saved_model_is_an_error_naming_both_values(
    tmp_path, extra, named
):
    checkpoint = saved_checkpoint(tmp_path / "ckpt", preset("gpt-tiny"))
    message = fails(
        f"--load {tmp_path / 'ckpt'} {extra}",
        *named,
        str(checkpoint),
        "to train on the saved model",
        base=LOAD_BASE,
    )
    assert (
        "contradict" in message
        and f"--save to a new folder without --load {tmp_path / 'ckpt'}" in message
    )


def test_without_a_saved_model_the_flags_describe_it(tmp_path):
    # An empty --load folder (the first run of --save X --load X): flags needed, as without --load.
    (tmp_path / "run").mkdir()
    fails(f"--load {tmp_path / 'run'}", "no model", "--model", base=LOAD_BASE)
    assert parse(f"--load {tmp_path / 'run'} --model gpt-tiny", LOAD_BASE).num_layers == 2
    # A record without the model is not guessed from the flags: refused as damaged.
    checkpoint = saved_checkpoint(tmp_path / "damaged", preset("gpt-tiny", num_layers=3))
    info = json.loads((checkpoint / "megafp8.json").read_text())
    del info["model"]
    (checkpoint / "megafp8.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match="lacks 'model', which checkpoint format 1 records"):
        parse(f"--load {tmp_path / 'damaged'} --model gpt-tiny", LOAD_BASE)


# ---- unknown flags and choices ----------------------------------------------------------------


def test_unknown_flag_suggests_the_closest():
    fails(
        "--tensor-parallel-size 2",
        "--tensor-parallel-size",
        "did you mean --tensor-model-parallel-size?",
    )
    fails("--fp8-amax-history=16", "--fp8-amax-history", "did you mean --fp8-amax-history-len?")
    # no abbreviations
    fails("--micro-batch 2", "--micro-batch", "did you mean --micro-batch-size?")
    fails("stray", "unexpected argument 'stray'")


def test_invalid_values_name_the_flag():
    fails("--recompute-granularity partial", "--recompute-granularity", "full", "selective")
    fails("--fp8-format e5m2 --bf16", "--fp8-format")
    fails("--micro-batch-size 0", "--micro-batch-size", ">= 1")
    fails("--hidden-dropout 1.5", "--hidden-dropout")


# ---- parallelism and batch sizes --------------------------------------------------------------


def test_validate_args_derives_the_sizes():
    args = validate_args(
        parse(
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 16"
        ),
        world_size=8,
    )
    assert (args.world_size, args.data_parallel_size, args.num_micro_batches) == (8, 2, 4)
    default_gbs = validate_args(parse(), world_size=4)
    assert default_gbs.global_batch_size == 8 and default_gbs.num_micro_batches == 1
    assert validate_args(default_gbs, world_size=4).num_micro_batches == 1  # again: harmless


def test_parallel_contradictions():
    fails(
        "--global-batch-size 10",
        "--global-batch-size 10",
        "--micro-batch-size 2",
        "data-parallel size 4",
        "e.g. 8 or 16",
        world_size=4,
    )
    fails(
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
        "--tensor-model-parallel-size 2",
        "--pipeline-model-parallel-size 2",
        "world size 6",
        world_size=6,
    )
    fails(
        "--pipeline-model-parallel-size 4 --num-layers 6",
        "--num-layers 6",
        "--pipeline-model-parallel-size 4",
    )
    fails(
        "--num-layers-per-virtual-pipeline-stage 1",
        "--num-layers-per-virtual-pipeline-stage",
        "--pipeline-model-parallel-size",
    )
    fails(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
        "--num-layers-per-virtual-pipeline-stage 3",
    )
    fails(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
        "--global-batch-size 2",
        "--pipeline-model-parallel-size 2",
        "--global-batch-size",
        world_size=2,
    )
    vpp = parse(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2"
    )
    assert vpp.virtual_pipeline_model_parallel_size == 2


def test_virtual_stages_per_pipeline_rank():
    """Megatron's other spelling of the interleaved schedule: the virtual stages of a rank."""
    vpp = parse(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 4"
    )
    assert (
        vpp.num_layers_per_virtual_pipeline_stage == 1
        and vpp.virtual_pipeline_model_parallel_size == 4
    )
    plain = parse(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 1"
    )
    assert plain.virtual_pipeline_model_parallel_size is None
    assert (
        parse("--num-virtual-stages-per-pipeline-rank 1").virtual_pipeline_model_parallel_size
        is None
    )
    fails(
        "--num-virtual-stages-per-pipeline-rank 2",
        "--num-virtual-stages-per-pipeline-rank 2",
        "--pipeline-model-parallel-size > 1",
    )
    fails(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 3",
        "4 layers per rank",
        "--num-virtual-stages-per-pipeline-rank 3",
        "a divisor of 4",
    )
    fails(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--num-layers-per-virtual-pipeline-stage 2",
        "give one",
    )
    fails(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--global-batch-size 2",
        "multiple of",
        "VPP=1",
        world_size=2,
    )


def test_stages_of_their_own_sizes():
    """--decoder-first/last-pipeline-num-layers size the first and last virtual stages, with or
    without interleaving; --balance-pipeline-split has the trainer choose them."""
    uneven = parse(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--decoder-last-pipeline-num-layers 1 --decoder-first-pipeline-num-layers 3"
    )
    assert (
        uneven.virtual_pipeline_model_parallel_size == 2
        and uneven.num_layers_per_virtual_pipeline_stage is None
    )
    assert (
        parse(
            "--num-layers 7 --pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 3"
        ).virtual_pipeline_model_parallel_size
        is None
    )
    halves = parse(
        "--num-layers 4 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1.5"
    )
    assert halves.decoder_first_pipeline_num_layers == 1.5
    assert (
        parse(
            "--decoder-first-pipeline-num-layers 2.0 --num-layers 4 --pipeline-model-parallel-size 2"
        ).decoder_first_pipeline_num_layers
        == 2
    )
    fails(
        "--num-layers 4 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1.25",
        "--decoder-first-pipeline-num-layers",
        "ending in .5",
    )
    balanced = parse(
        "--num-layers 6 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--balance-pipeline-split"
    )
    assert balanced.virtual_pipeline_model_parallel_size == 2 and balanced.balance_pipeline_split
    fails(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--decoder-last-pipeline-num-layers 4",
        "--decoder-first/last-pipeline-num-layers",
        "the 4 layers left after last_stage_layers=4",
        "other 3",
    )
    fails(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
        "--decoder-last-pipeline-num-layers 3",
        "--num-virtual-stages-per-pipeline-rank, not",
    )
    fails(
        "--num-layers 8 --pipeline-model-parallel-size 2 --balance-pipeline-split "
        "--decoder-last-pipeline-num-layers 3",
        "--decoder-first/last-pipeline-num-layers and --balance-pipeline-split each choose",
        "give one of them",
    )
    # every virtual stage's layers, a middle one starting at a layer's MLP
    layout = parse(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--pipeline-stage-layers 2 2.5 2.5 1"
    )
    assert layout.pipeline_stage_layers == [2, 2.5, 2.5, 1]
    assert layout.virtual_pipeline_model_parallel_size == 2
    fails(
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--pipeline-stage-layers 4 4",
        "--pipeline-stage-layers: layout has 2 stages' layers (4, 4), but there are 4 pipeline stages",
    )
    fails(
        "--num-layers 8 --pipeline-model-parallel-size 2 --pipeline-stage-layers 4 3.5",
        "--pipeline-stage-layers: layout adds up to 7.5 layers",
        "num_layers=8",
    )
    fails(
        "--num-layers 8 --pipeline-model-parallel-size 2 --pipeline-stage-layers 4 4 "
        "--balance-pipeline-split",
        "--pipeline-stage-layers and --balance-pipeline-split each choose",
    )
    fails(
        "--pipeline-stage-layers 4",
        "--pipeline-stage-layers needs --pipeline-model-parallel-size > 1",
    )
    fails(
        "--balance-pipeline-split",
        "--balance-pipeline-split needs --pipeline-model-parallel-size > 1",
    )
    fails(
        # 4 virtual stages need at least 4 half layers
        "--num-layers 1 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--balance-pipeline-split",
        "--balance-pipeline-split",
        "num_layers=1 cannot be split",
    )
    fails(
        "--num-layers 7 --pipeline-model-parallel-size 2",
        "--num-layers 7",
        "--balance-pipeline-split",
    )


def test_cuda_graphs_refuse_what_they_cannot_capture():
    fails(
        "--enable-cuda-graph --torch-compile",
        "--enable-cuda-graph",
        "--torch-compile",
        world_size=1,
    )
    fails("--cuda-graph-warmup-steps 0", "--cuda-graph-warmup-steps")
    # A captured recomputation cannot replay the forward's dropout mask: refused with dropout,
    # not without it (gpt-tiny has none).
    recompute = "--enable-cuda-graph --recompute-granularity full"
    for dropout in ("--hidden-dropout 0.1", "--attention-dropout 0.1"):
        fails(
            f"{recompute} {dropout}", "--recompute-granularity", "--hidden-dropout 0", world_size=1
        )
    if torch.cuda.is_available():
        validate_args(parse(recompute), 1)
    else:
        fails(recompute, "CUDA GPU", world_size=1)
    if not torch.cuda.is_available():
        fails("--enable-cuda-graph", "--enable-cuda-graph", "CUDA GPU", world_size=1)


def test_lean_optimizer_states():
    args = parse(
        "--bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16 "
        "--store-param-remainders"
    )
    assert (args.exp_avg_dtype, args.exp_avg_sq_dtype, args.main_grads_dtype) == ("bf16",) * 3
    assert args.store_param_remainders is True
    defaults = parse()
    assert (defaults.exp_avg_dtype, defaults.exp_avg_sq_dtype, defaults.main_grads_dtype) == (
        "fp32",
    ) * 3
    fails("--store-param-remainders", "--store-param-remainders", "--bf16")
    fails("--exp-avg-dtype fp16", "--exp-avg-dtype")
    assert parse("--exp-avg-dtype fp8").exp_avg_dtype == "fp8"
    fails("--exp-avg-sq-dtype fp8", "--exp-avg-sq-dtype")  # E4M3 cannot hold squared gradients
    fails("--main-grads-dtype fp8", "--main-grads-dtype")


def test_overlap_param_gather():
    assert parse("--use-distributed-optimizer --overlap-param-gather").overlap_param_gather is True
    fails("--overlap-param-gather", "--overlap-param-gather", "--use-distributed-optimizer")


def test_sequence_parallel():
    with pytest.warns(UserWarning, match="--sequence-parallel.*--tensor-model-parallel-size 1"):
        assert parse("--sequence-parallel").sequence_parallel is False
    assert parse("--sequence-parallel --tensor-model-parallel-size 2").sequence_parallel is True
    assert (
        parse(
            "--sequence-parallel --tensor-model-parallel-size 2 --tp-comm-overlap"
        ).tp_comm_overlap
        is True
    )
    fails(
        "--tensor-model-parallel-size 2 --tp-comm-overlap",
        "--tp-comm-overlap",
        "give --sequence-parallel",
    )
    overlap = "--sequence-parallel --tensor-model-parallel-size 2 --tp-comm-overlap"
    assert parse(overlap).tp_comm_overlap_transport == "auto"
    assert parse(overlap + " --tp-comm-overlap-transport nccl").tp_comm_overlap_transport == "nccl"
    assert parse(overlap).tp_comm_sm_carveout == 2
    assert parse(overlap + " --tp-comm-sm-carveout 0").tp_comm_sm_carveout == 0
    with pytest.warns(UserWarning, match="blockwise runs its FP8 linears' sequence-parallel"):
        assert parse(overlap + " --fp8-format e4m3 --fp8-recipe blockwise").tp_comm_overlap
    fails(
        overlap + " --tp-comm-sm-carveout -1", "--tp-comm-sm-carveout", "expected an integer >= 0"
    )
    fails(
        "--sequence-parallel --tensor-model-parallel-size 2 --tp-comm-overlap-transport copy-engine",
        "--tp-comm-overlap-transport copy-engine",
        "give --tp-comm-overlap too",
    )
    fails(
        "--sequence-parallel --tensor-model-parallel-size 4 --seq-length 126",
        "--sequence-parallel",
        "--seq-length 126",
        "--tensor-model-parallel-size 4",
    )


# ---- duration and learning rate ---------------------------------------------------------------


def test_train_iters_or_samples():
    base = "--model gpt-tiny --mock-data --lr 1e-3 --micro-batch-size 2"
    fails("", "--train-iters", "--train-samples", "neither", base=base)
    fails(
        "--train-iters 5 --train-samples 50", "--train-iters", "--train-samples", "both", base=base
    )
    args = validate_args(parse("--train-samples 100 --global-batch-size 8", base), world_size=1)
    assert args.train_iters == 12 and args.lr_decay_iters == 12
    fails(
        "--train-samples 4 --global-batch-size 8",
        "--train-samples 4",
        "--global-batch-size 8",
        base=base,
        world_size=1,
    )


def test_learning_rate_contradictions():
    fails("", "--lr", base="--model gpt-tiny --mock-data --train-iters 10 --micro-batch-size 2")
    fails("", "--micro-batch-size", base="--model gpt-tiny --mock-data --train-iters 10 --lr 1e-3")
    fails("--min-lr 1e-2", "--min-lr", "--lr")
    fails(
        "--lr-warmup-iters 2 --lr-warmup-fraction 0.1", "--lr-warmup-iters", "--lr-warmup-fraction"
    )
    fails("--lr-decay-style wsd", "--lr-decay-style wsd", "--lr-wsd-decay-iters")
    fails("--lr-wsd-decay-iters 3", "--lr-wsd-decay-iters", "--lr-decay-style wsd")
    fails("--lr-warmup-iters 10", "--lr-warmup-iters", "--lr-decay-iters 10", world_size=1)
    fails(
        "--lr-decay-style wsd --lr-wsd-decay-iters 9 --lr-warmup-iters 2",
        "--lr-wsd-decay-iters 9",
        "--lr-decay-iters 10",
        world_size=1,
    )
    args = validate_args(parse("--lr-warmup-fraction 0.25 --lr-decay-iters 8"), world_size=1)
    assert args.lr_warmup_iters == 2 and args.lr_decay_iters == 8


# ---- precision --------------------------------------------------------------------------------


def test_fp16_is_rejected_for_bf16():
    fails("--fp16", "--fp16", "--bf16")


def test_fp8_knobs_need_fp8_format():
    msg = fails(
        "--fp8-margin 1 --no-fp8-wgrad --fp8-output-layer",
        "--fp8-margin",
        "--no-fp8-wgrad",
        "--fp8-output-layer",
        "--fp8-format",
    )
    assert "--fp8-interval" not in msg
    fails("--first-last-layers-bf16 1", "--first-last-layers-bf16", "--fp8-format")
    fails("--fp8-recipe current", "--fp8-recipe", "--fp8-format")
    fails(
        "--fp8-format hybrid --fp8-recipe current --fp8-amax-history-len 16 --no-fp8-wgrad",
        "--fp8-amax-history-len",
        "--no-fp8-wgrad",
        "--fp8-recipe delayed",
    )
    # FP8 with fp32 parameters is allowed
    assert parse("--fp8-format hybrid").params_dtype == "float32"
    assert parse("--bf16 --fp8-format hybrid").params_dtype == "bfloat16"


@pytest.mark.parametrize(
    "flags, n",
    [
        ("", 0),
        ("--first-last-layers-bf16 1", 1),
        ("--first-last-layers-bf16", 1),  # Megatron's switch: one layer at each end by default
        (
            "--first-last-layers-bf16 --num-layers-at-start-in-bf16 2 --num-layers-at-end-in-bf16 2",
            2,
        ),
        ("--first-last-layers-bf16 2 --num-layers-at-start-in-bf16 2", 2),
    ],
)
def test_first_last_layers_bf16(flags, n):
    args = parse(f"--fp8-format hybrid --num-layers 4 {flags}")
    assert (
        args.first_last_layers_bf16
        == args.num_layers_at_start_in_bf16
        == args.num_layers_at_end_in_bf16
        == n
    )


def test_first_last_layers_bf16_contradictions():
    base = f"{BASE} --fp8-format hybrid --num-layers 4"
    fails(
        "--first-last-layers-bf16 --num-layers-at-start-in-bf16 1 --num-layers-at-end-in-bf16 2",
        "--num-layers-at-start-in-bf16 1",
        "--num-layers-at-end-in-bf16 2",
        base=base,
    )
    fails(
        "--num-layers-at-start-in-bf16 1",
        "--num-layers-at-start-in-bf16",
        "--first-last-layers-bf16",
        base=base,
    )
    fails(
        "--first-last-layers-bf16 1 --num-layers-at-end-in-bf16 2",
        "--first-last-layers-bf16 1",
        "--num-layers-at-end-in-bf16",
        base=base,
    )
    fails("--first-last-layers-bf16 3", "--first-last-layers-bf16 3", "--num-layers 4", base=base)


def test_recipe_mapping():
    assert fp8_recipe(parse()) is None
    delayed = fp8_recipe(
        parse(
            "--bf16 --fp8-format hybrid --fp8-margin 1 --fp8-interval 2 "
            "--fp8-amax-history-len 16 --fp8-amax-compute-algo max --no-fp8-wgrad"
        )
    )
    assert delayed == DelayedScaling(
        margin=1,
        interval=2,
        fp8_format=Format.HYBRID,
        amax_history_len=16,
        amax_compute_algo="max",
        override_linear_precision=(False, False, True),
    )
    megatron_defaults = fp8_recipe(parse("--fp8-format e4m3"))
    assert (
        megatron_defaults.fp8_format,
        megatron_defaults.amax_history_len,
        megatron_defaults.amax_compute_algo,
    ) == (Format.E4M3, 1, "most_recent")
    assert megatron_defaults.override_linear_precision == (False, False, False)
    for name in ("current", "tensorwise"):  # tensorwise: Megatron's name for current scaling
        args = parse(f"--fp8-format e4m3 --fp8-recipe {name} --fp8-margin 2")
        assert args.fp8_recipe == "current"
        assert fp8_recipe(args) == CurrentScaling(fp8_format=Format.E4M3, margin=2)


# ---- data, checkpoints, recomputation ---------------------------------------------------------


def test_data_contradictions():
    base = "--model gpt-tiny --train-iters 10 --lr 1e-3 --micro-batch-size 2"
    fails("", "--data-path", "--mock-data", base=base)
    fails("--mock-data --data-path corpus_text_document", "--mock-data", "--data-path", base=base)
    fails("--data-path corpus_text_document", "--data-path", "--tokenizer-type", base=base)
    fails("--split 1,x", "--split")
    fails("--vocab-size 1", "--vocab-size")
    no_preset = (
        "--mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32"
    )
    fails(no_preset, "--mock-data", "--vocab-size", base=base.replace("--model gpt-tiny", ""))
    # mock tokens from the preset's vocabulary
    assert parse().vocab_size == PRESETS["gpt-tiny"].vocab_size
    args = parse(
        "--data-path 0.7 a_text_document 0.3 b_text_document --tokenizer-type NullTokenizer "
        "--vocab-size 512",
        base,
    )
    # Prefixes and tokenizer files become absolute, so a checkpoint's record finds them from elsewhere.
    assert args.data_path == [
        "0.7",
        os.path.abspath("a_text_document"),
        "0.3",
        os.path.abspath("b_text_document"),
    ]
    assert not args.mock_data
    # A data path per split (Megatron's --train/valid/test-data-path) instead of --data-path and --split.
    tok = "--tokenizer-type NullTokenizer --vocab-size 512"
    fails(f"--data-path a --train-data-path b {tok}", "--data-path", "--train-data-path", base=base)
    fails(f"--valid-data-path v {tok}", "--valid-data-path", "--train-data-path", base=base)
    fails("--mock-data --train-data-path t", "--mock-data", "--train-data-path", base=base)
    fails("--train-data-path t", "--train-data-path", "--tokenizer-type", base=base)
    args = parse(f"--train-data-path t --valid-data-path 1 v {tok}", base)
    assert args.train_data_path == [os.path.abspath("t")] and args.valid_data_path == [
        "1",
        os.path.abspath("v"),
    ]
    assert args.test_data_path is None and args.data_path is None


@pytest.mark.parametrize(
    "tokenizer, needs",
    [
        ("HuggingFaceTokenizer", ["--tokenizer-model"]),
        ("SentencePieceTokenizer", ["--tokenizer-model"]),
        ("GPT2BPETokenizer", ["--vocab-file", "--merge-file"]),
        ("NullTokenizer", ["--vocab-size"]),
    ],
)
def test_tokenizer_requirements(tokenizer, needs):
    fails(f"--tokenizer-type {tokenizer}", f"--tokenizer-type {tokenizer}", *needs)


def test_checkpoint_and_recompute_flags():
    fails("--save-interval 5", "--save-interval", "--save")
    args = parse("--save ckpt --save-interval 5 --load /no/such/dir --no-load-optim --finetune")
    assert (args.save, args.save_interval, args.load, args.no_load_optim, args.finetune) == (
        "ckpt",
        5,
        "/no/such/dir",
        True,
        True,
    )
    fails("--recompute-method uniform", "--recompute-method", "--recompute-granularity full")
    fails("--recompute-granularity selective --recompute-num-layers 1", "--recompute-num-layers")
    args = parse("--recompute-granularity full --recompute-method block --recompute-num-layers 2")
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == (
        "full",
        "block",
        2,
    )
    args = parse("--recompute-granularity full")  # Megatron asks for both: one layer at a time
    assert (args.recompute_method, args.recompute_num_layers) == ("uniform", 1)
    fails("--overwrite-save", "--overwrite-save needs --save")
    fails("--keep-last-checkpoints 2", "--keep-last-checkpoints needs --save")
    assert parse("--save ckpt --keep-last-checkpoints 2").keep_last_checkpoints == 2
    fails("--wandb-exp-name run1", "--wandb-exp-name", "only with --wandb-project")
    assert parse().recompute_granularity is None and parse().skip_nonfinite_steps_max == 10


# ---- --config file.yaml -----------------------------------------------------------------------


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_wandb_needs_the_package_before_anything_starts(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    fails("--wandb-project p", "pip install wandb")
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "wandb" else real(name, *a),
    )
    assert parse("--wandb-project p --wandb-exp-name run1").wandb_exp_name == "run1"


def test_yaml_config_merges_under_the_command_line(tmp_path):
    path = write(
        tmp_path,
        "model: llama-tiny\nmock-data: true\ntrain_iters: 10\nlr: 3.0e-4\n"
        "micro_batch_size: 2\nglobal-batch-size: 8\noverlap_grad_reduce: false\n"
        "bf16: true\nfp8_format: hybrid\nfp8-margin: 1\nswiglu: false\neval_iters: null\n"
        "data_path: [1, x]\n",
    )
    # the list arrives as a list
    with pytest.raises(ArgumentsError, match="--mock-data and --data-path"):
        parse_args(["--config", str(path)])
    path.write_text(path.read_text().replace("data_path: [1, x]\n", ""))
    args = parse_args(["--config", str(path), "--lr", "1e-3", "--fp8-margin", "2"])
    assert args.lr == 1e-3 and args.fp8_margin == 2  # explicit flags win
    assert (
        args.model == "llama-tiny"
        and args.mock_data
        and args.train_iters == 10
        and args.global_batch_size == 8
    )
    assert args.overlap_grad_reduce is False and args.bf16 and args.fp8_format == "hybrid"
    assert args.eval_iters == 100  # null: the default
    assert args.swiglu is True  # false means "not given": the preset's SwiGLU stays
    assert parse_args(["--config", str(path), "--overlap-grad-reduce"]).overlap_grad_reduce is True
    # Knobs set in the file count as given: the FP8 check sees them.
    path.write_text("fp8_margin: 1\n")
    fails(f"--config {path}", "--fp8-margin", "--fp8-format")


def test_yaml_config_errors_name_the_key_and_file(tmp_path):
    path = write(tmp_path, "model: gpt-tiny\ntensor_parallel_size: 2\n")
    fails(f"--config {path}", str(path), "tensor_parallel_size", "tensor-model-parallel-size")
    path.write_text("micro_batch_size: zero\n")
    fails(f"--config {path}", str(path), "--micro-batch-size")
    path.write_text("mock_data: 3\n")
    fails(f"--config {path}", str(path), "mock_data", "true or false")
    path.write_text("- lr\n")
    fails(f"--config {path}", str(path), "mapping")
    path.write_text("config: other.yaml\n")
    fails(f"--config {path}", str(path), "nest")
    fails(f"--config {tmp_path / 'missing.yaml'}", "missing.yaml", "cannot read")


# ---- checkpoints: args as a dict --------------------------------------------------------------


def test_round_trip_through_args_to_dict():
    args = validate_args(
        parse(
            "--model llama-tiny --bf16 --fp8-format hybrid --fp8-recipe current "
            "--tensor-model-parallel-size 2 --sequence-parallel --save ckpt"
        ),
        world_size=4,
    )
    saved = json.loads(json.dumps(args_to_dict(args)))
    restored = args_from_dict(saved)
    assert vars(restored) == vars(args)
    assert model_config(restored, 1000) == model_config(args, 1000)
    assert fp8_recipe(restored) == fp8_recipe(args)
    old = args_from_dict({k: v for k, v in saved.items() if k != "skip_nonfinite_steps_max"})
    assert old.skip_nonfinite_steps_max == 10  # a flag newer than the checkpoint takes its default


def test_every_flag_dest_is_its_name_with_underscores():
    from megafp8.training.arguments import build_parser

    for action in build_parser()._actions:
        for flag in action.option_strings:
            negative = isinstance(action, argparse.BooleanOptionalAction) and flag.startswith(
                "--no-"
            )
            if flag.startswith("--") and not negative and flag != "--help":
                assert action.dest == flag[2:].replace("-", "_"), flag


@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
def test_fine_grained_scaling_from_the_flags(name):
    """--fp8-recipe rowwise / blockwise is RowwiseScaling / BlockwiseScaling, --no-fp8-wgrad
    keeps its weight gradient in high precision; delayed scaling's knobs are refused, and so are
    FP8 primary weights."""
    from megafp8.fp8 import BlockwiseScaling, RowwiseScaling

    recipe = {"rowwise": RowwiseScaling, "blockwise": BlockwiseScaling}[name]
    base = f"--fp8-format e4m3 --fp8-recipe {name}"
    args = parse(base)
    assert fp8_recipe(args) == recipe(fp8_format="e4m3")
    assert args.fp8_primary_weights is False
    assert fp8_recipe(parse(base + " --no-fp8-wgrad")).override_linear_precision.wgrad
    with pytest.raises(ArgumentsError, match="only to --fp8-recipe delayed"):
        parse(base + " --fp8-amax-history-len 16")
    with pytest.raises(ArgumentsError, match=f"--fp8-recipe {name}"):
        parse(base + " --fp8-primary-weights")
