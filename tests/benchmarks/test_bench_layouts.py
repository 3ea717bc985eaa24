"""benchmarks/bench_layouts.py and layout_tables.py on the CPU: one launch trains each precision
of a layout, records complete figures and per-step losses, and the tables compare them."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

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
    "--train-iters",
    "4",
    "--log-interval",
    "2",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "1",
    "--mock-data",
    "--bf16",
    "--seed",
    "7",
]


def _module(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_body(rank, world_size, argv):
    _module("bench_layouts").main(argv)


def test_bench_layouts_records_each_precision_and_the_tables_compare_them(tmp_path):
    out = tmp_path / "runs.jsonl"
    run_on_ranks(
        bench_body,
        1,
        ["--output", str(out), "--label", "one", "--precisions", "bf16", "delayed", "--", *TINY],
    )
    run_on_ranks(
        bench_body,
        2,
        [
            "--output",
            str(out),
            "--label",
            "tp2",
            "--precisions",
            "bf16",
            "delayed",
            "--",
            *TINY,
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["label"], r["precision"], r["tp"], r["dp"]) for r in records] == [
        ("one", "bf16", 1, 1),
        ("one", "delayed", 1, 1),
        ("tp2", "bf16", 2, 1),
        ("tp2", "delayed", 2, 1),
    ]
    for r in records:
        assert r["iterations"] == 4 and len(r["losses"]) == 4 and r["window"] == [3, 4]
        # CPU: not tracked
        assert r["tokens_per_sec_per_gpu"] > 0 and r["memory_left_after_gib"] == 0
        assert r["device"] == "cpu"  # the GPU's name on a GPU, for validate_planner.py's check
        # --enable-cuda-graph: how validate_planner.py predicts a pipeline
        assert r["cuda_graph"] is False
        # the flags validate_planner.py reads from the record
        assert r["first_stage_layers"] is r["last_stage_layers"] is None
        assert r["distributed_optimizer"] is r["overlap_param_gather"] is False
        assert r["recompute"] == "none"
    # tp 2 trains the same model on the same data: bf16 losses agree closely.
    assert abs(records[2]["losses"][-1] - records[0]["losses"][-1]) < 1e-2

    tables = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "layout_tables.py"),
            str(out),
            "--reference",
            "one",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # no current-scaling run
    assert "| tp2 | 2 | tp2 x pp1 x dp1 |" in tables and "not run" in tables
    assert "| tp2 | delayed | 4 |" in tables
