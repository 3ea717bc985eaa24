"""megafp8.planner.layer_map: the layer-map format, as bench_layer_grid.py writes a point and the
throughput model reads it back."""

import json

import pytest
from megafp8.models.config import preset

from megafp8.planner import layer_map
from megafp8.planner.throughput import Calibration

GPT, LLAMA = preset("gpt-1.3b"), preset("llama2-7b")


def test_a_written_point_reads_back_as_the_throughput_model_takes_it(tmp_path):
    times = {"ms": {"bf16": 5.0, "delayed": 4.0}, "fwd_ms": {"bf16": 1.6, "delayed": 1.3}}
    entry = layer_map.point(
        GPT,
        2048,
        4,
        2,
        True,
        times,
        head={"bf16": 8.0, "delayed": 7.0},
        model="gpt-1.3b",
        flops=4e12,
    )
    assert (entry["arch"], entry["tp"], entry["tp_comm_overlap"], entry["vocab"]) == (
        "gpt",
        2,
        True,
        GPT.vocab_size,
    )
    assert entry["delayed_tflops"] == pytest.approx(4e12 / 4.0 / 1e9)
    path = tmp_path / "map.json"
    layer_map.write({"device": "NVIDIA H200", "tp": 2, "points": [entry], "copy_gbs": 3000.0}, path)
    assert not (tmp_path / "map.json.partial").exists()
    read = layer_map.read(path)["points"][0]
    assert layer_map.same_layer(read, GPT, 2048, 2)
    assert not layer_map.same_layer(read, GPT, 4096, 2) and not layer_map.same_layer(
        read, GPT, 2048, 1
    )
    assert not layer_map.same_layer(read, LLAMA, 2048, 2)
    assert (
        layer_map.measured(read, "delayed"),
        layer_map.measured(read, "bf16", "fwd_ms"),
        layer_map.measured(read, "delayed", "head"),
        layer_map.measured(read, "delayed", "host_ms"),
    ) == (4.0, 1.6, 7.0, None)
    layer = Calibration.load([path]).layer(GPT, 2048, 4, 2, "delayed", [])
    assert (layer["step"], layer["forward"], layer["head"], layer["host"]) == (4.0, 1.3, 7.0, None)


def test_a_file_that_is_no_layer_map_is_refused_with_what_to_do(tmp_path):
    empty, broken = tmp_path / "empty.json", tmp_path / "broken.json"
    empty.write_text(json.dumps({"tp": 1, "points": []}))
    broken.write_text("{")
    with pytest.raises(
        ValueError, match="empty.json: no layer-map points in it .write one with benchmarks/"
    ):
        layer_map.read(empty)
    with pytest.raises(ValueError, match="broken.json: not a readable JSON file"):
        layer_map.read(broken)
    assert layer_map.arch_of(LLAMA) == "llama" and layer_map.arch_of(GPT) == "gpt"
