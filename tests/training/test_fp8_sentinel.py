"""The bf16 sentinel (megafp8/training/fp8_sentinel.py): its decisions, and in the trainer on
the CPU: silent on a healthy run, a fallback within one interval of an injected FP8 fault and a
return with re-seeded scales, bf16 for good when FP8 keeps failing, every rank of a tp2 x pp2
run switching together, and a resumed run switching where the straight one does."""

import json
import math

import pytest

from megafp8.fp8 import scaling
from megafp8.training import arguments
from megafp8.training.fp8_sentinel import Fp8Sentinel
from megafp8.training.trainer import Trainer, pretrain

from ..multiprocess import run_on_ranks

INTERVAL = 2
BASE = [
    "--model",
    "gpt-tiny",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--lr",
    "1e-3",
    "--log-interval",
    "1",
    "--seed",
    "3",
    "--mock-data",
    "--fp8-format",
    "hybrid",
    "--fp8-check-interval",
    str(INTERVAL),
    "--fp8-fallback-iters",
    "3",
    "--fp8-max-fallbacks",
    "2",
]


def test_decisions():
    sentinel = Fp8Sentinel(interval=2, tolerance=0.05, fallback_iters=3, max_fallbacks=2)
    assert sentinel.due(2) and not sentinel.due(3)
    assert sentinel.judge(2, 5.1, 5.0)["fp8_check"] == "ok"  # 2% < 5%
    record = sentinel.judge(4, 6.0, 5.0)
    assert record["fp8_check"] == "fallback" and record["fp8_fallback_until"] == 7
    assert record["fp8_check_gap"] == pytest.approx(0.2)
    assert [sentinel.fp8_on(i) for i in (4, 5, 6, 7)] == [False, False, False, True]
    assert not sentinel.due(6)  # no check while in bf16
    assert not sentinel.returns_at(6) and sentinel.returns_at(7) and sentinel.fp8_on(7)
    state = sentinel.state_dict()
    # failed again right after returning
    assert sentinel.judge(8, math.nan, 5.0)["fp8_check"] == "disabled"
    assert not any(sentinel.fp8_on(i) for i in range(8, 100)) and not sentinel.due(10)
    resumed = Fp8Sentinel(2, 0.05, 3, 2)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state and resumed.fp8_on(8)
    # No check at the end of a fallback, before its return has re-seeded the scales.
    ending = Fp8Sentinel(interval=2, tolerance=0.05, fallback_iters=4, max_fallbacks=2)
    assert ending.judge(4, math.nan, 5.0)["fp8_fallback_until"] == 8
    assert ending.fp8_on(8) and not ending.due(8) and ending.returns_at(8) and ending.due(10)
    # A pass more than one interval after a return forgives the earlier fallback.
    assert resumed.judge(10, 5.0, 5.0)["fp8_check"] == "ok" and resumed.fallbacks_in_a_row == 0


def run(argv, fault=None, monkeypatch=None):
    """Train with `argv`; `fault(trainer)` says at each end-of-pass scale update whether FP8's
    scales are corrupted (NaN: every FP8 GEMM's output, and so the FP8 loss, is lost; on mock
    tokens the model stays near its uniform start, where scales far too large or too small leave
    the loss within 0.1%: the FP8 layers' outputs vanish, the embeddings still give ln(vocab)).
    Returns (trainer, [(iteration, in FP8)])."""
    steps, state = [], {"trainer": None}
    update = scaling._update_delayed

    def faulty_update(states, *args):
        update(states, *args)
        trainer = state["trainer"]
        if trainer is not None and fault is not None and fault(trainer):
            for s in states:
                s.scale.fill_(math.nan)

    train_step = Trainer.train_step

    def recording_step(self, *args, **kwargs):
        state["trainer"] = self
        steps.append((self.iteration, self.fp8_active))
        return train_step(self, *args, **kwargs)

    monkeypatch.setattr(scaling, "_update_delayed", faulty_update)
    monkeypatch.setattr(Trainer, "train_step", recording_step)
    try:
        return pretrain(argv), steps
    finally:
        monkeypatch.undo()  # the next run wraps the originals again


def checks_of(folder):
    return [
        (r["iteration"], r["fp8_check"])
        for r in map(json.loads, (folder / "metrics.jsonl").open())
        if "fp8_check" in r
    ]


def test_a_healthy_run_is_never_switched(tmp_path, monkeypatch):
    trainer, steps = run(
        BASE + ["--train-iters", "8", "--save", str(tmp_path / "run")], monkeypatch=monkeypatch
    )
    assert all(fp8 for _, fp8 in steps)
    assert checks_of(tmp_path / "run") == [(2, "ok"), (4, "ok"), (6, "ok"), (8, "ok")]


def test_an_fp8_fault_falls_back_and_returns(tmp_path, monkeypatch):
    """A fault from iteration 3 on, gone once the run has fallen back (a transient one)."""
    seen = {"fallback": False}
    original = Trainer.return_to_fp8

    def noting_return(self):
        seen["fallback"] = True
        original(self)

    monkeypatch.setattr(Trainer, "return_to_fp8", noting_return)
    trainer, steps = run(
        BASE + ["--train-iters", "12", "--save", str(tmp_path / "run")],
        fault=lambda t: t.iteration >= 3 and not seen["fallback"],
        monkeypatch=monkeypatch,
    )
    # Checked after iteration 4 (the first check after the fault): bf16 for 3 iterations, then FP8.
    assert checks_of(tmp_path / "run") == [
        (2, "ok"),
        (4, "fallback"),
        (7, "return"),
        (8, "ok"),
        (10, "ok"),
        (12, "ok"),
    ]
    assert [fp8 for _, fp8 in steps] == [True] * 4 + [False] * 3 + [True] * 5
    assert trainer.sentinel.fallbacks_in_a_row == 0 and not trainer.sentinel.disabled


def test_fp8_that_keeps_failing_stays_in_bf16(tmp_path, monkeypatch):
    trainer, steps = run(
        BASE + ["--train-iters", "14", "--save", str(tmp_path / "run")],
        fault=lambda t: t.iteration >= 1,
        monkeypatch=monkeypatch,
    )
    assert checks_of(tmp_path / "run") == [(2, "fallback"), (5, "return"), (6, "disabled")]
    assert [fp8 for _, fp8 in steps] == [True] * 2 + [False] * 3 + [True] + [False] * 8
    assert trainer.sentinel.disabled


def test_a_resumed_run_switches_where_the_straight_one_does(tmp_path, monkeypatch):
    always = lambda t: t.iteration >= 1  # noqa: E731
    _, straight = run(
        BASE + ["--train-iters", "8", "--save", str(tmp_path / "a")],
        fault=always,
        monkeypatch=monkeypatch,
    )
    run(
        BASE + ["--train-iters", "3", "--save", str(tmp_path / "b")],
        fault=always,
        monkeypatch=monkeypatch,
    )
    # from iteration 3, inside the fallback
    _, resumed = run(
        BASE + ["--train-iters", "8", "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")],
        fault=always,
        monkeypatch=monkeypatch,
    )
    assert resumed == straight[3:]


def test_the_sentinel_flags_are_checked():
    base = "--model gpt-tiny --train-iters 10 --lr 1e-3 --micro-batch-size 2 --mock-data"
    with pytest.raises(
        arguments.ArgumentsError, match="--fp8-check-interval.*without --fp8-format"
    ):
        arguments.parse_args((base + " --fp8-check-interval 5").split())
    with pytest.raises(
        arguments.ArgumentsError, match="--fp8-fallback-iters applies only to the bf16 sentinel"
    ):
        arguments.parse_args((base + " --fp8-format hybrid --fp8-fallback-iters 5").split())
    with pytest.raises(
        arguments.ArgumentsError, match="--fp8-check-tolerance: expected a number > 0"
    ):
        arguments.parse_args(
            (base + " --fp8-format hybrid --fp8-check-interval 5 --fp8-check-tolerance 0").split()
        )


def tp2_pp2_body(rank, world_size):
    monkeypatch = pytest.MonkeyPatch()
    try:
        _, steps = run(
            BASE
            + [
                "--train-iters",
                "8",
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--sequence-parallel",
            ],
            fault=lambda t: t.iteration >= 1,
            monkeypatch=monkeypatch,
        )
        return steps
    finally:
        monkeypatch.undo()


def test_every_rank_of_a_tp2_pp2_run_switches_together():
    ranks = run_on_ranks(tp2_pp2_body, 4)
    assert all(steps == ranks[0] for steps in ranks)
    assert [fp8 for _, fp8 in ranks[0]] == [True] * 2 + [False] * 3 + [True] + [False] * 2
