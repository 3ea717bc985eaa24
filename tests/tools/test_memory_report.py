"""tools/memory_report.py: the memory model's figures for a trainer command line, per pipeline
stage and per layer role; the trainer's own message for flags it would refuse."""

import pytest

from megafp8.planner.memory import MemoryLayout, estimate, layer_activation_roles
from megafp8.training import arguments

from .load import load_tool

memory_report = load_tool("memory_report")
RUN = [
    "--model",
    "gpt-1.3b",
    "--seq-length",
    "2048",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "64",
    "--pipeline-model-parallel-size",
    "2",
    "--bf16",
    "--fp8-format",
    "hybrid",
]


def predicted(flags, gpus):
    args = arguments.validate_args(arguments.parse_args(memory_report.trainer_flags(flags)), gpus)
    config = arguments.model_config(args, args.vocab_size)
    layout = MemoryLayout.from_args(args)
    return estimate(config, layout), layer_activation_roles(config, layout)


def test_the_report_is_the_memory_models_per_stage_and_role(capsys):
    assert memory_report.main(["--gpus", "4", "--gpu-memory", "80", "--", *RUN]) == 0
    printed = capsys.readouterr().out
    stages, roles = predicted(RUN, 4)
    assert printed.startswith("gpt-1.3b: tp 1 x pp 2 x dp 2, micro-batch 4 (8 a step per")
    for stage in stages:
        row = f"| {stage['pp_rank']} | {stage['parameters'] / 2**30:.2f} | "
        assert row in printed and f"| {stage['total'] / 2**30:.2f} | " in printed
    assert "fits 80 GiB" in printed
    assert f"FP8 delayed layer, {sum(roles.values()) / 2**20:.1f}: norms" in printed
    assert "log_sum_exp" in printed and "silu_gate" not in printed  # roles of 0 bytes left out


def test_lean_optimizer_states_show_in_the_optimizer_column(capsys):
    lean = ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--store-param-remainders"]
    default, _ = predicted(RUN, 2)
    memory_report.main(["--gpus", "2", "--gpu-memory", "1", "--", *RUN, *lean])
    printed = capsys.readouterr().out
    lean_stages, _ = predicted(RUN + lean, 2)
    assert lean_stages[0]["optimizer"] == pytest.approx(default[0]["optimizer"] / 2)
    assert f"| {lean_stages[0]['optimizer'] / 2**30:.2f} |" in printed
    assert "does not fit 1 GiB" in printed


def test_flags_the_trainer_refuses_are_said_so(capsys):
    assert memory_report.main(["--gpus", "3", "--", *RUN]) == 2
    assert "the trainer would refuse these flags" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        memory_report.main(["--gpus", "2"])  # no trainer flags
