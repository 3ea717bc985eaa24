"""benchmarks/bench_recipes.py on the CPU: the recipe run layout by layout (CPU=1, a shrunk
model), each run's tokens/s read back and compared in the table."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "bench_recipes", REPO / "benchmarks" / "bench_recipes.py"
)
bench_recipes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_recipes)


def test_layout_names():
    assert bench_recipes.layout_sizes("1gpu") == {"tp": 1, "pp": 1, "dp": 1, "gpus": 1}
    assert bench_recipes.layout_sizes("tp2pp2") == {"tp": 2, "pp": 2, "dp": 1, "gpus": 4}
    assert bench_recipes.layout_sizes("pp2dp4") == {"tp": 1, "pp": 2, "dp": 4, "gpus": 8}
    for bad in ("tp2tp2", "2tp", "vpp2", ""):
        with pytest.raises(ValueError, match="give 1gpu or sizes"):
            bench_recipes.layout_sizes(bad)


def test_the_table_compares_with_one_gpu_and_bf16():
    records = [
        {
            "layout": "1gpu",
            "precision": "bf16",
            "gpus": 1,
            "tokens_per_sec": 100.0,
            "returncode": 0,
        },
        {
            "layout": "1gpu",
            "precision": "delayed",
            "gpus": 1,
            "tokens_per_sec": 130.0,
            "returncode": 0,
        },
        {"layout": "dp2", "precision": "bf16", "gpus": 2, "tokens_per_sec": 190.0, "returncode": 0},
        {
            "layout": "dp2",
            "precision": "delayed",
            "gpus": 2,
            "tokens_per_sec": 247.0,
            "returncode": 0,
        },
        {
            "layout": "tp2",
            "precision": "delayed",
            "gpus": 2,
            "tokens_per_sec": None,
            "returncode": 1,
        },
    ]
    rows = bench_recipes.table(records).splitlines()
    assert rows[3] == "| 1gpu | delayed | 130 |  | 1.30x |"
    assert rows[4] == "| dp2 | bf16 | 190 | 95.0% |  |"
    assert rows[5] == "| dp2 | delayed | 247 | 95.0% | 1.30x |"
    assert rows[6] == "| tp2 | delayed | failed (exit 1) |  |  |"


def test_runs_the_recipe_per_layout_on_the_cpu(tmp_path, capsys):
    status = bench_recipes.main(
        [
            "--layouts",
            "1gpu",
            "dp2",
            "--precisions",
            "delayed",
            "--iters",
            "2",
            "--env",
            "CPU=1",
            "SEQ=64",
            "MBS=2",
            "GBS=8",
            "OMP_NUM_THREADS=1",
            "--extra=--num-layers 2 --hidden-size 64 --num-attention-heads 4",
            "--output",
            str(tmp_path),
        ]
    )
    assert status == 0, capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [(r["layout"], r["precision"], r["gpus"]) for r in records] == [
        ("1gpu", "delayed", 1),
        ("dp2", "delayed", 2),
    ]
    assert all(r["tokens_per_sec"] > 0 and r["returncode"] == 0 for r in records)
    assert "| dp2 | delayed |" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "dp2-delayed" / "run.log").exists()
