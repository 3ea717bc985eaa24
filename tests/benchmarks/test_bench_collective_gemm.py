"""benchmarks/bench_collective_gemm.py on the CPU (gloo, two ranks, a tiny layer): every GEMM of
the layer timed each way, the records written, copy engines refused with the reason."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_collective_gemm.py"
spec = importlib.util.spec_from_file_location("bench_collective_gemm", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def launch(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPT),
            "--hidden",
            "64",
            "--ffn",
            "128",
            "--tokens",
            "32",
            "--calls",
            "2",
            *args,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_layer_s_gemms_at_tensor_parallel_shapes():
    assert bench.shapes(2048, 8192, 2) == [
        ("QKV", "column", 2048, 3072),
        ("fc1", "column", 2048, 4096),
        ("proj", "row", 1024, 2048),
        ("fc2", "row", 4096, 2048),
    ]


def test_every_gemm_is_timed_each_way_and_recorded(tmp_path):
    done = launch("--output", str(tmp_path / "gemms.json"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    records = json.loads((tmp_path / "gemms.json").read_text())
    assert records["ranks"] == 2 and records["graphed"] is False
    assert records["sm_carveout"] is None  # no copy engines, no SMs left to them
    assert [r["gemm"] for r in records["records"]] == ["QKV", "fc1", "proj", "fc2"]
    for r in records["records"]:
        assert all(r[key] > 0 for key in ("gemm_us", "transfer_us", "plain_us", "nccl_us"))
        assert "copy-engine_us" not in r  # gloo: the default leaves the copy engines out
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert table[0].startswith("| GEMM |") and "hidden, nccl" in table[0] and len(table) == 6


def test_a_negative_sm_carveout_is_refused(tmp_path):
    done = launch("--sm-carveout", "-1", cwd=tmp_path)
    assert done.returncode != 0 and "--sm-carveout -1: give 0 or more SMs" in done.stderr


def test_copy_engines_asked_for_where_they_cannot_run_are_refused(tmp_path):
    done = launch("--transports", "copy-engine", cwd=tmp_path)
    assert done.returncode != 0
    assert (
        "--transports copy-engine: copy engines need CUDA GPUs and the NCCL backend" in done.stderr
    )
