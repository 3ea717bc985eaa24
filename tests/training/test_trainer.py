"""The pretraining job end to end on the CPU: the loss falls on the sample corpus, data
parallelism and the distributed optimizer match one process, resume is exact, SIGTERM saves,
non-finite steps are skipped then abort, bad flags fail at start-up."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from megafp8.parallel import check_embeddings_in_sync

from megafp8.fp8 import Fp8Linear
from megafp8.training import arguments, checkpointing, trainer
from megafp8.training.checkpointing import CheckpointError
from megafp8.training.flags import LEAN_OPTIMIZER_STATES
from megafp8.training.trainer import NonFiniteError, pretrain

from ..multiprocess import run_on_ranks

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--model",
    "gpt-tiny",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
    "--lr-warmup-iters",
    "2",
    "--log-interval",
    "1",
    "--seed",
    "7",
    "--mock-data",
]

# gpt-tiny widened so that every GEMM of a layer splits into blocks of 128 at tp 1 and 2, with
# 128 tokens a micro-batch
BLOCKWISE_SHAPE = ["--hidden-size", "256", "--ffn-hidden-size", "1024", "--seq-length", "64"]


def losses_of(rank, world_size, argv):
    trainer = pretrain(argv)
    return trainer.history


def several_runs(rank, world_size, jobs):
    """Several runs in one launch, each `(body, args)` in turn; their results in order. A launch
    costs every rank a fresh interpreter (torch and megafp8 imported again: seconds per rank on a
    2-core CI machine), so runs of one size share it; each pretrain() builds its own groups."""
    return [body(rank, world_size, *args) for body, args in jobs]


def launch(world_size, jobs):
    """The named runs {name: (body, args)} in one launch: {name: each rank's result}."""
    per_rank = run_on_ranks(several_runs, world_size, list(jobs.values()))
    return {name: [runs[i] for runs in per_rank] for i, name in enumerate(jobs)}


def test_loss_falls_on_the_sample_corpus(tmp_path):
    def run(*cmd):
        return subprocess.run([sys.executable, *cmd], check=True, cwd=REPO, capture_output=True)

    run("tools/make_sample_corpus.py", "--output", str(tmp_path / "corpus"), "--max-mb", "0.3")
    run(
        "tools/train_tokenizer.py",
        "--input",
        str(tmp_path / "corpus"),
        "--type",
        "bpe",
        "--vocab-size",
        "512",
        "--output",
        str(tmp_path / "tok"),
    )
    run(
        "tools/preprocess_data.py",
        "--input",
        str(tmp_path / "corpus"),
        "--output-prefix",
        str(tmp_path / "ds"),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tmp_path / "tok"),
        "--append-eod",
    )
    trainer = pretrain(
        [
            "--model",
            "gpt-tiny",
            "--seq-length",
            "64",
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "8",
            "--train-iters",
            "40",
            "--lr",
            "1e-2",
            "--lr-warmup-iters",
            "5",
            "--fp8-format",
            "hybrid",
            "--data-path",
            str(tmp_path / "ds_text_document"),
            "--split",
            "95,5,0",
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            str(tmp_path / "tok"),
            "--log-interval",
            "10",
            "--eval-interval",
            "20",
            "--eval-iters",
            "1",
            "--save",
            str(tmp_path / "run"),
        ]
    )
    losses = [loss for _, loss in trainer.history]
    assert losses[0] == pytest.approx(math.log(512), abs=0.1)  # a uniform guess at the start
    assert sum(losses[-5:]) / 5 < losses[0] - 0.75, losses
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["iteration"] for r in records if "lm_loss" in r or "loss" in r] == [10, 20, 30, 40]
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "40"


@pytest.fixture(scope="module")
def one_process():
    return run_on_ranks(losses_of, 1, TINY + ["--train-iters", "4"])[0]


DATA_PARALLEL = {
    "dp2": [],
    "distributed-optimizer": ["--use-distributed-optimizer"],
    "overlap-param-gather": ["--use-distributed-optimizer", "--overlap-param-gather"],
}


@pytest.fixture(scope="module")
def data_parallel_runs():
    """{variant: each rank's history}, the three variants in one 2-rank launch."""
    argv = TINY + ["--train-iters", "4"]
    return launch(2, {name: (losses_of, (argv + extra,)) for name, extra in DATA_PARALLEL.items()})


@pytest.mark.parametrize("variant", DATA_PARALLEL)
def test_data_parallel_matches_one_process(one_process, data_parallel_runs, variant):
    for history in data_parallel_runs[variant]:
        assert [i for i, _ in history] == [i for i, _ in one_process]
        for (_, a), (_, b) in zip(history, one_process):
            assert a == pytest.approx(b, rel=2e-5)


def test_overlapped_param_gather_trains_as_the_gather_at_once():
    """--overlap-param-gather with buckets smaller than a layer: each part of the forward waits
    for its own buckets as it reaches them (the untied output layer's last), bit for bit the run
    that gathers everything right after the step."""
    argv = TINY + [
        "--train-iters",
        "3",
        "--use-distributed-optimizer",
        "--ddp-bucket-size",
        "5000",
        "--untie-embeddings-and-output-weights",
    ]
    # Both runs in one launch: [(plain, overlapped)] per rank.
    for plain, overlapped in run_on_ranks(
        several_runs, 2, [(losses_of, (argv,)), (losses_of, (argv + ["--overlap-param-gather"],))]
    ):
        assert overlapped == plain


@pytest.mark.parametrize(
    "world, extra",
    [
        (1, ["--fp8-format", "hybrid"]),
        (
            1,
            [
                "--fp8-format",
                "hybrid",
                "--fp8-recipe",
                "current",
                "--recompute-granularity",
                "selective",
            ],
        ),
        (2, ["--fp8-format", "hybrid", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ],
)
def test_compiled_layers_train_as_eager_ones(world, extra):
    """--torch-compile compiles the glue between the FP8 linears: the losses are the eager run's
    to fp32 rounding (fused kernels round norms differently in the last bit, and an FP8 cast
    can then flip a value at a rounding boundary: 4e-5 measured)."""
    argv = TINY + ["--train-iters", "3"] + extra
    # Both runs in one launch: [(eager, compiled)] per rank.
    for reference, history in run_on_ranks(
        several_runs, world, [(losses_of, (argv,)), (losses_of, (argv + ["--torch-compile"],))]
    ):
        assert [loss for _, loss in history] == pytest.approx(
            [loss for _, loss in reference], rel=1e-4
        )


@pytest.mark.parametrize(
    "precision",
    [["--fp8-format", "hybrid"], ["--fp8-format", "hybrid", "--fp8-recipe", "current"], []],
    ids=["delayed", "current", "high-precision"],
)
def test_overlapped_tensor_parallel_collectives_train_as_the_plain_ones(precision):
    """--tp-comm-overlap: the linears' gathers and reduce-scatters in blocks beside their GEMMs
    (a ring of partial sums for the reduce-scatter). The row-parallel bias enters the sum in
    the GEMM of the rank's own block instead of after it: the same terms added in another
    order, so the plain run's losses to rounding."""
    argv = TINY + [
        "--train-iters",
        "3",
        *precision,
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ]
    # Both runs in one launch; the overlapped run's transport shows that its flag took effect.
    for plain, (overlapped, transport) in run_on_ranks(
        several_runs,
        2,
        [(losses_of, (argv,)), (history_and_transport, (argv + ["--tp-comm-overlap"],))],
    ):
        assert transport == "nccl"
        assert [step for step, _ in overlapped] == [step for step, _ in plain]
        assert [loss for _, loss in overlapped] == pytest.approx(
            [loss for _, loss in plain], rel=1e-5
        )


def history_and_transport(rank, world_size, argv):
    trainer = pretrain(argv)
    return trainer.history, trainer.tp_comm_transport


def transport_body(rank, world_size, argv):
    chosen = pretrain(argv).tp_comm_transport
    try:
        pretrain(argv + ["--tp-comm-overlap-transport", "copy-engine"])
        refused = None
    except arguments.ArgumentsError as error:
        refused = str(error)
    return chosen, refused


def test_tp_comm_overlap_takes_nccl_where_copy_engines_cannot_run():
    """auto keeps NCCL (here gloo) where the GPUs cannot share memory; copy-engine asked for there
    stops the run at start with the reason."""
    argv = TINY + [
        "--train-iters",
        "3",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--tp-comm-overlap",
    ]
    for chosen, refused in run_on_ranks(transport_body, 2, argv):
        assert chosen == "nccl"
        assert refused.startswith(
            "--tp-comm-overlap-transport copy-engine: copy engines need CUDA GPUs"
        )
        assert refused.endswith("give nccl or auto")


def resume_body(rank, world_size, argv, save):
    straight = pretrain(argv + ["--train-iters", "6"]).history
    first = pretrain(argv + ["--train-iters", "6", "--save", save, "--exit-interval", "3"]).history
    second = pretrain(argv + ["--train-iters", "6", "--save", save, "--load", save]).history
    return straight, first, second


# With dropout, so that the RNG state must be restored, and restored last, for the test to pass.
@pytest.mark.parametrize(
    "extra",
    [
        ["--fp8-format", "hybrid"],
        ["--fp8-format", "hybrid", "--fp8-recipe", "current"],
        ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
        ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", *BLOCKWISE_SHAPE],
    ],
)
def test_resume_is_bitwise_exact(tmp_path, extra):
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    straight, first, second = run_on_ranks(resume_body, 1, TINY + dropout + extra, str(tmp_path))[0]
    assert [i for i, _ in first] == [1, 2, 3] and [i for i, _ in second] == [4, 5, 6]
    assert first + second == straight  # bitwise: FP8 state, Adam moments, data position, RNG


# every lean state, the first moment in its leanest: FP8
LEAN_STATES = ["--bf16", *LEAN_OPTIMIZER_STATES, "--exp-avg-dtype", "fp8"]


def test_lean_optimizer_states_resume_bitwise_and_on_another_layout(tmp_path, monkeypatch):
    """Every lean state on (in Triton's interpreter, the fused pass that keeps them): a resumed
    run is the straight one bit for bit, and the same checkpoint resumes with the distributed
    optimizer over two data-parallel ranks, or with fp32 states, as the same run up to their
    rounding."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = TINY + LEAN_STATES
    straight, first, second = run_on_ranks(resume_body, 1, argv, str(tmp_path))[0]
    assert [i for i, _ in first] == [1, 2, 3] and first + second == straight
    resume = ["--train-iters", "8", "--load", str(tmp_path)]
    lean = run_on_ranks(reshard_body, 1, argv + resume)[0]
    dp2 = run_on_ranks(reshard_body, 2, argv + resume + ["--use-distributed-optimizer"])[0]
    fp32_states = run_on_ranks(reshard_body, 1, TINY + ["--bf16"] + resume)[0]
    assert [i for i, _ in lean] == [7, 8]
    for other in (dp2, fp32_states):
        assert [i for i, _ in other] == [7, 8]
        assert [loss for _, loss in other] == pytest.approx([loss for _, loss in lean], rel=1e-5)


def test_lean_optimizer_states_are_refused_without_the_fused_pass(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("the fused pass runs here")
    with pytest.raises(
        arguments.ArgumentsError,
        match="--exp-avg-dtype bf16, --store-param-remainders: lean optimizer states are kept by "
        "the fused optimizer pass",
    ):
        pretrain(
            TINY
            + [
                "--train-iters",
                "3",
                "--bf16",
                "--exp-avg-dtype",
                "bf16",
                "--store-param-remainders",
            ]
        )


@pytest.mark.parametrize("chosen", [None, "4096"])
def test_runs_use_cublaslt_without_workspace_unless_the_user_chose_one(monkeypatch, chosen):
    if chosen is None:
        monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    else:
        monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", chosen)
    pretrain(TINY + ["--train-iters", "3"])
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == (chosen or "0")


def test_a_run_resumes_from_its_checkpoint_without_shape_flags(tmp_path):
    """The checkpoint records the model: --load of it needs no --model and no shape flags."""
    shape = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--num-query-groups",
        "2",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--vocab-size",
        "300",
    ]
    run = [
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--lr",
        "3e-3",
        "--mock-data",
        "--eval-iters",
        "0",
        "--save",
        str(tmp_path),
    ]
    first = pretrain(shape + run + ["--train-iters", "2"])
    resumed = pretrain(run + ["--train-iters", "3", "--load", str(tmp_path)])
    assert [i for i, _ in resumed.history] == [3]
    assert (
        resumed.config
        == first.config
        == checkpointing.saved_model_config(tmp_path / "iter_0000002")
    )
    # Its own record still describes the model in flags (and the mock vocabulary is the model's).
    recorded = checkpointing.checkpoint_info(tmp_path / "iter_0000003")
    assert recorded["model"] == first.config.to_dict()
    args = recorded["args"]
    assert (args["num_layers"], args["num_query_groups"], args["swiglu"], args["vocab_size"]) == (
        2,
        2,
        True,
        300,
    )


def test_a_vocabulary_other_than_the_checkpoints_is_refused(tmp_path, monkeypatch):
    hash_file = checkpointing._file_checksum
    monkeypatch.setattr(
        checkpointing, "_file_checksum", lambda *a, **k: time.sleep(0.5) or hash_file(*a, **k)
    )
    pretrain(TINY + ["--train-iters", "3", "--save", str(tmp_path)])  # gpt-tiny: 1000 tokens
    checkpoint = tmp_path / "iter_0000003"
    # The last save's checksums, however slow, are recorded before pretrain returns: hashing them
    # at interpreter exit could no longer start its threads.
    assert (checkpoint / checkpointing.CHECKSUMS / "rank_00000.json").exists()
    with pytest.raises(
        CheckpointError,
        match=rf"the tokenizer \(NullTokenizer\) has 500 tokens, but the model in "
        rf"{checkpoint} has a vocabulary of 1000: give the tokenizer it was",
    ):
        pretrain(
            TINY
            + [
                "--train-iters",
                "4",
                "--load",
                str(tmp_path),
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "500",
            ]
        )
    with pytest.raises(
        CheckpointError,
        match=rf"--vocab-size is 500, but the model in {checkpoint} has a "
        "vocabulary of 1000",
    ):
        pretrain(TINY + ["--train-iters", "4", "--load", str(tmp_path), "--vocab-size", "500"])


def test_a_save_folder_of_another_run_is_never_written_over(tmp_path, capsys):
    argv = TINY + ["--train-iters", "3", "--save", str(tmp_path)]
    pretrain(argv)
    before = sorted(p.name for p in tmp_path.iterdir())
    for extra, why in (
        ([], "this new run would write over them"),
        (["--load", str(tmp_path), "--finetune"], "--finetune starts a new run"),
        (["--load", str(tmp_path / "elsewhere")], "no such folder"),
    ):
        with pytest.raises(CheckpointError, match=why):
            pretrain(argv + extra)
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing touched
    with pytest.raises(
        CheckpointError, match=f"To resume that run, add --load {tmp_path}.*--overwrite-save"
    ):
        pretrain(argv)
    # Resuming the run in that folder is what --save of it is for.
    assert (
        pretrain(
            TINY + ["--train-iters", "4", "--save", str(tmp_path), "--load", str(tmp_path)]
        ).iteration
        == 4
    )
    # --overwrite-save: the earlier run's checkpoints go once the new run has saved its own (its
    # iteration 3 replaces the earlier run's).
    pretrain(argv + ["--overwrite-save"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000003"
    ]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_load_of_a_missing_folder_is_a_typo_unless_it_is_also_save(tmp_path, capsys):
    with pytest.raises(CheckpointError, match="--load .*nope: no such folder"):
        pretrain(TINY + ["--train-iters", "3", "--load", str(tmp_path / "nope")])
    # A job that resumes itself passes --save X --load X from its first launch on (Megatron's habit).
    run = tmp_path / "run"
    assert (
        pretrain(TINY + ["--train-iters", "3", "--save", str(run), "--load", str(run)]).iteration
        == 3
    )
    (tmp_path / "empty").mkdir()
    assert pretrain(TINY + ["--train-iters", "3", "--load", str(tmp_path / "empty")]).iteration == 3
    assert "no checkpoint in" in capsys.readouterr().out


def test_resuming_says_what_changed_and_when_there_is_nothing_to_do(tmp_path, capsys):
    argv = TINY + ["--save", str(tmp_path), "--load", str(tmp_path)]
    pretrain(argv + ["--train-iters", "3"])
    capsys.readouterr()
    assert pretrain(argv + ["--train-iters", "3"]).history == []
    assert (
        "nothing to do: the checkpoint is at iteration 3 and --train-iters is 3"
        in capsys.readouterr().out
    )
    pretrain(argv + ["--train-iters", "4"])
    out = capsys.readouterr().out
    assert "another learning-rate schedule" in out and "--train-iters 3 -> 4" in out
    assert "give --lr-decay-iters 3" in out
    assert "run summary:" in out and "iterations: 1 (4 to 4)" in out and "data-seed" not in out
    # --data-seed follows --seed
    pretrain(argv + ["--train-iters", "5", "--lr-decay-iters", "3", "--seed", "8"])
    assert "give --data-seed 7" in capsys.readouterr().out


def test_keep_last_checkpoints_deletes_the_older_ones_once_the_newest_is_saved(tmp_path):
    argv = TINY + [
        "--save",
        str(tmp_path),
        "--load",
        str(tmp_path),
        "--save-interval",
        "1",
        "--keep-last-checkpoints",
        "2",
    ]
    pretrain(argv + ["--train-iters", "4"])
    assert checkpointing.saved_iterations(tmp_path) == [3, 4]
    resumed = pretrain(
        argv + ["--train-iters", "5", "--lr-decay-iters", "4", "--lr-warmup-iters", "2"]
    )
    assert resumed.history[0][0] == 5  # resumed from iteration 4, which was kept
    assert checkpointing.saved_iterations(tmp_path) == [4, 5]


def test_sigterm_to_the_process_group_saves_a_checkpoint_and_exits_zero(tmp_path):
    # The whole group, data-loading workers (2 by default) included, as a terminal or SLURM signals it;
    # under torchrun: tests/multigpu/test_check_layouts.py.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megafp8.train",
            *TINY,
            "--train-iters",
            "100000",
            "--save",
            str(tmp_path),
            "--fp8-format",
            "hybrid",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while (
        not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline
    ):
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert "on SIGTERM" in output


def stop_votes(rank, world_size):
    """Three steps' answers of the stop vote, twice: rank 0 receives a signal before step 1's
    vote; then rank 1 alone passes its time limit at step 1 (its own clock)."""
    answers = []
    for reason in ("signal", "time"):
        votes = trainer._ExitSignal()
        try:
            answers.append([])
            for step in range(3):
                if reason == "signal" and rank == 0 and step == 1:
                    votes.received = "SIGTERM"
                timed_out = reason == "time" and rank == 1 and step >= 1
                answers[-1].append(votes.any_rank(torch.device("cpu"), timed_out=timed_out))
        finally:
            votes.restore()
    return answers


def test_every_rank_stops_after_the_same_step():
    # Each step's vote is answered at the next step, on every rank alike.
    assert run_on_ranks(stop_votes, 2) == [[[False, False, True]] * 2] * 2


@pytest.mark.gpu
def test_the_stop_vote_never_waits_for_the_gpu(monkeypatch):
    """Each step's vote is posted while the step's update still runs: making it, reducing it and
    answering the previous one must not synchronize with the GPU (torch raises where it would)."""
    monkeypatch.setattr(trainer.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(trainer.dist, "all_reduce", lambda tensor, op=None, group=None: None)
    votes = trainer._ExitSignal()
    busy = torch.randn(4096, 4096, device="cuda")
    try:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        answers = []
        for _ in range(3):
            for _ in range(20):  # the step's work, still queued when the vote is posted
                busy = busy @ busy / 4096
            answers.append(votes.any_rank(torch.device("cuda")))
    finally:
        torch.cuda.set_sync_debug_mode("default")
        votes.restore()
    assert answers == [False, False, False]


def test_a_run_rolled_back_to_an_older_checkpoint_keeps_what_it_saves(tmp_path, capfd):
    save = ["--save", str(tmp_path), "--save-interval", "5"]
    pretrain(TINY + save + ["--train-iters", "10"])
    capfd.readouterr()
    pretrain(
        TINY
        + save
        + [
            "--train-iters",
            "7",
            "--lr-decay-iters",
            "10",
            "--load",
            str(tmp_path / "iter_0000005"),
            "--keep-last-checkpoints",
            "1",
        ]
    )
    assert "deleted the checkpoints of iterations 5, 10" in capfd.readouterr().out
    assert checkpointing.saved_iterations(tmp_path) == [7]
    resumed = pretrain(
        TINY + save + ["--train-iters", "8", "--lr-decay-iters", "10", "--load", str(tmp_path)]
    )
    assert resumed.history[0][0] == 8


def test_a_lost_pointer_resumes_from_the_checkpoint_saved_last(tmp_path, capsys):
    argv = TINY + [
        "--save",
        str(tmp_path),
        "--load",
        str(tmp_path),
        "--save-interval",
        "2",
        "--lr-decay-iters",
        "6",
    ]
    pretrain(argv + ["--train-iters", "4"])
    (tmp_path / checkpointing.LATEST).unlink()
    with pytest.warns(UserWarning, match="resuming from iteration 4, the one saved last"):
        resumed = pretrain(argv + ["--train-iters", "6"])
    assert resumed.history[0][0] == 5


def test_a_second_run_on_a_save_folder_is_refused_before_it_writes(tmp_path):
    with checkpointing.SaveFolderLock(tmp_path):
        with pytest.raises(CheckpointError, match="another run is writing to this folder"):
            pretrain(TINY + ["--train-iters", "3", "--save", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_streak_of_nonfinite_steps_neither_saves_nor_rotates_out_the_finite_checkpoint(
    tmp_path, capfd
):
    pretrain(
        TINY
        + [
            "--train-iters",
            "6",
            "--lr",
            "1e30",
            "--lr-warmup-iters",
            "0",
            "--clip-grad",
            "0",
            "--skip-nonfinite-steps-max",
            "10",
            "--save",
            str(tmp_path),
            "--save-interval",
            "1",
            "--keep-last-checkpoints",
            "1",
        ]
    )
    out = capfd.readouterr().out
    streaks = {
        i: json.loads((checkpointing.iteration_dir(tmp_path, i) / "megafp8.json").read_text())[
            "train"
        ]
        for i in checkpointing.saved_iterations(tmp_path)
    }
    finite = [i for i, train in streaks.items() if train["skipped_in_a_row"] == 0]
    assert finite and 6 in streaks, (streaks, out)  # the last finite one, and the run's end
    assert "checkpoint postponed until a step is finite again" in out
    assert out.count("saved checkpoint") == max(finite) + 1  # none during the streak but at the end


def test_the_distributed_timeout_reaches_the_process_group(monkeypatch):
    from megafp8.training import trainer

    seen = {}
    real = trainer.ParallelGroups.from_torchrun

    def from_torchrun(*args, timeout=None, **kwargs):
        seen["timeout"] = timeout
        return real(*args, timeout=timeout, **kwargs)

    monkeypatch.setattr(trainer.ParallelGroups, "from_torchrun", from_torchrun)
    pretrain(TINY + ["--train-iters", "3", "--distributed-timeout-minutes", "2.5"])
    assert seen["timeout"].total_seconds() == 150


def test_nonfinite_steps_are_skipped_then_abort(tmp_path):
    with pytest.raises(NonFiniteError, match="3 steps in a row"):
        pretrain(
            TINY
            + [
                "--train-iters",
                "20",
                "--lr",
                "1e30",
                "--lr-warmup-iters",
                "0",
                "--clip-grad",
                "0",
                "--skip-nonfinite-steps-max",
                "3",
            ]
        )


def test_under_torchrun_a_configuration_problem_is_said_once_as_a_message(tmp_path):
    # Rank 0 starts late, as it may on a busy host: rank 1 meets the error first, and the launcher
    # stops every rank once one exits, so rank 1 has to wait until rank 0 has said it.
    late_rank_0 = tmp_path / "late_rank_0.py"
    late_rank_0.write_text(
        "import os, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    time.sleep(3)\n"
        "from megafp8.training.trainer import main\n"
        "main()\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(late_rank_0),
            *TINY,
            "--train-iters",
            "3",
            "--sequence-parallel",
            "--global-batch-size",
            "6",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0
    assert done.stderr.count("megafp8-train: warning: --sequence-parallel has no effect") == 1, (
        done.stderr
    )
    assert done.stderr.count("megafp8-train: error: --global-batch-size 6 is not divisible") == 1, (
        done.stderr
    )
    assert (
        "warnings.warn(" not in done.stderr
        and "Traceback" not in done.stderr.split("megafp8-train: error")[0]
    )


def test_bad_flags_fail_at_start_up():
    with pytest.raises(arguments.ArgumentsError, match="--micro-batch-sise"):
        pretrain(TINY + ["--train-iters", "2", "--micro-batch-sise", "2"])
    with pytest.raises(arguments.ArgumentsError, match="--global-batch-size"):
        pretrain(TINY + ["--global-batch-size", "3", "--train-iters", "2"])


def reshard_body(rank, world_size, argv):
    return pretrain(argv).history


def test_a_tp2_run_resumes_with_tp1(tmp_path):
    argv = TINY + ["--fp8-format", "hybrid", "--save", str(tmp_path)]
    tp2 = run_on_ranks(
        reshard_body,
        2,
        argv
        + [
            "--train-iters",
            "4",
            "--tensor-model-parallel-size",
            "2",
            "--global-batch-size",
            "4",
            "--exit-interval",
            "2",
        ],
    )[0]
    resumed = run_on_ranks(
        reshard_body,
        1,
        argv + ["--train-iters", "4", "--global-batch-size", "4", "--load", str(tmp_path)],
    )[0]
    assert [i for i, _ in tp2] == [1, 2] and [i for i, _ in resumed] == [3, 4]
    straight = run_on_ranks(
        reshard_body,
        2,
        TINY
        + [
            "--fp8-format",
            "hybrid",
            "--train-iters",
            "4",
            "--tensor-model-parallel-size",
            "2",
            "--global-batch-size",
            "4",
        ],
    )[0]
    assert resumed[0][1] == pytest.approx(straight[2][1], rel=1e-3)


def fp8_layer_records(rank, world_size, argv, save):
    pretrain(argv + ["--save", f"{save}"])
    metrics = Path(save) / "metrics.jsonl"
    return (
        [json.loads(line) for line in metrics.read_text().splitlines()]
        if rank == world_size - 1
        else None
    )


def last_stage_losses(rank, world_size, argv):
    trainer = pretrain(argv)
    return trainer.history if trainer.groups.is_last_stage else None


def tied_run(rank, world_size, argv):
    """Losses and grad norms of the last stage, and the largest difference between the tied
    embedding's two copies after training (check_embeddings_in_sync raises above 0)."""
    trainer = pretrain(argv)
    difference = check_embeddings_in_sync(trainer.chunks, trainer.groups)
    if not trainer.groups.is_last_stage:
        return None
    return trainer.history, trainer.grad_norms, difference


FP8_LAYERS = TINY + [
    "--num-layers",
    "4",
    "--train-iters",
    "3",
    "--fp8-format",
    "hybrid",
    "--log-fp8-layers",
]
FP8_LAYERS_LAYOUTS = {
    1: [],
    4: [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--pipeline-model-parallel-size",
        "2",
    ],
}

PIPELINE = TINY + ["--num-layers", "4", "--train-iters", "3", "--global-batch-size", "8"]
# name: (ranks, flags)
PIPELINE_LAYOUTS = {
    "pp2-fp8": (2, ["--pipeline-model-parallel-size", "2", "--fp8-format", "hybrid"]),
    "pp2-rowwise": (
        2,
        ["--pipeline-model-parallel-size", "2", "--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
    ),
    "pp2-blockwise": (
        2,
        [
            "--pipeline-model-parallel-size",
            "2",
            "--fp8-format",
            "e4m3",
            "--fp8-recipe",
            "blockwise",
            *BLOCKWISE_SHAPE,
        ],
    ),
    "pp2-vpp": (
        2,
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    ),
    "pp2-uneven": (
        2,
        ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"],
    ),
    # the first stage ends after layer 1's attention, the last begins at its MLP
    "pp2-half-layer": (
        2,
        ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1.5"],
    ),
    # 6 layers over 4 virtual stages: the trainer sizes the first and last apart
    "pp2-vpp2-balanced": (
        2,
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-virtual-stages-per-pipeline-rank",
            "2",
            "--balance-pipeline-split",
            "--num-layers",
            "6",
        ],
    ),
    # every virtual stage's layers given: rank 0's second chunk runs layer 2's MLP to layer 4's attention
    "pp2-vpp2-layout": (
        2,
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-virtual-stages-per-pipeline-rank",
            "2",
            "--pipeline-stage-layers",
            "1",
            "1.5",
            "2",
            "1.5",
            "--num-layers",
            "6",
        ],
    ),
    "tp2xpp2xdp2": (
        8,
        [
            "--pipeline-model-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    ),
}


SHARED_FLAGS = ("--fp8-format", "--fp8-recipe", "--num-layers", *BLOCKWISE_SHAPE[::2])


def one_process_share(extra):
    """What the one process runs too of a layout's flags: the model and its precision."""
    return [
        x for i, x in enumerate(extra) if x in SHARED_FLAGS or i and extra[i - 1] in SHARED_FLAGS
    ]


# Tied embeddings under the distributed optimizer: each dp rank owns one slice of each copy's
# gradient, and the first and last stage must own the same slice for their sum to be right. Small
# buckets give each stage several, laid out differently; the embedding alone spans several.
TIED = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "4",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "1",
    "--lr-decay-style",
    "cosine",
    "--mock-data",
    "--vocab-size",
    "1024",
    "--ddp-bucket-size",
    "20000",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--seed",
    "1234",
]
# name: (ranks, flags)
TIED_LAYOUTS = {
    "pp2xdp2": (4, ["--pipeline-model-parallel-size", "2"]),
    "pp2xdp2-uneven": (
        4,
        ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"],
    ),
    "tp2xpp2xdp2-uneven": (
        8,
        [
            "--pipeline-model-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--decoder-last-pipeline-num-layers",
            "1",
        ],
    ),
    # The last stage's tied embedding is read by its output layer, not its embedding's forward.
    "pp2xdp2-overlap-param-gather": (
        4,
        ["--pipeline-model-parallel-size", "2", "--overlap-param-gather"],
    ),
}

# The layout and options of examples/pretrain_llama2_7b_fp8.sh (RoPE, SwiGLU, untied output,
# selective recomputation, distributed optimizer) at tp2 x pp2 x dp2.
LLAMA = ["llama-tiny" if a == "gpt-tiny" else a for a in TINY] + [
    "--num-layers",
    "4",
    "--train-iters",
    "3",
    "--recompute-granularity",
    "selective",
    "--use-distributed-optimizer",
]
LLAMA_LAYOUT = [
    "--pipeline-model-parallel-size",
    "2",
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
]


def layout_jobs(folder):
    """{name: (ranks, (body, args))}: every run of the layout tests below and the one-process
    runs they are compared with."""
    jobs = {}
    for ranks, extra in FP8_LAYERS_LAYOUTS.items():
        jobs[f"fp8-layers/{ranks}"] = (
            ranks,
            (fp8_layer_records, (FP8_LAYERS + extra, folder / f"fp8-layers-{ranks}")),
        )
    for name, (ranks, extra) in PIPELINE_LAYOUTS.items():
        jobs[f"pipeline/{name}"] = (ranks, (last_stage_losses, (PIPELINE + extra,)))
        shared = one_process_share(extra)  # layouts of the same model share one reference
        jobs[f"pipeline-reference/{' '.join(shared)}"] = (
            1,
            (last_stage_losses, (PIPELINE + shared,)),
        )
    for name, (ranks, layout) in TIED_LAYOUTS.items():
        jobs[f"tied/{name}"] = (
            ranks,
            (tied_run, (TIED + layout + ["--use-distributed-optimizer"],)),
        )
    jobs["tied-reference"] = (1, (tied_run, (TIED,)))
    jobs["llama"] = (8, (last_stage_losses, (LLAMA + LLAMA_LAYOUT,)))
    jobs["llama-reference"] = (1, (last_stage_losses, (LLAMA,)))
    return jobs


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """layout_runs(name): each rank's result of that run of layout_jobs. The runs of one size go
    in one launch, made when a test first asks for one of them (an 8-rank launch alone costs a
    2-core machine half a minute of start-up); a run that fails fails every test of its launch,
    with the failing rank's traceback."""
    jobs, done = layout_jobs(tmp_path_factory.mktemp("layouts")), {}

    def result(name):
        if name not in done:
            ranks = jobs[name][0]
            done.update(launch(ranks, {n: job for n, (r, job) in jobs.items() if r == ranks}))
        return done[name]

    return result


@pytest.mark.parametrize("ranks", FP8_LAYERS_LAYOUTS)
def test_log_fp8_layers_records_every_layer_of_every_stage(layout_runs, ranks):
    records = [r for r in layout_runs(f"fp8-layers/{ranks}") if r is not None][0]
    logged = [r for r in records if "fp8_layers" in r]
    assert [r["iteration"] for r in logged] == [1, 2, 3]
    layers = logged[-1]["fp8_layers"]
    # Every FP8 linear of the four layers, on whichever stage it lives, by its global name.
    assert list(layers) == [
        f"layers.{i}.{name}"
        for i in range(4)
        for name in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2")
    ]
    for layer in layers.values():
        assert set(layer["roles"]) == {"input", "weight", "grad_output"}
        assert 0 <= layer["underflow"] < 0.5 and layer["saturation"] is not None
    assert logged[-1]["fp8_underflow"] is not None


def test_log_fp8_layers_without_fp8_is_refused():
    with pytest.raises(
        arguments.ArgumentsError, match="--log-fp8-layers given without --fp8-format"
    ):
        arguments.parse_args(TINY + ["--log-fp8-layers"])


# FP8 on with pp = 2: each stage's amax group is one rank, as in one process, so the scales
# agree. With dp > 1 the amaxes are maxed over replicas that saw other micro-batches (one
# process sees them in turn), so FP8 scales, and losses, differ beyond this tolerance.
@pytest.mark.parametrize("layout", PIPELINE_LAYOUTS)
def test_pipeline_layouts_match_one_process(layout_runs, layout):
    shared = one_process_share(PIPELINE_LAYOUTS[layout][1])
    reference = layout_runs(f"pipeline-reference/{' '.join(shared)}")[0]
    assert_last_stages_match(layout_runs(f"pipeline/{layout}"), reference, rel=1e-4)


def assert_last_stages_match(histories, reference, rel):
    """Every last-stage rank's (iteration, loss) history equals the reference's within `rel`."""
    results = [h for h in histories if h is not None]
    assert results
    for history in results:
        for (i, a), (j, b) in zip(history, reference):
            assert i == j and a == pytest.approx(b, rel=rel), (history, reference)


@pytest.mark.parametrize("layout", TIED_LAYOUTS)
def test_tied_embeddings_under_the_distributed_optimizer_match_one_process(layout_runs, layout):
    assert 1024 * 64 > 20000  # the embedding is larger than a bucket
    history, norms, _ = layout_runs("tied-reference")[0]
    results = [r for r in layout_runs(f"tied/{layout}") if r]
    assert results
    for got_history, got_norms, difference in results:
        assert difference == 0.0
        assert [i for i, _ in got_history] == [1, 2, 3, 4]
        for (_, a), (_, b) in zip(got_history + got_norms, history + norms):
            assert a == pytest.approx(b, rel=1e-6, abs=0), (got_history, got_norms, history, norms)


def test_llama_3d_run_of_the_7b_recipe_matches_one_process(layout_runs):
    reference = layout_runs("llama-reference")[0]
    assert_last_stages_match(layout_runs("llama"), reference, rel=1e-5)


def test_a_pp2_run_resumes_with_pp1(tmp_path):
    argv = TINY + [
        "--num-layers",
        "4",
        "--fp8-format",
        "hybrid",
        "--train-iters",
        "4",
        "--save",
        str(tmp_path),
    ]
    first = [
        h
        for h in run_on_ranks(
            last_stage_losses,
            2,
            argv + ["--pipeline-model-parallel-size", "2", "--exit-interval", "2"],
        )
        if h
    ][0]
    resumed = run_on_ranks(last_stage_losses, 1, argv + ["--load", str(tmp_path)])[0]
    straight = run_on_ranks(
        last_stage_losses,
        1,
        TINY + ["--num-layers", "4", "--fp8-format", "hybrid", "--train-iters", "4"],
    )[0]
    assert [i for i, _ in first] == [1, 2] and [i for i, _ in resumed] == [3, 4]
    for (_, a), (_, b) in zip(first + resumed, straight):  # FP8 state of both stages carried over
        assert a == pytest.approx(b, rel=1e-4)


def profiled_files(rank, world_size, argv):
    pretrain(argv)
    return sorted(
        p.name for p in (Path(argv[argv.index("--tensorboard-dir") + 1]) / "profile").glob("*")
    )


def test_profile_records_the_chosen_steps_on_the_chosen_ranks(tmp_path):
    argv = TINY + [
        "--fp8-format",
        "hybrid",
        "--train-iters",
        "4",
        "--tensorboard-dir",
        str(tmp_path),
        "--profile",
        "--use-pytorch-profiler",
        "--profile-step-start",
        "1",
        "--profile-step-end",
        "3",
        "--profile-ranks",
        "1",
    ]
    names = run_on_ranks(profiled_files, 2, argv)[0]
    assert names == ["rank1_steps2-3.json", "rank1_steps2-3.txt"]
    summary = (tmp_path / "profile" / "rank1_steps2-3.txt").read_text()
    assert summary.startswith("rank 1: 2 steps in ")
    assert "aten::" in summary  # the operator table
    trace = json.loads((tmp_path / "profile" / "rank1_steps2-3.json").read_text())
    assert any("Fp8LinearFunction" in event.get("name", "") for event in trace["traceEvents"])


def test_profile_flags_are_checked():
    with pytest.raises(arguments.ArgumentsError, match="only with --profile"):
        pretrain(TINY + ["--train-iters", "2", "--profile-step-start", "1"])
    with pytest.raises(arguments.ArgumentsError, match="must be after --profile-step-start"):
        pretrain(
            TINY
            + [
                "--train-iters",
                "2",
                "--profile",
                "--use-pytorch-profiler",
                "--profile-step-start",
                "3",
                "--profile-step-end",
                "3",
            ]
        )
    with pytest.raises(arguments.ArgumentsError, match="needs a GPU"):
        pretrain(TINY + ["--train-iters", "2", "--profile"])


def test_a_finished_run_frees_its_model_and_gradient_buffer():
    # Hooks on parameters live in C++, out of the garbage collector's sight: they must not keep
    # the run's buffer (and through it every parameter) alive once the trainer is dropped.
    import gc
    import weakref

    trainer = pretrain(TINY + ["--train-iters", "3"])
    refs = [
        weakref.ref(obj)
        for obj in (trainer, trainer.buffer, trainer.optimizer, next(trainer.model.parameters()))
    ]
    del trainer
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)


def test_gradient_accumulation_fusion_can_be_turned_off():
    """The FP8 weight gradients of the first micro-batch skip their bf16 rounding when fused, so
    the two runs part by that rounding only."""
    fp8 = TINY + ["--train-iters", "3", "--fp8-format", "hybrid"]
    fused = run_on_ranks(losses_of, 1, fp8)[0]
    trainer = pretrain(fp8 + ["--no-gradient-accumulation-fusion"])
    linears = [m for m in trainer.model.modules() if isinstance(m, Fp8Linear)]
    assert linears and not any(m.fuse_wgrad_accumulation for m in linears)
    assert [loss for _, loss in trainer.history] == pytest.approx(
        [loss for _, loss in fused], rel=1e-3
    )


def test_neighbour_fusion_can_be_turned_off():
    """Fused, the norms and the activation write FP8 in their own kernels; on the CPU their torch
    references run, which round like the unfused modules but for the order of a few sums."""
    fp8 = TINY + ["--train-iters", "3", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    fused = pretrain(fp8)
    assert all(m.fuse_neighbours for m in fused.model.modules() if isinstance(m, Fp8Linear))
    trainer = pretrain(fp8 + ["--no-fp8-neighbour-fusion"])
    linears = [m for m in trainer.model.modules() if isinstance(m, Fp8Linear)]
    assert linears and not any(m.fuse_neighbours for m in linears)
    assert [loss for _, loss in trainer.history] == pytest.approx(
        [loss for _, loss in fused.history], rel=1e-3
    )


def test_a_data_path_per_split_trains_and_evaluates_on_its_own_documents(tmp_path):
    """--train-data-path / --valid-data-path: validation on the held-out prefix only."""
    import numpy as np
    from megafp8.data import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    for name, low in (("train", 0), ("valid", 256)):  # disjoint token ranges tell the splits apart
        with IndexedDatasetBuilder(str(tmp_path / name), np.int32) as builder:
            for _ in range(40):
                builder.add_item(rng.integers(low, low + 255, size=int(rng.integers(20, 80))))
                builder.end_document()
    trainer = pretrain(
        [
            "--model",
            "gpt-tiny",
            "--seq-length",
            "32",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--train-iters",
            "4",
            "--lr",
            "1e-3",
            "--log-interval",
            "2",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "512",
            "--train-data-path",
            str(tmp_path / "train"),
            "--valid-data-path",
            str(tmp_path / "valid"),
            "--eval-interval",
            "2",
            "--eval-iters",
            "2",
            "--save",
            str(tmp_path / "run"),
        ]
    )
    assert trainer.test_data is None
    assert all(
        int(trainer.train_data[i]["tokens"].max()) < 256 for i in range(len(trainer.train_data))
    )
    assert all(
        int(trainer.valid_data[i]["tokens"].min()) >= 256 for i in range(len(trainer.valid_data))
    )
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["iteration"] for r in records if "valid_loss" in r] == [2, 4]


def test_data_seed_keeps_the_data_order_while_seed_changes_the_initialisation(tmp_path):
    """--data-seed: the yardstick run of docs/convergence.md, another initialisation on the same batches."""
    import numpy as np
    from megafp8.data import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(str(tmp_path / "train"), np.int32) as builder:
        for _ in range(40):
            builder.add_item(rng.integers(0, 512, size=int(rng.integers(20, 80))))
            builder.end_document()

    def run(*seeds):
        trainer = pretrain(
            [
                "--model",
                "gpt-tiny",
                "--seq-length",
                "32",
                "--micro-batch-size",
                "2",
                "--global-batch-size",
                "4",
                "--train-iters",
                "1",
                "--lr",
                "1e-3",
                "--log-interval",
                "1",
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "512",
                "--eval-iters",
                "0",
                "--train-data-path",
                str(tmp_path / "train"),
                *seeds,
            ]
        )
        order = [trainer.train_data[i]["tokens"].tolist() for i in range(4)]
        return order, trainer.history[0][1]

    order, loss = run("--seed", "1")
    same_data, other_init = run("--seed", "2", "--data-seed", "1")
    other_data, _ = run("--seed", "2")
    assert same_data == order and other_data != order
    assert other_init != loss


def test_data_past_the_tokenizers_vocabulary_fails_before_the_first_step(
    tmp_path, monkeypatch, capsys
):
    """An id the embedding has no row for (gpt-tiny pads a vocabulary of 500 to 512 rows) once
    crashed iteration 1 with a raw IndexError: now the run stops at start-up with one line."""
    import warnings

    import numpy as np
    from megafp8.data import IndexedDatasetBuilder

    from megafp8.training import trainer

    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(str(tmp_path / "train"), np.uint16) as builder:
        for _ in range(40):
            tokens = rng.integers(0, 500, size=int(rng.integers(20, 80)))
            tokens[0] = 700  # made with another tokenizer: an id in every batch
            builder.add_item(tokens)
            builder.end_document()
    # main() sets it for the process
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "megafp8-train",
            "--model",
            "gpt-tiny",
            "--seq-length",
            "32",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--train-iters",
            "2",
            "--lr",
            "1e-3",
            "--log-interval",
            "1",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "500",
            "--eval-iters",
            "0",
            "--train-data-path",
            str(tmp_path / "train"),
        ],
    )
    with pytest.raises(SystemExit) as stopped:
        trainer.main()
    out, err = capsys.readouterr()
    assert stopped.value.code == 2
    assert err == (
        f"megafp8-train: error: {tmp_path / 'train.bin'}: its largest token id is 700, past the "
        "vocabulary of 500 tokens (ids 0 to 499): the data was made with another tokenizer. Re-tokenize "
        "it with this run's tokenizer (tools/preprocess_data.py), or give the run the tokenizer the data "
        "was made with\n"
    )
    assert "iteration" not in out  # no step ran


@pytest.mark.parametrize(
    ("copy_engines", "message", "hinted"),
    [
        (True, "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling cublasLtMatmul", True),
        (False, "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling cublasLtMatmul", False),
        (True, "shapes cannot be multiplied", False),
    ],
)
def test_a_cuda_error_after_copy_engine_transfers_points_to_their_barriers(
    monkeypatch, capsys, copy_engines, message, hinted
):
    """A copy-engine barrier that gives up traps, and the process's next CUDA call fails with an
    unrelated-looking error: the run says where to look, and only then."""
    from megafp8 import symmetric_memory

    def failing_run():
        raise RuntimeError(message)

    monkeypatch.setattr(trainer, "pretrain", failing_run)
    monkeypatch.setattr(symmetric_memory, "_used", copy_engines)
    with pytest.raises(SystemExit) as stopped:
        trainer.main()
    err = capsys.readouterr().err
    assert stopped.value.code == 1
    assert message in err  # the traceback stays
    assert ("CUDASymmetricMemory::barrier" in err) == hinted
    assert ("--tp-comm-overlap-transport nccl" in err) == hinted


@pytest.mark.parametrize(
    "recipe", [["rowwise"], ["blockwise", *BLOCKWISE_SHAPE]], ids=["rowwise", "blockwise"]
)
def test_fine_grained_scaling_trains_under_tensor_parallelism_as_on_one_rank(recipe):
    """--fp8-recipe rowwise / blockwise with tp 2 and sequence parallelism tracks one rank: the
    shards' rows take their own scales (a row-parallel weight's rows are half as long), so the
    losses agree to FP8's rounding, not bit for bit."""
    argv = TINY + ["--train-iters", "4", "--fp8-format", "e4m3", "--fp8-recipe", *recipe]
    one = run_on_ranks(losses_of, 1, argv)[0]
    tp2 = run_on_ranks(
        losses_of, 2, argv + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    )[0]
    assert [loss for _, loss in tp2] == pytest.approx([loss for _, loss in one], rel=1e-3)
