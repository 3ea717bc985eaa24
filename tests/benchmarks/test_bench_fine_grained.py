"""benchmarks/bench_fine_grained.py: refuses a machine without a GPU, and on one times every
granularity's GEMMs, casts and layer steps."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_fine_grained.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the test below")
def test_without_a_gpu_it_says_so():
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1 and "needs a CUDA GPU" in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 tensor cores",
)
def test_every_granularity_is_timed(tmp_path):
    out = tmp_path / "fine_grained.json"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "1b", "--tokens", "1024", "--json", str(out)],
        cwd=REPO / "benchmarks",
        check=True,
        timeout=600,
    )
    linears = json.loads(out.read_text())["linears"]
    assert len(linears) == 4
    for linear in linears:
        assert set(linear["gemms"]) == {"bf16", "tensorwise", "rowwise", "blockwise"}
        assert all(len(t) == 3 and min(t) > 0 for t in linear["gemms"].values())
        assert set(linear["layers"]) == {"bf16", "delayed", "rowwise", "blockwise"}
        assert min(linear["layers"].values()) > 0
        casts = linear["casts"]
        for name in ("rowwise", "blockwise"):
            assert all(casts[f"grad_{name}{extra}"] > 0 for extra in ("", "_col_sums", "_counts"))
        assert casts["bias_sum_torch"] > 0
    # gelu_tanh, gelu, swiglu x rowwise, blockwise x forward, backward x unfused, fused
    activations = json.loads(out.read_text())["activations"]
    assert len(activations) == 24 and min(activations.values()) > 0
