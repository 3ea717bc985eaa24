"""tools/fp8_layer_table.py: the per-layer FP8 health of a run, worst first."""

import json

import pytest

from megafp8.training.trainer import pretrain

from .load import load_tool

tool = load_tool("fp8_layer_table")
TINY = [
    "--model",
    "gpt-tiny",
    "--num-layers",
    "2",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--lr",
    "3e-3",
    "--lr-warmup-iters",
    "1",
    "--log-interval",
    "1",
    "--seed",
    "7",
    "--mock-data",
    "--train-iters",
    "3",
    "--fp8-format",
    "hybrid",
]


def test_a_trained_run_gives_every_layer_and_role_worst_first(tmp_path, capsys):
    pretrain(TINY + ["--log-fp8-layers", "--save", str(tmp_path / "run")])
    capsys.readouterr()  # the run's own log
    assert tool.main([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("FP8 casts per layer and role at iteration 3 (worst underflow first)")
    body = [line.strip("| ").split(" | ") for line in out.splitlines()[4:]]
    assert len(body) == 2 * 4 * 3  # layers x linears x roles
    underflow = [float(cells[4]) for cells in body]
    assert underflow == sorted(underflow, reverse=True) and underflow[0] > 0
    # the run's max is at least now's
    assert all(float(cells[6]) >= float(cells[4]) for cells in body)
    assert (
        tool.main(
            [
                str(tmp_path / "run" / "metrics.jsonl"),
                "--iteration",
                "1",
                "--sort",
                "scale",
                "--top",
                "5",
            ]
        )
        == 0
    )
    rows = capsys.readouterr().out.splitlines()[4:]
    scales = [float(row.strip("| ").split(" | ")[2]) for row in rows]
    assert len(rows) == 5 and scales == sorted(scales)


def test_bad_input_says_what_to_do(tmp_path, capsys):
    assert tool.main([str(tmp_path)]) == 2
    assert "no metrics.jsonl there" in capsys.readouterr().err
    plain = tmp_path / "metrics.jsonl"
    plain.write_text(json.dumps({"iteration": 1, "loss": 2.0}) + "\n")
    assert tool.main([str(plain)]) == 2
    assert "--log-fp8-layers" in capsys.readouterr().err
    plain.write_text(
        json.dumps({"iteration": 4, "fp8_layers": {"layers.0.mlp.fc1": {"roles": {}}}}) + "\n"
    )
    assert tool.main([str(plain), "--iteration", "2"]) == 2
    assert "logged at: 4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        tool.main([str(plain), "--top", "0"])
    assert (
        exit.value.code == 2
        and "--top must be a positive number of rows, got 0" in capsys.readouterr().err
    )
