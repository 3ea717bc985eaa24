"""benchmarks/bench_layer_grid.py: the GPT-3 family's layer shapes, the heat maps from grid files
(on the CPU), and a small grid timed on a GPU."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "bench_layer_grid", REPO / "benchmarks" / "bench_layer_grid.py"
)
grid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grid)


@pytest.mark.parametrize(
    "arch, hidden, heads, kv_heads, ffn",
    [
        ("gpt", 768, 12, 12, 3072),  # GPT-3 125M (GPT-2 small)
        ("gpt", 2048, 16, 16, 8192),  # GPT-3 1.3B widths, head dim 128
        ("llama", 4096, 32, 32, 11008),  # Llama-2-7B
        ("llama", 8192, 64, 8, 22016),  # 70B-wide, GQA 8 (Llama-2-70B has a wider SwiGLU, 28672)
    ],
)
def test_layer_shapes_follow_the_family(arch, hidden, heads, kv_heads, ffn):
    config = grid.layer_config(arch, hidden, 4096)
    shape = (config.num_layers, config.num_attention_heads, config.kv_heads, config.ffn_size)
    assert shape == (1, heads, kv_heads, ffn)
    assert config.max_position_embeddings == 4096
    assert (config.activation == "swiglu") == (arch == "llama")


def test_layer_flops_count_linears_and_causal_attention():
    config = grid.layer_config("gpt", 768, 1024)
    tokens, h = 2048, 768
    linears = 2 * tokens * (h * 3 * h + h * h + 2 * h * 4 * h)  # QKV, proj, fc1, fc2
    attention = 2 * tokens * 1024 * h
    assert grid.layer_flops(config, tokens, 1024) == 3 * (linears + attention)


def point(arch, tp, hidden, seq, micro_batch, delayed, current):
    return {
        "arch": arch,
        "hidden": hidden,
        "seq": seq,
        "micro_batch": micro_batch,
        "tp": tp,
        "speedup_delayed": delayed,
        "speedup_current": current,
    }


def test_heat_maps_from_grid_files(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    one = {
        "tp": 1,
        "device": "NVIDIA H100 80GB HBM3",
        "points": [
            point("gpt", 1, h, s, b, 0.9 + h / 4096 + b / 20, 0.8 + h / 4096)
            for h in (768, 2048, 4096)
            for s in (1024, 2048)
            for b in (1, 4)
        ],
    }
    one["points"][0]["speedup_current"] = None  # a point that did not fit
    # a file without its GPU
    two = {
        "tp": 2,
        "points": [point("llama", 2, 4096, 4096, 1, 1.1, 1.0)],
    }
    late = {"tp": 1, "device": "NVIDIA H200", "points": [point("gpt", 1, 12288, 2048, 1, 1.6, 1.5)]}
    late["points"][0].update(rowwise_ms=1.0, speedup_rowwise=1.25)  # a grid run with --recipes
    two["points"][0].update(
        bf16_ms=2.2, delayed_ms=2.0, current_ms=2.2, delayed_tflops=812.4, model="llama2-7b"
    )
    (tmp_path / "one.json").write_text(json.dumps(one))
    (tmp_path / "two.json").write_text(json.dumps(two))
    (tmp_path / "late.json").write_text(json.dumps(late))
    import matplotlib.axes  # the cell labels, read as they are drawn

    starred, draw = [], matplotlib.axes.Axes.text
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "text",
        lambda axis, x, y, label, *args, **kwargs: (
            starred.extend([label] if str(label).endswith("*") else []),
            draw(axis, x, y, label, *args, **kwargs),
        )[1],
    )
    grid.main(
        [
            "--plot",
            *(str(tmp_path / f"{name}.json") for name in ("one", "two", "late")),
            "--plot-dir",
            str(tmp_path / "img"),
            "--table",
            str(tmp_path / "grid.md"),
        ]
    )
    assert starred == ["1.60*", "1.50*"]  # the H200 point among the H100 ones, in both maps
    written = sorted(p.name for p in (tmp_path / "img").iterdir())
    assert written == ["layer_grid_gpt_tp1.png", "layer_grid_llama_tp2.png"]
    assert all((tmp_path / "img" / name).read_bytes().startswith(b"\x89PNG") for name in written)
    assert "layer_grid_gpt_tp1.png" in capsys.readouterr().out
    rows = (tmp_path / "grid.md").read_text().splitlines()
    assert len(rows) == 2 + 13 + 1  # header, the 13 GPT points, the Llama one
    # a rowwise column, since a point has one; no blockwise column
    assert "| current ms | rowwise ms | delayed / bf16 |" in rows[0] and "blockwise" not in rows[0]
    assert "| current / bf16 | rowwise / bf16 | delayed TFLOP/s |" in rows[0]
    assert (
        rows[-1]
        == "| llama2-7b | 2 | 4096 | 4096 | 1 | 2.200 | 2.000 | 2.200 | – | 1.10 | 1.00 | – | 812 | ? |"
    )
    # times a test point lacks
    assert rows[2].startswith("| gpt | 1 | 768 | 1024 | 1 | – | – | – |")
    assert rows[2].endswith("| H100 80GB HBM3 |") and rows[-2].endswith("| H200 |")
    with pytest.raises(SystemExit):
        grid.main(["--table", str(tmp_path / "alone.md")])


def test_a_grid_file_without_points_is_refused(tmp_path):
    (tmp_path / "empty.json").write_text(json.dumps({"tp": 1, "points": []}))
    with pytest.raises(SystemExit, match="empty.json: no layer-map points in it"):
        grid.main(["--plot", str(tmp_path / "empty.json")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_timing_needs_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="has none"):
        grid.main(["--output", str(tmp_path / "g.json")])
    assert not (tmp_path / "g.json").exists()


@pytest.mark.gpu
def test_a_small_grid_on_a_gpu(tmp_path):
    out = tmp_path / "grid.json"
    grid.main(
        [
            "--output",
            str(out),
            "--hidden-sizes",
            "256",
            "--seq-lengths",
            "512",
            "--micro-batches",
            "1",
            "2",
        ]
    )
    result = json.loads(out.read_text())
    assert result["tp"] == 1 and len(result["points"]) == 4  # 2 architectures x 2 micro-batches
    for p in result["points"]:
        assert all(
            p[f"{name}_ms"] > 0 and p[f"{name}_tflops"] > 0
            for name in ("bf16", "delayed", "current")
        )
        assert all(
            0 < p[f"{name}_fwd_ms"] < p[f"{name}_ms"] for name in ("bf16", "delayed", "current")
        )
        assert p["speedup_delayed"] == p["bf16_ms"] / p["delayed_ms"]


@pytest.mark.gpu
def test_a_grid_of_the_fine_grained_recipes_on_a_gpu(tmp_path):
    out = tmp_path / "grid.json"
    grid.main(
        [
            *("--output", str(out), "--archs", "gpt", "--hidden-sizes", "256"),
            *("--seq-lengths", "512", "--micro-batches", "1"),
            *("--recipes", "bf16", "rowwise", "blockwise"),
        ]
    )
    (p,) = json.loads(out.read_text())["points"]
    assert all(p[f"{name}_ms"] > 0 for name in ("bf16", "rowwise", "blockwise"))
    assert p["speedup_blockwise"] == p["bf16_ms"] / p["blockwise_ms"] and "delayed_ms" not in p


@pytest.mark.gpu
def test_a_presets_layer_and_output_end_on_a_gpu(tmp_path):
    out = tmp_path / "model.json"
    grid.main(
        [
            "--output",
            str(out),
            "--model",
            "llama-120m",
            "--seq-lengths",
            "512",
            "--micro-batches",
            "2",
        ]
    )
    result = json.loads(out.read_text())
    (point,) = result["points"]
    assert (
        point["model"],
        point["arch"],
        point["hidden"],
        point["kv_heads"],
        point["ffn"],
        point["vocab"],
    ) == ("llama-120m", "llama", 768, 4, 2048, 32000)
    assert all(point[f"head_{name}_ms"] > 0 for name in ("bf16", "delayed", "current"))
    # Selective recomputation runs the attention core once more: dearer than the step, cheaper
    # than recomputing the whole forward.
    assert all(
        point[f"{name}_ms"]
        < point[f"{name}_selective_ms"]
        < point[f"{name}_ms"] + point[f"{name}_fwd_ms"]
        for name in ("bf16", "delayed", "current")
    )
    assert result["copy_gbs"] > 100
    # The stack's host time splits into a share per layer and one per pass that add up to a
    # one-layer step's (or, where the stack's layers came out dearer than a lone one, as bf16's,
    # with nothing per pass, may by noise: the layer's share alone): measured for every recipe
    # (ten steps of the four-layer stack once filled the GPU's launch queue and waited on it,
    # leaving the split unrecorded).
    for name in ("bf16", "delayed", "current"):
        layer, per_pass, one = (
            point[f"{name}_host_{kind}"] for kind in ("layer_ms", "pass_ms", "ms")
        )
        assert None not in (layer, per_pass, one), (
            f"{name}: a host time was not recorded (the step waited on the GPU)"
        )
        assert layer > 0 and per_pass >= 0 and one > 0
        assert layer + per_pass == pytest.approx(max(one, layer))
