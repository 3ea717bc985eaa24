"""The example scripts as a user runs them: the quickstart run again in the same folder resumes
(one metrics file, one run); a GPU recipe on a machine without a GPU stops at once and says why;
a bad flag or size is the trainer's one line and exit status 2, before anything is prepared or launched."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(script, **env):
    # `python` and `torchrun` in the scripts must be this interpreter's (the one with megafp8 installed).
    env = {
        **os.environ,
        **env,
        "OMP_NUM_THREADS": "1",
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
    }
    return subprocess.run(["bash", str(EXAMPLES / script)], env=env, capture_output=True, text=True)


def quickstart(workdir, iterations):
    done = example("quickstart.sh", WORKDIR=str(workdir), ITERS=str(iterations))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_running_the_quickstart_again_resumes_it(tmp_path):
    first = quickstart(tmp_path, 3)
    assert "starting from scratch" in first and "run summary:" in first
    assert "nothing to do: the checkpoint in" in (again := quickstart(tmp_path, 3))
    assert (
        "is at iteration 3 and ITERS is 3; set a larger ITERS" in again
        and "--train-iters" not in again
    )
    more = quickstart(tmp_path, 5)
    assert "loaded" in more and "at iteration 3" in more
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text() == "5"
    records = [
        json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["iteration"] for r in records if "loss" in r] == [3, 5]  # one run, not two
    # nothing was moved aside: it is the same run
    assert not list(checkpoints.glob("metrics.*.jsonl"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
@pytest.mark.parametrize(
    "recipe,model",
    [("pretrain_gpt_1b_fp8.sh", "gpt-1.3b"), ("pretrain_llama2_7b_fp8.sh", "llama2-7b")],
)
def test_a_gpu_recipe_without_a_gpu_stops_at_once_and_says_what_to_do(tmp_path, recipe, model):
    done = example(recipe, WORKDIR=str(tmp_path / "run"))
    assert done.returncode == 1
    assert (
        f"{model} needs NVIDIA GPUs" in done.stderr
        and "quickstart.sh" in done.stderr
        and "CPU=1" in done.stderr
    )
    assert not (tmp_path / "run").exists()  # before preparing any data


# the study's recipes group
CANDIDATE_RECIPES = ("fp8_delayed_h1", "fp8_rowwise", "fp8_blockwise")
CANDIDATE_DEFAULTS = ("fp8_delayed", "fp8_delayed_h1", "fp8_current")


def test_the_convergence_study_runs_resumes_and_reports(tmp_path):
    """examples/convergence_study.sh shrunk for a CPU: every group's runs listed with their settings;
    a corpus of this repository's packages and scripts, its tokenizer, the GPT group (bf16, FP8
    delayed, FP8 current), one run of the 2x-LR group and GPT's two runs of the seed group; run
    again, it keeps what is done; with too little time left it starts nothing and says so. (Each
    invocation costs seconds before any run: torch imported, a plot per group.)"""
    repo = EXAMPLES.parent
    tiny = dict(
        CPU="1",
        ITERS="4",
        SENS_ITERS="2",
        SEQ="64",
        MBS="2",
        GBS="4",
        EVAL_INTERVAL="2",
        EVAL_ITERS="1",
        LOG_INTERVAL="1",
        VOCAB="512",
        RECIPE_ITERS="2",
        RECIPE_GBS="4",
        RECIPE_SEQ="64",
        RECIPE_MBS="2",
        CORPUS_ROOTS=f"{repo / 'megafp8'} {repo / 'tools'}",
        CORPUS_SOURCES=f"{repo / 'examples'} {tmp_path / 'absent'}",  # shell scripts; absent: skipped
        MODEL_ARGS="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
        "--ffn-hidden-size 128",
    )

    def study(*groups, workdir=tmp_path, **env):
        return subprocess.run(
            ["bash", str(EXAMPLES / "convergence_study.sh"), str(workdir), *groups],
            env={
                **os.environ,
                **tiny,
                **env,
                "OMP_NUM_THREADS": "1",
                "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
            },
            capture_output=True,
            text=True,
        )

    listed = study("list", workdir=tmp_path / "listed")
    assert listed.returncode == 0, listed.stderr
    precisions = [(p, p, 1234, 1234) for p in ("bf16", "fp8_delayed", "fp8_current")]
    with_yardsticks = [
        ("bf16", "bf16", 1234, 1234),
        ("fp8_delayed", "fp8_delayed", 1234, 1234),
        ("bf16_seed1235", "bf16", 1235, 1235),
        ("bf16_init1235", "bf16", 1235, 1234),
        ("fp8_delayed_init1235", "fp8_delayed", 1235, 1234),
    ]
    groups = [
        ("gpt", "gpt-125m", "6e-4", 4, precisions),
        ("llama", "llama-120m", "6e-4", 4, precisions),
        ("lr2x", "llama-120m", "0.0012", 2, with_yardsticks),
        ("lr4x", "llama-120m", "0.0024", 2, with_yardsticks),
    ]
    seed_runs = [
        (f"{model}_bf16{init}", preset, "bf16", 1235, data_seed)
        for model, preset in (("gpt", "gpt-125m"), ("llama", "llama-120m"))
        for init, data_seed in (("", 1235), ("_init", 1234))
    ]
    assert listed.stdout.splitlines() == [
        f"{group}/{run} ({model}, {precision}, peak LR {lr}, {iterations} iterations, "
        f"seed {seed}, data seed {data_seed})"
        for group, model, lr, iterations, group_runs in groups
        for run, precision, seed, data_seed in group_runs
    ] + [
        f"seed/{run} ({preset}, {precision}, peak LR 6e-4, 4 iterations, seed {seed}, "
        f"data seed {data_seed})"
        for run, preset, precision, seed, data_seed in seed_runs
    ] + [
        f"lean/fp8_delayed_{states} (gpt-125m, fp8_delayed_{states}, peak LR 6e-4, 4 iterations, "
        "seed 1234, data seed 1234)"
        for states in ("bf16_moments", "fp8_exp_avg", "bf16_grads")
    ] + [
        f"recipes/{model}_{recipe} ({preset}, {recipe}, peak LR 6e-4, 4 iterations, seed 1234, "
        "data seed 1234)"
        for model, preset in (("gpt", "gpt-125m"), ("llama", "llama-120m"))
        for recipe in CANDIDATE_RECIPES
    ] + [
        f"recipes2x/{recipe} (llama-120m, {recipe}, peak LR 0.0012, 2 iterations, seed 1234, "
        "data seed 1234)"
        for recipe in CANDIDATE_RECIPES
    ] + [
        f"defaults/{model}_{p}_init1235 ({preset}, {p}, peak LR 6e-4, 4 iterations, seed 1235, "
        "data seed 1234)"
        for model, preset in (("gpt", "gpt-125m"), ("llama", "llama-120m"))
        for p in CANDIDATE_DEFAULTS
    ] + [
        f"defaults/gpt2x_{p}{init} (gpt-125m, {p}, peak LR 0.0012, 2 iterations, seed {seed}, "
        "data seed 1234)"
        for p in ("bf16", *CANDIDATE_DEFAULTS)
        for init, seed in (("", 1234), ("_init1235", 1235))
    ] + [
        f"defaults/llama2x_{run} (llama-120m, {p}, peak LR 0.0012, 2 iterations, seed {seed}, "
        "data seed 1234)"
        for run, p, seed in (
            ("fp8_delayed_h1_init1235", "fp8_delayed_h1", 1235),
            ("fp8_current", "fp8_current", 1234),
            ("fp8_current_init1235", "fp8_current", 1235),
        )
    ] + [
        f"recipe1b/{p} (gpt-1.3b, {p}, peak LR 2e-4, 2 iterations, seed 1234, data seed 1234)"
        for p in ("bf16", *CANDIDATE_DEFAULTS)
    ]
    assert not (tmp_path / "listed").exists()  # listing creates nothing

    # The seed group's runs in the same invocation: they run after the gpt group, whose bf16 run
    # their report sets beside its own.
    trained = (
        "gpt",
        "lr2x/fp8_delayed",
        "seed/gpt_bf16",
        "seed/gpt_bf16_init",
        "recipes/gpt_fp8_rowwise",
        "defaults/gpt_fp8_current_init1235",
        "defaults/gpt_fp8_delayed_init1235",
        "recipes/gpt_fp8_delayed_h1",
        "defaults/gpt_fp8_delayed_h1_init1235",
        "recipe1b/bf16",
        "recipe1b/fp8_delayed_h1",
    )
    # two at a time, each line a run prints prefixed with its name
    done = study(*trained, RUNS_AT_ONCE="2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[lr2x/fp8_delayed] convergence_study: lr2x/fp8_delayed (llama-120m" in done.stdout
    runs = {f"gpt/{p}": 4 for p in ("bf16", "fp8_delayed", "fp8_current")} | {
        "lr2x/fp8_delayed": 2,
        "seed/gpt_bf16": 4,
        "seed/gpt_bf16_init": 4,
        "recipes/gpt_fp8_rowwise": 4,
        "defaults/gpt_fp8_current_init1235": 4,
        "defaults/gpt_fp8_delayed_init1235": 4,
        "recipes/gpt_fp8_delayed_h1": 4,
        "defaults/gpt_fp8_delayed_h1_init1235": 4,
        "recipe1b/bf16": 2,
        "recipe1b/fp8_delayed_h1": 2,
    }
    for name, iterations in runs.items():
        records = [
            json.loads(line)
            for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        ]
        assert [r["iteration"] for r in records if "valid_loss" in r] == list(
            range(2, iterations + 1, 2)
        )
        assert (records[0].get("fp8_saturation") is not None) == ("fp8" in name)
        # per-layer health: lr groups' FP8
        assert ("fp8_layers" in records[0]) == name.startswith("lr2x/fp8")
    assert sorted(
        p.relative_to(tmp_path / "runs").as_posix() for p in (tmp_path / "runs").glob("*/*")
    ) == sorted(runs)
    assert (
        "lr2x/fp8_delayed (llama-120m, fp8_delayed, peak LR 0.0012, 2 iterations, seed 1234, "
        "data seed 1234)" in done.stdout
    )
    table = (tmp_path / "report" / "gpt.md").read_text().splitlines()
    assert [row.split(" | ")[0] for row in table[2:]] == [
        "| bf16",
        "| fp8_delayed",
        "| fp8_current",
    ]
    # the training losses along the run, from the end of the warm-up (a tenth of 4 iterations: 1)
    assert table[0].endswith("| training loss vs bf16 from iteration 1 (mean, largest) |")
    assert (tmp_path / "report" / "lr2x.png").read_bytes().startswith(b"\x89PNG")
    table = (tmp_path / "report" / "lr2x.md").read_text().splitlines()  # the one run trained
    assert [row.split(" | ")[0] for row in table[2:]] == ["| fp8_delayed"]
    assert not (tmp_path / "report" / "llama.md").exists()  # no run of that group yet
    table = (tmp_path / "report" / "recipes_gpt.md").read_text().splitlines()  # beside gpt's
    assert [row.split(" | ")[0] for row in table[2:]] == [
        "| bf16",
        "| fp8_delayed",
        "| delayed_h1",
        "| rowwise",
    ]
    # the candidate defaults from two initialisations, each labelled by its scaling and seed, and
    # each candidate's mean over its two against bf16's
    per_run, means = (tmp_path / "report" / "defaults_gpt.md").read_text().split("\n\n", 1)
    assert [row.split(" | ")[0] for row in per_run.splitlines()[2:]] == [
        f"| {label}{seed}"
        for label in ("bf16", "delayed h1024", "delayed h1", "current")
        for seed in ("", ", seed 1235")
    ]
    assert means.startswith("Each setting over its 2 runs, against bf16's:")
    assert [row.split(" | ")[0] for row in means.splitlines()[4:]] == [
        "| bf16",
        "| delayed h1024",
        "| delayed h1",
        "| current",
    ]
    # at 2x the rate one of the Llama's eight runs: the means wait for the rest
    table = (tmp_path / "report" / "defaults2x_llama.md").read_text()
    assert "| delayed h1024 |" in table and "Each setting" not in table
    # the shipped GPT-1.3B recipe (shrunk), its runs beside its bf16 one from a fifth of the run on
    table = (tmp_path / "report" / "recipe1b.md").read_text().splitlines()
    assert [row.split(" | ")[0] for row in table[2:]] == ["| bf16", "| delayed h1"]
    assert table[0].endswith("| training loss vs bf16 from iteration 1 (mean, largest) |")
    assert "by examples/pretrain_gpt_1b_fp8.sh" in done.stdout
    (saved,) = (tmp_path / "runs" / "recipe1b" / "fp8_delayed_h1").glob("iter_*/megafp8.json")
    recipe_args = json.loads(saved.read_text())["args"]
    assert {k: recipe_args[k] for k in ("fp8_amax_history_len", "global_batch_size", "lr")} == {
        "fp8_amax_history_len": 1,  # the candidate's history, not the recipe's 1024
        "global_batch_size": 4,
        "lr": 2e-4,
    }
    assert f"--sources {repo / 'examples'} from" in (tmp_path / "corpus" / "README.txt").read_text()

    again = study(*trained)
    assert again.returncode == 0 and "starting from scratch" not in again.stdout
    assert (
        again.stdout.count("(finished)") == len(runs)
        and "kept" in again.stdout
        and "tokenizer" in again.stdout
    )

    # The report alone, from the runs' metrics (as copied from a GPU machine): no data step, no GPU
    (tmp_path / "report" / "gpt.md").unlink()
    redrawn = study("report", CPU="0")
    assert redrawn.returncode == 0, redrawn.stderr
    assert "kept" not in redrawn.stdout and (tmp_path / "report" / "gpt.md").exists()

    # The seed group: GPT's bf16 run again from the next seed, with its data order and with the
    # first run's (--data-seed), set beside the first (run above).
    table = (tmp_path / "report" / "seed_gpt.md").read_text().splitlines()
    assert [row.split(" | ")[0] for row in table[2:]] == [
        "| seed 1234",
        "| seed 1235",
        "| seed 1235, same data",
    ]
    assert not (tmp_path / "report" / "seed_llama.md").exists()
    first, second = (
        json.loads((tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()[0])["loss"]
        for name in ("gpt/bf16", "seed/gpt_bf16")
    )
    assert first != second

    # Less than the two minutes a run is given at least. In a folder of its own on the data made
    # above: no earlier runs, so no reports to plot again.
    data, elsewhere = tmp_path / "data", tmp_path / "short"
    short = study(
        "lr4x",
        workdir=elsewhere,
        MINUTES="1",
        TRAIN_DATA=str(data / "train_text_document"),
        VALID_DATA=str(data / "validation_text_document"),
        TOKENIZER_MODEL=str(tmp_path / "tokenizer"),
    )
    assert short.returncode == 3 and "run the same command again to go on" in short.stdout
    assert not (elsewhere / "runs" / "lr4x").exists() and not (tmp_path / "runs" / "lr4x").exists()

    # A failed run stops the study: the other slot finishes what it holds and starts nothing more.
    failed = study(
        "gpt",
        workdir=elsewhere,
        RUNS_AT_ONCE="2",
        MODEL_ARGS="--num-layers 0",
        TRAIN_DATA=str(data / "train_text_document"),
        VALID_DATA=str(data / "validation_text_document"),
        TOKENIZER_MODEL=str(tmp_path / "tokenizer"),
    )
    assert (
        failed.returncode == 2
        and "[gpt/bf16] megafp8-train: error: argument --num-layers" in failed.stderr
    )
    assert "gpt/fp8_current" not in failed.stdout + failed.stderr

    uneven = study("list", RUNS_AT_ONCE="3", GPUS="2")
    assert uneven.returncode == 2 and "RUNS_AT_ONCE=3 does not share 2 device(s)" in uneven.stderr

    unknown = study("gtp")
    assert unknown.returncode == 2 and "unknown group 'gtp'" in unknown.stderr
    unknown = study("lr2x/fp8")
    assert (
        unknown.returncode == 2
        and "unknown run 'lr2x/fp8' (group lr2x has: lr2x/bf16 " in unknown.stderr
    )
    not_minutes = study("gpt", MINUTES="soon")
    assert (
        not_minutes.returncode == 2
        and "MINUTES=soon is not a positive number" in not_minutes.stderr
    )


@pytest.mark.parametrize(
    "script,env,error",
    [
        (
            "pretrain_gpt_1b_fp8.sh",
            dict(EXTRA_ARGS="--no-such-flag"),
            "megafp8-train: error: unknown flag --no-such-flag; see --help for the flags\n",
        ),
        # The check sees the world size the script launches: GPUS, NPROC.
        (
            "pretrain_llama2_7b_fp8.sh",
            dict(GPUS="6", PP="4"),
            "megafp8-train: error: --tensor-model-parallel-size 1 x --pipeline-model-parallel-size 4 = 4 does not divide "
            "the world size 6; choose sizes whose product divides the number of GPUs\n",
        ),
        # the fine-grained recipes in E4M3, the format FP8_FORMAT overrides
        (
            "pretrain_gpt_1b_fp8.sh",
            dict(FP8_RECIPE="blockwise", FP8_FORMAT="e5m2"),
            "megafp8-train: error: argument --fp8-format: invalid choice: 'e5m2'",
        ),
        (
            "quickstart.sh",
            dict(NPROC="3"),
            "megafp8-train: error: --global-batch-size 16 is not divisible by ",
        ),
        (
            "quickstart.sh",
            dict(ITERS="0"),
            "quickstart.sh: ITERS=0: give the number of training iterations ",
        ),
    ],
)
def test_a_bad_flag_is_one_line_and_status_2_before_anything_runs(tmp_path, script, env, error):
    done = example(script, CPU="1", WORKDIR=str(tmp_path / "run"), **env)
    assert done.returncode == 2, done.stdout + done.stderr
    # no torchrun report after it
    assert done.stderr.startswith(error) and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "run").exists()  # nothing prepared, nothing launched
