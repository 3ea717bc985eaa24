"""tools/plot_runs.py: a PNG from two runs' metrics.jsonl, and clear errors on bad input."""

import json

import pytest

from .load import load_tool

plot_runs = load_tool("plot_runs")
pytest.importorskip("matplotlib")  # the dev extra installs it

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(folder, records):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return folder


def training_records(offset, fp8=True):
    records = []
    for it in range(10, 110, 10):
        record = {
            "iteration": it,
            "time": 0.0,
            "loss": 8.0 - it / 50 + offset,
            "lr": 1e-3,
            "grad_norm": 1.0,
        }
        if fp8:
            record.update(fp8_scale_min=50.0 + it, fp8_scale_max=1e10, fp8_saturation=1e-6)
        records.append(record)
        if it % 50 == 0:
            records.append(
                {
                    "iteration": it,
                    "time": 0.0,
                    "valid_loss": 8.1 - it / 50 + offset,
                    "valid_ppl": 1.0,
                }
            )
    return records


def test_two_runs_make_a_png(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", training_records(0.0, fp8=False))
    fp8 = write_run(tmp_path / "fp8", training_records(0.02))
    # A resumed run logs iteration 100 again: the later record counts.
    with open(fp8 / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"iteration": 100, "time": 1.0, "loss": "nan"}) + "\n")
    output = tmp_path / "out" / "curves.png"
    assert (
        plot_runs.main(
            [
                str(bf16),
                str(fp8 / "metrics.jsonl"),
                "--output",
                str(output),
                "--fields",
                "fp8_saturation",
                "fp8_scale_min",
                "--log-y",
                "fp8_scale_min",
                "--smooth",
                "3",
            ]
        )
        == 0
    )
    assert output.read_bytes().startswith(PNG) and output.stat().st_size > 10_000
    assert f"wrote {output}" in capsys.readouterr().out
    run = plot_runs.read_run(fp8 / "metrics.jsonl")
    iterations, losses = run["loss"]
    # NaN, the later record
    assert iterations == list(range(10, 110, 10)) and losses[-1] != losses[-1]
    assert run["valid_loss"][0] == [50, 100]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no metrics.jsonl there"),
        ("", "no logged iteration"),
        ("{not json\n", "line 1: not JSON"),
        ('{"loss": 3.0}\n', 'without an integer "iteration"'),
    ],
)
def test_bad_input_is_refused_clearly(tmp_path, capsys, content, message):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content)
    assert plot_runs.main([str(run), "--output", str(tmp_path / "c.png")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def test_an_unknown_field_names_the_known_ones(tmp_path, capsys):
    run = write_run(tmp_path / "bf16", training_records(0.0, fp8=False))
    assert (
        plot_runs.main(
            [str(run), "--output", str(tmp_path / "c.png"), "--fields", "fp8_saturation"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--fields fp8_saturation: no run logged it" in err and "grad_norm" in err


def test_label_count_must_match(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        plot_runs.parse_args(["a", "b", "--output", "c.png", "--labels", "one"])
    assert exit.value.code == 2 and "--labels: 1 labels for 2 runs" in capsys.readouterr().err


def test_table_of_final_losses_against_the_first_run(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", training_records(0.0, fp8=False))
    spiky = training_records(0.02)
    for record in spiky:  # one spike, 1.0 above the best loss so far, at iteration 60
        if record["iteration"] == 60 and "loss" in record:
            record["loss"] = 8.0 - 50 / 50 + 0.02 + 1.0
    fp8 = write_run(tmp_path / "fp8", spiky)
    table = tmp_path / "final.md"
    assert (
        plot_runs.main(
            [
                str(bf16),
                str(fp8),
                "--output",
                str(tmp_path / "c.png"),
                "--labels",
                "bf16",
                "FP8",
                "--table",
                str(table),
                "--final-points",
                "2",
            ]
        )
        == 0
    )
    assert f"and {table}" in capsys.readouterr().out
    header, rule, base, other = table.read_text().splitlines()
    assert "vs bf16" in header and "mean of last 2 logged" in header
    # bf16: valid 8.1 - 2 = 6.1 at 100; training loss mean of iterations 90 and 100: 6.1; no spike.
    assert base == "| bf16 | 100 | 6.1000 | +0.00% | 6.1000 | +0.00% | 0.0% |"
    # FP8: 0.02 higher everywhere; its spike rises 1.0 over the lowest loss before it, 7.02.
    assert other == (
        f"| FP8 | 100 | 6.1200 | {100 * (6.12 / 6.1 - 1):+.2f}% | 6.1200 | "
        f"{100 * (6.12 / 6.1 - 1):+.2f}% | {100 * (8.02 / 7.02 - 1):.1f}% |"
    )


def test_the_table_compares_training_losses_along_the_run_from_an_iteration(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", training_records(0.0, fp8=False))
    records = training_records(0.0)
    for record in records:  # 1% above bf16 from iteration 50 on, 3% at iteration 80
        if "loss" in record and record["iteration"] >= 50:
            record["loss"] *= 1.03 if record["iteration"] == 80 else 1.01
    fp8 = write_run(tmp_path / "fp8", records)
    table = tmp_path / "final.md"
    args = [str(bf16), str(fp8), "--output", str(tmp_path / "c.png"), "--labels", "bf16", "FP8"]
    assert plot_runs.main(args + ["--table", str(table), "--train-from", "50"]) == 0
    header, _, base, other = table.read_text().splitlines()
    assert header.endswith("| training loss vs bf16 from iteration 50 (mean, largest) |")
    assert base.endswith("| +0.00%, +0.00% |")
    # iterations 50-100: five at +1% and one at +3%
    assert other.endswith(f"| {(5 * 1 + 3) / 6:+.2f}%, +3.00% |")
    # averaged over 2 logged points: iteration 50's pair holds 40's unchanged loss, and the +3%
    # at 80 shows in 80's and 90's pairs
    assert (
        plot_runs.main(args + ["--table", str(table), "--train-from", "50", "--smooth", "2"]) == 0
    )
    loss = {it: 8.0 - it / 50 for it in range(40, 110, 10)}
    factor = {it: 1.03 if it == 80 else 1.01 if it >= 50 else 1.0 for it in loss}
    gaps = [
        (loss[it - 10] * factor[it - 10] + loss[it] * factor[it]) / (loss[it - 10] + loss[it]) - 1
        for it in range(50, 110, 10)
    ]
    mean, largest = 100 * sum(gaps) / len(gaps), 100 * max(gaps)
    assert table.read_text().splitlines()[-1].endswith(f"| {mean:+.2f}%, {largest:+.2f}% |")
    # beyond the runs' last iteration there is nothing to compare
    assert plot_runs.main(args + ["--table", str(table), "--train-from", "200"]) == 0
    assert table.read_text().splitlines()[-1].endswith("| – |")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        plot_runs.main(args + ["--train-from", "50"])
    assert "--train-from adds a column to the table" in capsys.readouterr().err


def test_repeats_give_each_setting_its_mean_against_the_first(tmp_path, capsys):
    # two settings of two runs: bf16 at offsets 0 and 0.02, FP8 at 0.04 and 0.10
    runs = [
        str(write_run(tmp_path / name, training_records(offset, fp8=False)))
        for name, offset in (("b1", 0.0), ("b2", 0.02), ("f1", 0.04), ("f2", 0.10))
    ]
    table = tmp_path / "final.md"
    args = [*runs, "--output", str(tmp_path / "c.png"), "--table", str(table)]
    labels = ["--labels", "bf16", "bf16 again", "FP8", "FP8 again"]
    assert plot_runs.main(args + labels + ["--repeats", "2", "--train-from", "50"]) == 0
    text = table.read_text()
    per_run, means = text.split("\n\n", 1)
    assert len(per_run.splitlines()) == 6  # the per-run table as before, one row a run
    caption, _, header, _, base, fp8 = means.splitlines()
    assert caption == "Each setting over its 2 runs, against bf16's:"
    assert header.endswith("| mean training loss vs bf16's from iteration 50 (mean, largest) |")
    # final validation 6.1 + offset; training loss (last 10 points: iterations 10-100) 6.9 + offset
    assert (
        base
        == "| bf16 | 6.1100 | +0.00% | "
        + f"{100 * (6.12 / 6.1 - 1):.2f}% | 6.9100 | +0.00% | +0.00%, +0.00% |"
    )
    valid_gap, train_gap = 100 * (6.17 / 6.11 - 1), 100 * (6.97 / 6.91 - 1)
    # along the run the mean curves stay 0.06 apart: the gap is largest where the loss is lowest
    along = [100 * (0.06 / (8.01 - it / 50)) for it in range(50, 110, 10)]
    assert fp8 == (
        f"| FP8 | 6.1700 | {valid_gap:+.2f}% | {100 * (6.2 / 6.14 - 1):.2f}% | 6.9700 | "
        f"{train_gap:+.2f}% | {sum(along) / len(along):+.2f}%, {max(along):+.2f}% |"
    )
    capsys.readouterr()
    for bad, message in (
        (["--repeats", "3"], "--repeats 3: give 2 or more, dividing the 4 runs"),
        (["--repeats", "1"], "--repeats 1: give 2 or more"),
    ):
        with pytest.raises(SystemExit):
            plot_runs.main(args + bad)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot_runs.main(runs + ["--output", str(tmp_path / "c.png"), "--repeats", "2"])
    assert "--repeats adds a table of means: give --table too" in capsys.readouterr().err


def test_table_needs_a_training_loss_in_every_run(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", training_records(0.0, fp8=False))
    only_valid = write_run(tmp_path / "v", [{"iteration": 100, "valid_loss": 6.0}])
    assert (
        plot_runs.main(
            [
                str(bf16),
                str(only_valid),
                "--output",
                str(tmp_path / "c.png"),
                "--table",
                str(tmp_path / "t.md"),
            ]
        )
        == 2
    )
    assert "--table: v logged no training loss" in capsys.readouterr().err
    assert not (tmp_path / "t.md").exists()


def test_relative_panel_compares_validation_losses_with_the_first_run(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", training_records(0.0, fp8=False))
    fp8 = write_run(tmp_path / "fp8", training_records(0.02))
    untested = write_run(
        tmp_path / "untested", [r for r in training_records(0.0) if "valid_loss" not in r]
    )
    runs = [plot_runs.read_run(path / "metrics.jsonl") for path in (bf16, fp8, untested)]
    base, other, none = plot_runs.relative_to_first(runs)
    assert base == ([50, 100], [0.0, 0.0]) and none is None
    assert other[0] == [50, 100] and other[1] == pytest.approx([100 * 0.02 / 7.1, 100 * 0.02 / 6.1])
    output = tmp_path / "c.png"
    assert (
        plot_runs.main([str(bf16), str(fp8), str(untested), "--output", str(output), "--relative"])
        == 0
    )
    assert output.read_bytes().startswith(PNG)
    capsys.readouterr()
    assert plot_runs.main([str(untested), str(bf16), "--output", str(output), "--relative"]) == 2
    assert (
        "--relative: the first run (the baseline) logged no valid_loss" in capsys.readouterr().err
    )


def test_default_labels_are_the_runs_names(tmp_path):
    def labels(*folders):
        return plot_runs.default_labels(
            [write_run(tmp_path / folder, []) / "metrics.jsonl" for folder in folders]
        )

    assert labels("runs/bf16", "runs/fp8") == ["bf16", "fp8"]
    # The recipes and the quickstart save to WORKDIR/checkpoints: the run is WORKDIR.
    assert labels("quickstart_run/checkpoints", "gpt_1b_fp8/checkpoints") == [
        "quickstart_run",
        "gpt_1b_fp8",
    ]
    # told apart
    assert labels("gpt/bf16", "lr2x/bf16", "lr2x/fp8") == [
        "gpt/bf16",
        "lr2x/bf16",
        "lr2x/fp8",
    ]
    (tmp_path / "runs" / "bf16" / "metrics.jsonl").rename(tmp_path / "bf16_seed1.jsonl")
    assert plot_runs.default_labels([tmp_path / "bf16_seed1.jsonl"]) == ["bf16_seed1"]


def test_the_table_names_a_checkpoints_folder_by_its_run(tmp_path, capsys):
    run = write_run(tmp_path / "quickstart_run" / "checkpoints", training_records(0.0))
    table = tmp_path / "final.md"
    assert (
        plot_runs.main([str(run), "--output", str(tmp_path / "c.png"), "--table", str(table)]) == 0
    )
    assert table.read_text().splitlines()[2].startswith("| quickstart_run | 100 |")
