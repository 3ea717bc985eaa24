"""The multi-GPU check itself, on the CPU: one layout (dp 2, gloo) through every kind of run it
makes (straight, resumed, SIGTERM to the launch's process group, a failing rank), each launched
as a user launches the recipe, and judged; on GPUs, `python -m tests.multigpu.check_layouts`."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.multigpu import check_layouts


def test_every_kind_of_run_ends_as_it_should_on_the_cpu(tmp_path, capsys):
    status = check_layouts.main(
        ["--cpu", "--layouts", "dp2", "--precisions", "delayed", "--output", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    outcomes = {o["run"]: o for o in json.loads((tmp_path / "check_layouts.json").read_text())}
    assert sorted(outcomes) == [
        "1gpu-delayed-eager",
        "dp2-delayed-eager",
        "dp2-delayed-eager-fail",
        "dp2-delayed-eager-resumed",
        "dp2-delayed-eager-sigterm",
    ]
    assert all(not o["problems"] for o in outcomes.values()), out
    assert outcomes["dp2-delayed-eager-sigterm"]["ended_after_event_s"] < 30
    assert outcomes["dp2-delayed-eager-fail"]["returncode"] != 0


def test_a_run_that_does_not_end_or_drifts_is_named(tmp_path):
    make = check_layouts.Outcome
    straight, resumed = (
        check_layouts.Run("dp2", "bf16", False),
        check_layouts.Run("dp2", "bf16", False, "resumed"),
    )
    reference = check_layouts.Run("1gpu", "bf16", False)
    losses = {i: 10.0 - i for i in range(1, 7)}
    outcomes = {
        reference: make(
            reference.name, "1gpu", "bf16", False, "straight", 0, 1.0, None, 9.0, dict(losses)
        ),
        straight: make(
            straight.name, "dp2", "bf16", False, "straight", 0, 45.0, None, 9.0, {**losses, 2: 8.5}
        ),
        resumed: make(
            resumed.name, "dp2", "bf16", False, "resumed", None, None, None, 300.0, {4: 6.0}
        ),
    }
    # graphed: equal to its eager twin but at the last iteration (2.7%, a race between a graph's
    # replay and a pipeline send once looked like this), and 2.7% off one GPU there too
    graphed = check_layouts.Run("dp2", "bf16", True)
    outcomes[graphed] = make(
        graphed.name,
        "dp2",
        "bf16",
        True,
        "straight",
        0,
        5.0,
        None,
        9.0,
        {**losses, 2: 8.5, 6: 4.11},
    )
    check_layouts.judge(outcomes, 6, tmp_path)
    assert outcomes[reference].problems == []
    assert outcomes[straight].problems == [
        "exited 45 s after its last iteration",
        "losses 6.25% off one GPU's (tolerance 1%)",
    ]
    assert outcomes[graphed].problems == [
        "losses 6.25% off one GPU's (tolerance 1%)",
        "losses 2.75% off the eager run's (tolerance 0.1%)",
    ]
    assert (
        outcomes[resumed].problems[0]
        == "still running 300 s after its start: killed (stacks in logs/"
        "dp2-bf16-eager-resumed.log)"
    )
    assert "resumed losses missing, so not compared" in outcomes[resumed].problems[1]


def test_the_references_go_first_and_a_run_without_one_is_not_passed(tmp_path):
    runs = check_layouts.plan(["tp2pp2", "dp2"], ["bf16", "delayed"], graphs=True)
    order = check_layouts.start_order(runs)
    assert [run.layout for run in order[:2]] == ["1gpu", "1gpu"]
    assert [run.gpus for run in order[2:]] == sorted((run.gpus for run in order[2:]), reverse=True)
    four_gpus = [run for run in order if run.layout == "tp2pp2"]
    assert four_gpus[0].kind == "fail"
    # then the straight run a resumed run waits for
    assert four_gpus[1] == check_layouts.Run("tp2pp2", "delayed", True)
    assert four_gpus[-1].kind == "resumed"
    straight = check_layouts.Run("dp2", "bf16", False)
    losses = {i: 10.0 - i for i in range(1, 7)}
    outcomes = {
        straight: check_layouts.Outcome(
            straight.name, "dp2", "bf16", False, "straight", 0, 1.0, None, 9.0, losses
        )
    }
    check_layouts.judge(outcomes, 6, tmp_path)
    assert outcomes[straight].problems == ["no one-GPU bf16 run finished to compare it with"]


def test_a_time_limit_stops_the_check_and_names_what_did_not_run(tmp_path, capsys):
    start = time.time()
    status = check_layouts.main(
        ["--cpu", "--layouts", "dp2", "--precisions", "bf16", "--kinds", "straight"]
        + ["--time-limit", "1", "--output", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert status == 2, out
    assert "incomplete: 2 of 2 runs did not finish within --time-limit 1 s: " in out
    assert "1gpu-bf16-eager" in out and "dp2-bf16-eager" in out
    assert time.time() - start < 60  # the running reference was stopped, not waited for


def test_a_repeated_run_is_judged_against_its_own_straight_and_eager_twins(tmp_path, capsys):
    runs = check_layouts.plan(["tp2"], ["delayed"], graphs=True, repeat=2)
    names = sorted(run.name for run in runs)
    assert names == sorted(
        ["1gpu-delayed-graphs"]
        + [
            f"tp2-delayed-{kind}{suffix}"
            for suffix in ("", "-r2")
            for kind in ("graphs", "eager", "graphs-resumed", "graphs-sigterm", "graphs-fail")
        ]
    )
    assert len(set(runs)) == len(runs)
    resumed = check_layouts.Run("tp2", "delayed", True, "resumed", 2)
    assert resumed.straight.name == "tp2-delayed-graphs-r2"
    env = check_layouts.environment(resumed, tmp_path, False, [0, 1])
    assert f"runs/tp2-delayed-graphs-r2/iter_{check_layouts.RESUME_AT:07d}" in env["EXTRA_ARGS"]
    assert env["SAVE"].endswith("tp2-delayed-graphs-resumed-r2")
    # the second graphed run is held to the second eager run, not the first
    losses = {i: 10.0 - i for i in range(1, 7)}
    outcomes = {}
    for run, run_losses in (
        (check_layouts.Run("1gpu", "delayed", True), losses),
        (check_layouts.Run("tp2", "delayed", False), losses),
        (check_layouts.Run("tp2", "delayed", False, repeat=2), {**losses, 6: 4.02}),
        (check_layouts.Run("tp2", "delayed", True, repeat=2), losses),
    ):
        outcomes[run] = check_layouts.Outcome(
            run.name, run.layout, "delayed", run.graphs, "straight", 0, 1.0, None, 9.0, run_losses
        )
    check_layouts.judge(outcomes, 6, tmp_path)
    graphed = outcomes[check_layouts.Run("tp2", "delayed", True, repeat=2)]
    assert graphed.problems == ["losses 0.50% off the eager run's (tolerance 0.1%)"]
    with pytest.raises(SystemExit) as stop:
        check_layouts.main(["--cpu", "--repeat", "0", "--output", str(tmp_path)])
    assert stop.value.code == 2
    assert "--repeat 0: give 1 or more" in capsys.readouterr().err


def test_overlaps_reach_only_the_layouts_that_take_them(tmp_path):
    """--tp-comm-overlap for tp layouts, the distributed optimizer with --overlap-param-gather for
    dp layouts, as the recipe gives them (its switches in the environment), and in the failing
    rank's command alike; off when asked."""
    expected = {
        "tp2": ["--tp-comm-overlap"],
        "tp2pp2": ["--tp-comm-overlap"],
        "pp2": [],
        "1gpu": [],
        "dp2": ["--use-distributed-optimizer", "--overlap-param-gather"],
        "tp2dp2": ["--tp-comm-overlap", "--use-distributed-optimizer", "--overlap-param-gather"],
    }
    for layout, flags in expected.items():
        assert check_layouts.overlap_flags(layout, True, True) == flags, layout
        assert check_layouts.overlap_flags(layout, False, False) == []
        run = check_layouts.Run(layout, "delayed", True)
        env = check_layouts.environment(run, tmp_path, False, [0, 1, 2, 3])
        assert (env["TP_COMM_OVERLAP"], env["DISTRIBUTED_OPTIMIZER"]) == ("1", "1")
        env = check_layouts.environment(run, tmp_path, False, [0, 1, 2, 3], (False, False))
        assert (env["TP_COMM_OVERLAP"], env["DISTRIBUTED_OPTIMIZER"]) == ("0", "0")
        command = check_layouts.failing_command(
            check_layouts.Run(layout, "delayed", True, "fail"), tmp_path, False, flags
        )
        assert all(flag in command for flag in flags), layout


def test_fp8_param_gather_goes_to_the_delayed_runs_of_the_distributed_optimizer(tmp_path):
    """--fp8-param-gather reaches the trainer only where it applies: FP8 delayed, dp > 1, the
    distributed optimizer on."""
    for layout, precision, distributed, on in (
        ("dp2", "delayed", True, True),
        ("tp2dp2", "delayed", True, True),
        ("dp2", "current", True, False),
        ("dp2", "bf16", True, False),
        ("dp2", "delayed", False, False),
        ("tp2", "delayed", True, False),
    ):
        run = check_layouts.Run(layout, precision, True)
        flags = check_layouts.fp8_param_gather_flags(run, distributed, True)
        assert flags == (["--fp8-param-gather"] if on else []), (layout, precision, distributed)
        assert check_layouts.fp8_param_gather_flags(run, distributed, False) == []
        env = check_layouts.environment(
            run, tmp_path, False, [0, 1, 2, 3], (True, distributed), True
        )
        assert ("--fp8-param-gather" in env["EXTRA_ARGS"]) is on


def test_a_hung_run_leaves_its_stacks_and_nothing_running(tmp_path, monkeypatch):
    """torchrun starts each rank in a session of its own: a hung run's ranks are found under its
    launcher, write their Python stacks into the run's log one after the other (each whole), with
    what cuda-gdb says of each rank first where it is installed, and are killed with it."""
    ranks = [
        "import time\n"
        f"def waiting_for_peer_{r}():\n"
        "    print('waiting', flush=True)\n"
        "    time.sleep(600)\n"
        f"waiting_for_peer_{r}()\n"
        for r in range(2)
    ]
    launcher = (
        "import subprocess, sys, time\n"
        f"for rank in {ranks!r}:\n"
        "    subprocess.Popen([sys.executable, '-c', rank], start_new_session=True)\n"
        "time.sleep(600)\n"
    )
    # a stand-in for cuda-gdb: it names the process it was asked to attach to
    debugger = tmp_path / "bin" / "cuda-gdb"
    debugger.parent.mkdir()
    debugger.write_text('#!/bin/sh\nwhile [ "$1" != -p ]; do shift; done\necho "kernels of $2"\n')
    debugger.chmod(0o755)
    monkeypatch.setenv("PATH", f"{debugger.parent}{os.pathsep}{os.environ['PATH']}")
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            # named as torchrun's launch is, so that its children count as ranks
            [sys.executable, "-c", launcher, "torchrun"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=check_layouts._without_core_files,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )
        deadline = time.time() + 60
        while log_path.read_text().count("waiting") < 2 and time.time() < deadline:
            time.sleep(0.1)
        started = check_layouts._descendants(process.pid)
        assert len(started) == 2 and all(map(check_layouts._running, started))
        assert check_layouts._ranks(started) == sorted(started)
        check_layouts._stop_hung(process.pid, started, log)
    process.wait(timeout=30)
    text = log_path.read_text()
    for pid in started:
        assert f"kernels of {pid}" in text
    dumps = text.split("Fatal Python error")[1:]
    assert len(dumps) == 2
    assert sorted(sum(f"in waiting_for_peer_{r}" in dump for r in range(2)) for dump in dumps) == [
        1,
        1,
    ]
    assert not any(map(check_layouts._running, started))


def test_a_check_stopped_stops_its_runs(tmp_path):
    """SIGTERM to the check (a job's time limit) ends its runs with it: left running, they would
    hold the GPUs and write into the next check's folders."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    check = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.multigpu.check_layouts",
            "--cpu",
            "--layouts",
            "dp2",
            "--precisions",
            "bf16",
            "--kinds",
            "sigterm",
            "--output",
            str(tmp_path),
        ],
        cwd=check_layouts.REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    deadline, started = time.time() + 240, set()
    while time.time() < deadline and check.poll() is None:  # until the run's ranks are up
        started |= check_layouts._descendants(check.pid)
        if any(
            "torch.distributed.run" in _command(pid) or "torchrun" in _command(pid)
            for pid in started
        ):
            break
        time.sleep(0.2)
    assert check.poll() is None, "the check ended before its run started"
    time.sleep(1.0)
    started |= check_layouts._descendants(check.pid)
    check.terminate()
    assert check.wait(timeout=60) != 0
    assert not [pid for pid in started if check_layouts._running(pid)]


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
