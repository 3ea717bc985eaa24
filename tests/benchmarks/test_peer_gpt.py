"""benchmarks/peer_gpt.py, side_by_side_table.py and side_by_side.sh on the CPU: the peer trains a
shrunk GPT and reports it as one JSON line, asks for torchao by name, the table's ratios are the
runs' tokens/s divided, and the side-by-side script stops at once without a GPU."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
PEER = REPO / "benchmarks" / "peer_gpt.py"
TINY = [
    "--device",
    "cpu",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--vocab-size",
    "1000",
    "--warmup-steps",
    "1",
    "--steps",
    "2",
]


def _module(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _peer(*argv):
    return subprocess.run(
        [sys.executable, str(PEER), *argv], capture_output=True, text=True, check=False
    )


def test_the_peer_trains_its_shrunk_shape_on_the_cpu_and_prints_one_json_line(tmp_path):
    out = tmp_path / "runs.jsonl"
    done = _peer("--variant", "bf16", *TINY, "--output", str(out))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and out.read_text() == lines[0] + "\n"
    record = json.loads(lines[0])
    assert record["tokens_per_sec"] > 0 and record["step_ms"] > 0
    assert record["tokens_per_sec"] == pytest.approx(2 * 32 / (record["step_ms"] / 1e3))
    assert (record["variant"], record["device"], record["peak_memory_gib"]) == ("bf16", "cpu", None)
    assert (record["shape"], record["resized"]) == ("1b", True)  # 1b's sizes overridden
    assert (record["num_layers"], record["hidden_size"], record["ffn_hidden_size"]) == (2, 64, 256)
    assert record["padded_vocab_size"] == 1024  # megafp8's padding: a multiple of 128
    assert record["torch"] == torch.__version__ and "torchao" in record


def test_a_float8_variant_without_torchao_names_the_install(tmp_path):
    if importlib.util.find_spec("torchao") is not None:
        pytest.skip("torchao is installed here")
    done = _peer("--variant", "float8_tensorwise", *TINY)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]  # one line, no traceback
    assert "needs torchao" in done.stderr and "pip install 'megafp8[peer]'" in done.stderr


def test_the_trainer_flags_describe_the_peers_shapes():
    peer = _module("peer_gpt")
    config, seq, mbs = peer.shape_of(peer.parse(["--shape", "1b"]))
    sizes = (config.num_layers, config.hidden_size, config.num_attention_heads, config.ffn_size)
    assert sizes == (24, 2048, 16, 8192) and config.padded_vocab_size() == 50304
    assert peer.trainer_flags(config, seq, mbs) == [
        "--model",
        "gpt-1.3b",
        "--seq-length",
        "2048",
        "--micro-batch-size",
        "8",
        "--global-batch-size",
        "8",
    ]
    config, seq, mbs = peer.shape_of(peer.parse(["--shape", "7b"]))
    assert peer.trainer_flags(config, seq, mbs) == [
        "--model",
        "gpt-1.3b",
        "--num-layers",
        "8",
        "--hidden-size",
        "4096",
        "--num-attention-heads",
        "32",
        "--ffn-hidden-size",
        "16384",
        "--max-position-embeddings",
        "4096",
        "--seq-length",
        "4096",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
    ]


def print_table(path, records) -> str:
    """What side_by_side_table.py prints of `records`, written as JSON lines to `path`."""
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "side_by_side_table.py"), str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_the_table_divides_the_runs_tokens_per_second(tmp_path):
    megafp8 = [
        {
            "precision": "bf16",
            "label": "1b",
            "tokens_per_sec_per_gpu": 60000.0,
            "iteration_time_ms": 273.0,
            "peak_memory_gib": 49.3,
            "device": "H100",
        },
        {
            "precision": "delayed",
            "label": "1b",
            "tokens_per_sec_per_gpu": 80000.0,
            "iteration_time_ms": 205.0,
            "peak_memory_gib": 48.6,
            "device": "H100",
        },
    ]
    # a rerun: it counts
    peer = [
        {
            "benchmark": "peer_gpt",
            "variant": "bf16_compile",
            "tokens_per_sec": 50000.0,
            "step_ms": 328.0,
            "peak_memory_gib": 54.8,
            "device": "H100",
            "torch": "2.11",
            "torchao": "0.18.0",
        },
        {
            "benchmark": "peer_gpt",
            "variant": "float8_tensorwise",
            "tokens_per_sec": 1.0,
            "step_ms": 1.0,
            "peak_memory_gib": 1.0,
            "device": "H100",
            "torch": "2.11",
            "torchao": "0.18.0",
        },
        {
            "benchmark": "peer_gpt",
            "variant": "float8_tensorwise",
            "tokens_per_sec": 64000.0,
            "step_ms": 256.0,
            "peak_memory_gib": 43.6,
            "device": "H100",
            "torch": "2.11",
            "torchao": "0.18.0",
        },
    ]
    table = _module("side_by_side_table")
    ratios = {
        (top, bottom): value
        for top, bottom, value in table.ratios(table.latest_runs(megafp8 + peer))
    }
    assert ratios[("megafp8 FP8 delayed", "peer torchao float8 tensorwise")] == pytest.approx(1.25)
    assert ratios[("megafp8 bf16", "peer bf16 + compile")] == pytest.approx(1.2)
    assert ratios[("megafp8 FP8 delayed", "megafp8 bf16")] == pytest.approx(4 / 3)
    assert ratios[("peer torchao float8 tensorwise", "peer bf16 + compile")] == pytest.approx(1.28)
    assert ratios[("megafp8 FP8 current", "megafp8 bf16")] is None  # not run

    printed = print_table(tmp_path / "1b.jsonl", megafp8 + peer)
    assert printed.startswith("## 1b\n")
    assert "| megafp8 FP8 delayed | 80,000 | 205.0 | 48.60 | H100 |" in printed
    assert "| megafp8 FP8 current | not run | | | |" in printed and "peer bf16 eager" not in printed
    assert "| megafp8 FP8 delayed / peer torchao float8 tensorwise | **1.250x** |" in printed
    assert "| megafp8 FP8 current / megafp8 bf16 | not run |" in printed
    assert "torchao 0.18.0" in printed
    assert "ratio of peak memory" not in printed  # only for runs with more flags


def test_runs_with_more_flags_are_named_and_divided_by_their_namesakes(tmp_path):
    """side_by_side.sh's NAME: a run with EXTRA flags shows under its own name, beside the plain
    one, with its tokens/s and peak memory against it and against torchao."""
    records = [
        {
            "precision": "delayed",
            "label": "7b",
            "tokens_per_sec_per_gpu": 60000.0,
            "peak_memory_gib": 40.0,
        },
        {
            "precision": "delayed",
            "label": "7b, lean states",
            "tokens_per_sec_per_gpu": 59400.0,
            "peak_memory_gib": 28.0,
        },
        {
            "benchmark": "peer_gpt",
            "variant": "float8_tensorwise",
            "tokens_per_sec": 50000.0,
            "peak_memory_gib": 32.0,
            "torch": "2.11",
            "torchao": "0.18.0",
        },
    ]
    printed = print_table(tmp_path / "7b.jsonl", records)
    lines = printed.splitlines()
    plain = lines.index("| megafp8 FP8 delayed | 60,000 |  | 40.00 |  |")
    assert lines[plain + 2] == "| megafp8 FP8 delayed (lean states) | 59,400 |  | 28.00 |  |"
    assert "| megafp8 FP8 delayed (lean states) / megafp8 FP8 delayed | **0.990x** |" in lines
    assert (
        "| megafp8 FP8 delayed (lean states) / peer torchao float8 tensorwise | **1.188x** |"
        in lines
    )
    assert "| megafp8 FP8 delayed (lean states) / megafp8 FP8 delayed | 0.700x |" in lines
    assert (
        "| megafp8 FP8 delayed (lean states) / peer torchao float8 tensorwise | 0.875x |" in lines
    )


def test_side_by_side_stops_at_once_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "side_by_side.sh"), "1b"],
        capture_output=True,
        text=True,
        env={**os.environ, "RESULTS": str(tmp_path / "results")},
        timeout=60,
        check=False,
    )
    assert done.returncode != 0 and "needs an NVIDIA GPU" in done.stderr
    assert not (tmp_path / "results").exists()  # stopped before any run


def test_fine_grained_runs_are_set_beside_torchaos_rowwise_where_they_ran(tmp_path):
    """A rowwise run is divided by torchao's rowwise peer, our bf16 and our FP8 delayed; a
    recipe that did not run adds neither a row nor a ratio."""
    records = [
        {"precision": p, "label": "7b", "tokens_per_sec_per_gpu": tps, "device": "H200"}
        for p, tps in (("bf16", 40000.0), ("delayed", 60000.0), ("rowwise", 50000.0))
    ] + [
        {
            "benchmark": "peer_gpt",
            "variant": "float8_rowwise",
            "tokens_per_sec": 45000.0,
            "device": "H200",
            "torch": "2.11",
            "torchao": "0.18.0",
        }
    ]
    printed = print_table(tmp_path / "7b.jsonl", records)
    for bottom, ratio in (
        ("peer torchao float8 rowwise", "1.111"),
        ("megafp8 bf16", "1.250"),
        ("megafp8 FP8 delayed", "0.833"),
    ):
        assert f"| megafp8 FP8 rowwise / {bottom} | **{ratio}x** |" in printed
    assert "blockwise" not in printed
