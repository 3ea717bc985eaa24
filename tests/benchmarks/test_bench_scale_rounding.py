"""benchmarks/bench_scale_rounding.py on the CPU: fitted against power-of-two fine-grained scales,
each GEMM's error from the casts alone."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "bench_scale_rounding", REPO / "benchmarks" / "bench_scale_rounding.py"
)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_every_recipe_scale_kind_and_gemm_is_measured(tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = ["--tokens", "256", "--features", "128", "256", "--seeds", "2", "--json", str(out)]
    assert bench.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["recipe"], r["scales"], r["gemm"]) for r in rows] == [
        (recipe, scales, gemm)
        for recipe in ("rowwise", "blockwise")
        for scales in ("fp32", "power of two")
        for gemm in ("fprop", "dgrad", "wgrad")
    ]
    # E4M3 keeps 3 mantissa bits: a relative rounding error of at most 2**-4 an element
    assert all(0 < r["error"] < 2**-4 and 0 <= r["flushed"] < 0.05 for r in rows)
    assert capsys.readouterr().out.count("\n") == 2 + len(rows)


def test_power_of_two_scales_round_alike_whatever_the_block():
    """Scaled by a power of two, a normal value keeps its mantissa: its E4M3 rounding is the same
    for any block it is scaled with, so rowwise and blockwise dequantize to the same values."""
    generator = torch.Generator().manual_seed(0)
    # magnitudes over 12 binades, none small enough for any block's scale to make subnormal
    x = torch.rand(256, 512, generator=generator) + 0.5
    x *= 2.0 ** torch.randint(-6, 6, (256, 512), generator=generator)
    x[:, ::3] *= -1
    counts = torch.zeros(3, dtype=torch.int64)
    row = bench.cast(x, (1, None), True, counts)
    block = bench.cast(x, (1, 128), True, counts)
    assert counts[2] == 0  # nothing subnormal enough to flush: the claim's condition
    assert torch.equal(row, block)
    # a fitted scale moves the rounding grid with the block's peak
    assert not torch.equal(
        bench.cast(x, (1, None), False, counts), bench.cast(x, (1, 128), False, counts)
    )


def test_sizes_must_split_into_blocks(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "100"])
    assert "multiples of 128" in capsys.readouterr().err
