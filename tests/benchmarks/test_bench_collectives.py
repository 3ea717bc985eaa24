"""benchmarks/bench_collectives.py on the CPU (gloo): four ranks measure every op at group sizes
2 and 4, rank 0 writes the records, and what cannot run is refused before any rendezvous."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..multiprocess import run_on_ranks

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench_collectives.py"
spec = importlib.util.spec_from_file_location("bench_collectives", BENCH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = ["--sizes-mb", "0.01", "0.05", "--warmup", "1", "--iters", "2"]
# bf16 elements of 0.01 and 0.05 MiB (5242.88 and 26214.4) rounded to multiples of k, as bytes.
BYTES = {(2, 0.01): 10484, (4, 0.01): 10488, (2, 0.05): 52428, (4, 0.05): 52432}
BUS_FACTOR = {
    "all_reduce": lambda k: 2 * (k - 1) / k,
    "all_gather": lambda k: (k - 1) / k,
    "reduce_scatter": lambda k: (k - 1) / k,
    "send_recv": lambda k: 1.0,
}


def refuse_then_measure(rank, world_size, out):
    try:
        bench.main(["--output", str(out), "--group-sizes", "2", "3"])
        refusal = None
    except SystemExit as stop:
        refusal = stop.code
    bench.main(["--output", str(out), *TINY])
    return refusal


def test_four_ranks_measure_every_op_and_group_size(tmp_path):
    out = tmp_path / "coll.json"
    refusals = run_on_ranks(refuse_then_measure, 4, out)
    # A group size that does not divide the world is said once, by rank 0; the others just stop.
    assert refusals[0] == (
        "bench_collectives: error: --group-sizes 3 does not divide the world size 4 into "
        "groups of 2 or more ranks: give sizes among 2 4"
    )
    assert refusals[1:] == [1, 1, 1]

    report = json.loads(out.read_text())
    assert set(report) == {
        "device",
        "gpus",
        "backend",
        "torch",
        "dtype",
        "nvls_disabled",
        "results",
    }
    assert (report["device"], report["gpus"], report["backend"], report["dtype"]) == (
        "cpu",
        4,
        "gloo",
        "bf16",
    )
    assert report["nvls_disabled"] == (os.environ.get("NCCL_NVLS_ENABLE") == "0")
    measured = [(r["op"], r["group_size"], r["bytes"]) for r in report["results"]]
    assert measured == [
        (op, k, BYTES[k, mib])
        for op in ("all_reduce", "all_gather", "reduce_scatter")
        for k in (2, 4)
        for mib in (0.01, 0.05)
    ] + [("send_recv", 2, BYTES[2, mib]) for mib in (0.01, 0.05)]
    for r in report["results"]:
        assert set(r) == {"op", "group_size", "bytes", "ms", "algbw_gbs", "busbw_gbs"}
        assert r["ms"] > 0
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / (r["ms"] / 1e3) / 1e9, rel=1e-12)
        assert r["busbw_gbs"] == pytest.approx(
            r["algbw_gbs"] * BUS_FACTOR[r["op"]](r["group_size"]), rel=1e-12
        )


def test_under_torchrun_rank_0_prints_a_line_per_result_and_writes_the_file(tmp_path):
    out = tmp_path / "coll.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(BENCH),
            "--output",
            str(out),
            "--sizes-mb",
            "0.01",
            "--ops",
            "all_reduce",
            "send_recv",
            "--warmup",
            "0",
            "--iters",
            "1",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[:3] for line in lines[:2]] == [
        ["all_reduce", "k=2", "0.010"],
        ["send_recv", "k=2", "0.010"],
    ]
    assert all(" ms busbw " in line and line.endswith(" GB/s") for line in lines[:2])
    assert lines[2:] == [f"wrote {out}"]
    assert [r["op"] for r in json.loads(out.read_text())["results"]] == ["all_reduce", "send_recv"]


def test_one_process_without_torchrun_is_refused(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        SystemExit, match="world size 1\\): run under torchrun with 2 or more processes"
    ):
        bench.main(["--output", str(tmp_path / "coll.json")])
    assert not (tmp_path / "coll.json").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sizes-mb", "1", "0"], "--sizes-mb must be positive \\(got 1.0 0.0\\)"),
        (["--iters", "0"], "--iters 1 or more"),
        (
            ["--group-sizes", "1"],
            "--group-sizes 1 does not divide the world size 4 into groups of 2 or more ranks",
        ),
    ],
)
def test_bad_flags_are_refused_before_the_rendezvous(tmp_path, monkeypatch, flags, message):
    # as torchrun would set it: the checks need no process group
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit, match=message):
        bench.main(["--output", str(tmp_path / "coll.json"), *flags])


def test_default_group_sizes_are_the_powers_of_two_dividing_the_world():
    args = argparse.Namespace(sizes_mb=[1.0], warmup=0, iters=1, group_sizes=None)
    assert bench.group_sizes(args, 8) == [2, 4, 8]
    assert bench.group_sizes(args, 12) == [2, 4]
    with pytest.raises(
        ValueError, match="no power of two divides the world size 3: give --group-sizes"
    ):
        bench.group_sizes(args, 3)
