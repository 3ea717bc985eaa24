"""Metrics: the FLOPs count, throughput and MFU, FP8 health, the logger's outputs and the run summary."""

import fcntl
import io
import json
import math
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
import types

import pytest
import torch
from megafp8.models import preset

from megafp8.training import metrics
from megafp8.training.metrics import (
    MetricsError,
    MetricsLogger,
    Throughput,
    flops_per_token,
    memory_stats,
    peak_bf16_flops,
    peak_bf16_flops_by_name,
    run_summary,
)

# -- FLOPs ----------------------------------------------------------------------------------


def test_flops_hand_count_with_gqa_and_swiglu():
    config = preset("llama-tiny")  # 2 layers, hidden 64, 4 heads of 16, 2 kv heads, ffn 128
    s = 32
    gemm_weights = (
        64 * (64 + 2 * 32)  # QKV: 4 query heads + 2 key + 2 value heads of 16
        + 64 * 64  # output projection
        + 64 * 2 * 128  # SwiGLU gate and up
        + 128 * 64  # down
    )
    assert gemm_weights == 36864
    # + QK^T and AV, forward and backward
    per_layer = 6 * gemm_weights + 3 * (2 * s * 64 + 2 * s * 64)
    output_layer = 6 * 64 * 1024  # vocabulary 1000 padded to 1024
    assert flops_per_token(config, s) == 2 * per_layer + output_layer == 884736


def test_flops_match_megatrons_closed_form_for_gpt():
    config = preset("gpt-125m")
    s, h, L, V = 2048, 768, 12, config.padded_vocab_size()
    megatron = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))  # per token, no recompute
    assert flops_per_token(config, s) == pytest.approx(megatron, rel=1e-12)


def test_recompute_adds_the_recomputed_forward():
    config, s = preset("gpt-tiny"), 32
    layer_forward = 2 * (12 * 64 * 64) + 4 * s * 64
    core_forward = 4 * s * 64
    model = flops_per_token(config, s)
    assert flops_per_token(config, s, recompute="full") == model + 2 * layer_forward
    assert flops_per_token(config, s, recompute="selective") == model + 2 * core_forward
    with pytest.raises(ValueError, match="recompute"):
        flops_per_token(config, s, recompute="some")


def test_vocabulary_padding_follows_tensor_parallelism():
    # vocabulary 1000: 1024 at tp 1 (multiples of 128), 1152 at tp 3 (of 384)
    config = preset("gpt-tiny")
    assert flops_per_token(config, 32, tp_size=3) - flops_per_token(config, 32) == 6 * 64 * 128


# -- peaks, throughput, MFU -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_by_gpu_name(name, peak):
    assert peak_bf16_flops_by_name(name) == peak


def test_no_peak_on_the_cpu():
    assert peak_bf16_flops("cpu") is None
    assert peak_bf16_flops(torch.device("cpu")) is None


def fake_clock(monkeypatch, times):
    ticks = iter(times)
    monkeypatch.setattr(metrics, "perf_counter", lambda: next(ticks))


def test_throughput_and_mfu_with_a_fake_peak(monkeypatch):
    fake_clock(monkeypatch, [100.0, 102.0, 103.0])
    throughput = Throughput(
        flops_per_token=6e6, world_size=4, peak_flops=1e12, hardware_flops_per_token=8e6
    )
    for _ in range(4):
        throughput.add(5000)
    stats = throughput.read()  # 20000 tokens in 2 s
    assert stats["iteration_time_ms"] == pytest.approx(500.0)
    assert stats["tokens_per_sec"] == pytest.approx(10000.0)
    assert stats["tflops_per_gpu"] == pytest.approx(10000 * 6e6 / 4 / 1e12)
    assert stats["mfu"] == pytest.approx(10000 * 6e6 / 4 / 1e12)  # the peak is 1 TFLOP/s
    assert stats["hw_tflops_per_gpu"] == pytest.approx(10000 * 8e6 / 4 / 1e12)
    throughput.add(3000)
    assert throughput.read()["tokens_per_sec"] == pytest.approx(3000.0)  # a new window: 1 s


def line_of(tmp_path, record, **options):
    """The line a MetricsLogger prints for `record` at iteration 1."""
    stream = io.StringIO()
    with MetricsLogger(tmp_path, stream=stream, **options) as logger:
        logger.log(1, record)
    return stream.getvalue()


def test_no_peak_means_mfu_na_on_a_gpu(monkeypatch, tmp_path):
    fake_clock(monkeypatch, [0.0, 1.0])
    throughput = Throughput(flops_per_token=1e6, device="cpu")
    throughput.add(100)
    stats = throughput.read()
    assert stats["mfu"] is None
    assert "MFU: n/a" in line_of(tmp_path, stats, device="cuda")  # a GPU not in the peak table


def test_the_cpu_line_leaves_out_the_gpu_figures(monkeypatch, tmp_path):
    fake_clock(monkeypatch, [0.0, 2.0])
    throughput = Throughput(flops_per_token=1e6, device="cpu", hardware_flops_per_token=2e6)
    throughput.add(1000, iterations=4)
    record = {**throughput.read(), "loss": 2.0}
    for device in ("cpu", None):
        line = line_of(tmp_path / str(device), record, device=device, log_throughput=True)
        assert "lm loss: 2.000000E+00 | tokens/s: 500 | ms/iter: 500\n" in line
        assert "TFLOP/s" not in line and "MFU" not in line
        (written,) = read_jsonl(tmp_path / str(device) / "metrics.jsonl")
        assert (
            written["tflops_per_gpu"] == pytest.approx(500 * 1e6 / 1e12) and written["mfu"] is None
        )


def test_tflops_are_printed_only_with_log_throughput(tmp_path):
    record = {
        "tokens_per_sec": 1000.0,
        "tflops_per_gpu": 412.5,
        "hw_tflops_per_gpu": 530.0,
        "mfu": 0.417,
    }
    quiet = line_of(tmp_path / "quiet", record, device="cuda")
    assert "TFLOP/s" not in quiet and "tokens/s: 1000 | MFU: 41.7%\n" in quiet
    loud = line_of(tmp_path / "loud", record, device="cuda", log_throughput=True)
    assert "tokens/s: 1000 | TFLOP/s/GPU: 412.5 | with recompute: 530.0 | MFU: 41.7%\n" in loud
    for run in ("quiet", "loud"):  # the file keeps every number either way
        (written,) = read_jsonl(tmp_path / run / "metrics.jsonl")
        assert written["tflops_per_gpu"] == 412.5 and written["hw_tflops_per_gpu"] == 530.0


def test_fp8_fields_only_when_the_run_has_fp8_layers(tmp_path):
    without = line_of(
        tmp_path / "bf16",
        {
            "loss": 2.0,
            "skipped_steps": 0,
            "fp8_scale_min": None,
            "fp8_scale_max": None,
            "fp8_saturation": None,
        },
    )
    assert "fp8" not in without and "skipped" not in without and without.count("\n") == 1
    uncounted = line_of(
        tmp_path / "fp8",
        {"loss": 2.0, "fp8_scale_min": 1.0, "fp8_scale_max": 2.0, "fp8_saturation": None},
    )
    first, second = uncounted.splitlines()
    assert first.endswith("iteration 1 | lm loss: 2.000000E+00")
    assert second == " " * first.index("iteration") + "fp8 scale: [1, 2] | fp8 saturated: n/a"
    skipped = line_of(
        tmp_path / "skipped",
        {"loss": 2.0, "skipped_steps": 3, "fp8_scale_min": None, "fp8_scale_max": None},
    )
    assert skipped.splitlines()[1].strip() == "skipped iterations: 3"


def test_memory_on_the_cpu_is_the_resident_set():
    assert 0.01 < memory_stats("cpu")["memory_gib"] < 1024


# -- the logger -----------------------------------------------------------------------------


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_line_and_jsonl_record(tmp_path):
    stream = io.StringIO()
    logger = MetricsLogger(
        tmp_path, stream=stream, total_iterations=100, device="cuda", log_throughput=True
    )
    record = {
        "consumed_samples": 640,
        "loss": torch.tensor(2.5),
        "lr": 3e-4,
        "grad_norm": 1.25,
        "skipped_steps": 1,
        "tokens_per_sec": 12345.6,
        "tflops_per_gpu": 123.4,
        "mfu": 0.25,
        "memory_gib": 1.5,
        "fp8_scale_min": 2.0,
        "fp8_scale_max": 448.0,
        "fp8_saturation": 1e-5,
    }
    logger.log(10, record)
    # Flushed at once: a crash right now keeps the record.
    (written,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert written["iteration"] == 10 and written["loss"] == 2.5 and written["mfu"] == 0.25
    assert set(record) <= set(written) and "time" in written
    first, second = stream.getvalue().splitlines()
    assert re.fullmatch(
        r"\[\d\d:\d\d:\d\d\] iteration  10/100 \| lm loss: 2\.500000E\+00 \| lr: 3\.00E-04 \| "
        r"grad norm: 1\.250 \| tokens/s: 12346 \| TFLOP/s/GPU: 123\.4 \| MFU: 25\.0% \| "
        r"memory \(GiB\): 1\.50",
        first,
    ), first
    assert (
        second == " " * 11 + "fp8 scale: [2, 448] | fp8 saturated: 1.00e-05 | skipped iterations: 1"
    )
    logger.close()


def test_the_line_fits_a_terminal(tmp_path):
    """GPT-1.3B's record on a GPU, FP8 health included: each line fits 160 columns (Megatron's line of
    the same fields is over 350)."""
    record = {
        "consumed_samples": 960,
        "iteration_time_ms": 1060.1,
        "tokens_per_sec": 61823.4,
        "tflops_per_gpu": 546.9,
        "mfu": 0.553,
        "lr": 2.060855e-05,
        "loss": 6.778075,
        "grad_norm": 1.195,
        "skipped_steps": 0,
        "memory_gib": 35.39,
        "fp8_scale_min": 64.3,
        "fp8_scale_max": 2.01e11,
        "fp8_saturation": 0.0,
        "fp8_underflow": 1.2e-06,
    }
    stream = io.StringIO()
    with MetricsLogger(tmp_path, stream=stream, total_iterations=500, device="cuda") as logger:
        logger.log(30, record)
    first, second = stream.getvalue().splitlines()
    assert len(first) <= 160 and len(second) <= 100, (first, second)


def test_jsonl_keeps_non_finite_values_as_strings(tmp_path):
    stream = io.StringIO()
    with MetricsLogger(tmp_path, stream=stream) as logger:
        logger.log(
            1,
            {
                "loss": torch.tensor(float("nan")),
                "grad_norm": float("inf"),
                "fp8_layers": {"0": {"scale_min": float("-inf")}},
            },
        )
    (record,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert record["loss"] == "nan" and record["grad_norm"] == "inf"
    assert record["fp8_layers"]["0"]["scale_min"] == "-inf"
    assert "lm loss: nan | grad norm: inf\n" in stream.getvalue()


def log_run(run_dir, iterations, start_iteration=0, loss=1.0):
    stream = io.StringIO()
    with MetricsLogger(run_dir, stream=stream, start_iteration=start_iteration) as logger:
        for i in iterations:
            logger.log(i, {"loss": loss})
    return stream.getvalue()


def test_a_fresh_run_moves_an_earlier_runs_metrics_aside(tmp_path):
    log_run(tmp_path, [10, 20, 30], loss=3.0)
    earlier = (tmp_path / "metrics.jsonl").read_bytes()
    output = log_run(tmp_path, [10, 20], loss=2.0)
    (aside,) = [p for p in tmp_path.iterdir() if p.name != "metrics.jsonl"]
    assert re.fullmatch(r"metrics\.\d{8}-\d{6}\.jsonl", aside.name)
    assert aside.read_bytes() == earlier
    assert f"moved to {aside}" in output.splitlines()[0]
    assert [(r["iteration"], r["loss"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        (10, 2.0),
        (20, 2.0),
    ]


def test_moving_aside_never_overwrites_an_earlier_copy(tmp_path):
    for loss in (3.0, 2.0, 1.0):
        log_run(tmp_path, [10], loss=loss)
        os.utime(tmp_path / "metrics.jsonl", (1e9, 1e9))  # every run ends in the same second
    log_run(tmp_path, [10], loss=0.5)
    asides = sorted(p for p in tmp_path.iterdir() if p.name != "metrics.jsonl")
    assert len(asides) == 3
    assert sorted(read_jsonl(p)[0]["loss"] for p in asides) == [1.0, 2.0, 3.0]


def test_an_empty_metrics_file_is_simply_reused(tmp_path):
    (tmp_path / "metrics.jsonl").touch()
    assert log_run(tmp_path, [1]).count("\n") == 1  # the log line, no message
    assert os.listdir(tmp_path) == ["metrics.jsonl"]


def test_a_resumed_run_drops_the_records_after_its_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, stream=io.StringIO()) as logger:
        for i in (10, 20, 30):
            logger.log(i, {"loss": 3.0})
        logger.log(20, {"valid_loss": 2.9})
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"iteration": 40, "lo')  # a write cut short by a crash
    # resumes from the checkpoint at 20
    output = log_run(tmp_path, [30, 40], start_iteration=20, loss=2.0)
    assert [(r["iteration"], r.get("loss")) for r in read_jsonl(path)] == [
        (10, 3.0),
        (20, 3.0),
        (20, None),
        (30, 2.0),
        (40, 2.0),
    ]
    assert (
        "dropped 1 records logged after iteration 20 and 1 unreadable lines"
        in output.splitlines()[0]
    )
    assert os.listdir(tmp_path) == ["metrics.jsonl"]


def test_a_resume_with_nothing_to_drop_leaves_the_file_alone(tmp_path):
    log_run(tmp_path, [10, 20])
    path = tmp_path / "metrics.jsonl"
    os.utime(path, (1e9, 1e9))
    assert log_run(tmp_path, [], start_iteration=20) == ""
    assert path.stat().st_mtime == 1e9 and os.listdir(tmp_path) == ["metrics.jsonl"]


def test_a_resume_completes_a_last_line_cut_before_its_newline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 10, "loss": 3.0}')
    log_run(tmp_path, [20], start_iteration=10)
    assert [r["iteration"] for r in read_jsonl(path)] == [10, 20]


def test_the_rewrite_on_resume_is_atomic(tmp_path, monkeypatch):
    log_run(tmp_path, [10, 20, 30])
    before = (tmp_path / "metrics.jsonl").read_bytes()

    def crash(*args):
        raise OSError("killed before the rename")

    monkeypatch.setattr(metrics.os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        MetricsLogger(tmp_path, stream=io.StringIO(), start_iteration=10)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_start_iteration_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match="start_iteration"):
        MetricsLogger(tmp_path, stream=io.StringIO(), start_iteration=-1)


def test_other_numbers_are_printed_by_name(tmp_path):
    stream = io.StringIO()
    with MetricsLogger(tmp_path, stream=stream) as logger:
        logger.log(5, {"valid_loss": 2.5, "valid_ppl": 12.18})
    assert "iteration 5 | valid_loss: 2.5 | valid_ppl: 12.18\n" in stream.getvalue()


def test_no_tensorboard_is_one_info_line(tmp_path, monkeypatch):
    # import fails as when not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    stream = io.StringIO()
    with MetricsLogger(tmp_path, tensorboard_dir=tmp_path / "tb", stream=stream) as logger:
        logger.log(1, {"loss": 1.0})
        logger.log(2, {"loss": 0.5})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "tensorboard" in lines[0]
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 2


def test_numbers_go_to_tensorboard_when_it_imports(tmp_path, monkeypatch):
    scalars = []

    class SummaryWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def close(self):
            scalars.append("closed")

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    with MetricsLogger(tmp_path, tensorboard_dir=tmp_path / "tb", stream=io.StringIO()) as logger:
        logger.log(
            3,
            {
                "loss": torch.tensor(2.0),
                "mfu": None,
                "fp8_layers": {"0": {}},
                "skipped_steps": 1,
                "grad_norm": float("inf"),
            },
        )
    assert scalars == [
        ("loss", 2.0, 3),
        ("skipped_steps", 1, 3),
        ("grad_norm", math.inf, 3),
        "closed",
    ]


class FakeWandb(types.ModuleType):
    """Records what the logger asks of wandb."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        calls = self.calls

        class Run:
            def log(self, data, step):
                calls.append(("log", data, step))

            def finish(self):
                calls.append("finish")

        return Run()


def test_wandb_run_gets_every_number_at_its_iteration(tmp_path, monkeypatch):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    config = {"lr": 1e-3, "wandb_project": "fp8"}
    with MetricsLogger(
        tmp_path,
        stream=io.StringIO(),
        wandb_project="fp8",
        wandb_exp_name="gpt-1b",
        wandb_config=config,
    ) as logger:
        logger.log(
            10,
            {
                "loss": torch.tensor(2.5),
                "lr": 1e-3,
                "mfu": None,
                "fp8_layers": {"0": {}},
                "skipped_steps": 0,
                "grad_norm": float("nan"),
            },
        )
        logger.log(10, {"valid_loss": 2.4})
        logger.log(20, {"fp8_layers": {}})  # nothing numeric: nothing to log
        assert wandb.calls[-1] != "finish"
    init, first, second, finish = wandb.calls
    assert init == (
        "init",
        {"project": "fp8", "name": "gpt-1b", "dir": str(tmp_path / "wandb"), "config": config},
    )
    assert (tmp_path / "wandb").is_dir()
    assert first[0] == "log" and first[2] == 10
    assert (
        first[1].keys() == {"loss", "lr", "skipped_steps", "grad_norm"} and first[1]["loss"] == 2.5
    )
    assert math.isnan(first[1]["grad_norm"])
    assert second == ("log", {"valid_loss": 2.4}, 10) and finish == "finish"


def test_wandb_dir_and_only_the_logging_rank(tmp_path, monkeypatch):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    with MetricsLogger(
        tmp_path / "run",
        stream=io.StringIO(),
        wandb_project="fp8",
        wandb_dir=tmp_path / "elsewhere",
    ) as logger:
        logger.log(1, {"loss": 1.0})
    assert (
        wandb.calls[0][1]["dir"] == str(tmp_path / "elsewhere")
        and wandb.calls[0][1]["name"] is None
    )
    assert (tmp_path / "elsewhere").is_dir() and not (tmp_path / "run" / "wandb").exists()
    wandb.calls.clear()
    with MetricsLogger(tmp_path / "other", rank_is_logger=False, wandb_project="fp8") as logger:
        logger.log(1, {"loss": 1.0})
    assert wandb.calls == []


@pytest.mark.parametrize("rank_is_logger", [True, False])
def test_wandb_missing_fails_at_construction(tmp_path, monkeypatch, rank_is_logger):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails as when not installed
    with pytest.raises(MetricsError, match="pip install wandb, or drop --wandb-project"):
        MetricsLogger(
            tmp_path / "run",
            stream=io.StringIO(),
            rank_is_logger=rank_is_logger,
            wandb_project="fp8",
        )
    assert not (tmp_path / "run").exists()
    MetricsLogger(tmp_path / "run", stream=io.StringIO()).close()  # no project: wandb is not needed


def test_only_the_logging_rank_writes(tmp_path):
    stream = io.StringIO()
    logger = MetricsLogger(
        tmp_path / "run", tensorboard_dir=tmp_path / "tb", rank_is_logger=False, stream=stream
    )
    logger.progress(1)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert stream.getvalue() == "" and not (tmp_path / "run").exists()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal(tmp_path):
    terminal, pipe = _Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        with MetricsLogger(
            tmp_path / type(stream).__name__, stream=stream, total_iterations=4
        ) as logger:
            logger.progress(1)
            logger.log(2, {"loss": 1.0})
            logger.progress(4)
    assert "lm loss: 1.000000E+00" in terminal.getvalue()
    assert "1/4" in terminal.getvalue() and "4/4" in terminal.getvalue()
    assert pipe.getvalue().count("\n") == 1 and "\r" not in pipe.getvalue()


def screen_lines(output):
    """What a terminal shows of `output`, one entry per line: the text after its last carriage return."""
    return [line.rsplit("\r", 1)[-1] for line in output.replace("\r\n", "\n").split("\n")]


def test_messages_go_above_the_bar_not_onto_it(tmp_path):
    terminal = _Terminal()
    with MetricsLogger(tmp_path, stream=terminal, total_iterations=4) as logger:
        logger.progress(1)
        logger.write("saved checkpoint ckpt/iter_0000001")
        logger.progress(2)
    assert "saved checkpoint ckpt/iter_0000001" in screen_lines(terminal.getvalue())
    stream = io.StringIO()
    with MetricsLogger(tmp_path, stream=stream, rank_is_logger=False) as logger:
        logger.write("saved checkpoint")
    assert stream.getvalue() == ""


def test_a_bar_on_a_terminal_that_reports_no_size(tmp_path):
    # 0 x 0 until someone sets its size: tqdm alone draws nothing
    controller, terminal = pty.openpty()
    try:
        with (
            open(terminal, "w", closefd=False) as stream,
            MetricsLogger(tmp_path, stream=stream, total_iterations=4) as logger,
        ):
            logger.progress(1)
            logger.log(2, {"loss": 1.0})
        output = b""
        while select.select([controller], [], [], 0)[0]:
            output += os.read(controller, 65536)
    finally:
        os.close(terminal)
        os.close(controller)
    lines = screen_lines(output.decode())
    assert any(re.search(r"\| 2/4 \[", line) for line in lines), lines
    assert any(line.startswith("[") and line.endswith("lm loss: 1.000000E+00") for line in lines), (
        lines
    )


def run_on_a_terminal(argv, cwd, columns=120, timeout=300):
    """Run `python *argv` with stdout and stderr on a pseudo-terminal `columns` wide, as a user at a
    terminal does; (exit status, what it wrote)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    process = subprocess.Popen(
        [sys.executable, *argv],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    os.close(terminal)
    output, deadline = b"", time.time() + timeout
    try:
        while (
            time.time() < deadline
            and select.select([controller], [], [], deadline - time.time())[0]
        ):
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(controller)
        if process.poll() is None:
            process.kill()
    return process.wait(), output.decode(errors="replace")


def test_the_trainer_shows_a_progress_bar_on_a_terminal(tmp_path):
    status, output = run_on_a_terminal(
        [
            "-m",
            "megafp8.train",
            "--model",
            "gpt-tiny",
            "--seq-length",
            "32",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--train-iters",
            "4",
            "--lr",
            "1e-3",
            "--mock-data",
            "--log-interval",
            "2",
            "--eval-iters",
            "0",
            "--num-workers",
            "0",
        ],
        cwd=tmp_path,
    )
    assert status == 0, output
    lines = screen_lines(output)
    bars = [line for line in lines if re.search(r"\d+%\|.*\| [1-4]/4 \[", line)]
    assert bars and all(len(line) <= 120 for line in bars), lines
    logged = [line for line in lines if re.search(r"\] iteration +\d+/", line)]
    assert len(logged) == 2 and all(
        re.fullmatch(r"\[[\d:]+\] iteration [24]/4 \|.*\(GiB\): [\d.]+", line) for line in logged
    ), lines


# -- the run summary ------------------------------------------------------------------------


def test_run_summary_of_a_resumed_run():
    lines = run_summary(
        start_iteration=100,
        end_iteration=160,
        wall_time_s=3725.0,
        tokens=60 * 512 * 2048,
        first_loss=3.21,
        last_loss=2.98766,
        valid_loss=3.05,
        checkpoint="ckpt/iter_0000160",
        metrics_path="ckpt/metrics.jsonl",
    )
    assert lines == [
        "run summary:",
        "  iterations: 60 (101 to 160)",
        "  wall time: 1h 02m 05s",
        "  average throughput: 16890 tokens/s (over the wall time, evaluation and checkpoints included)",
        "  lm loss: 3.2100 at iteration 101, 2.9877 at iteration 160",
        "  validation loss: 3.0500 (last evaluation)",
        "  checkpoint: ckpt/iter_0000160",
        "  metrics: ckpt/metrics.jsonl",
    ]


def test_run_summary_without_evaluation_or_checkpoint():
    lines = run_summary(
        start_iteration=0,
        end_iteration=30,
        wall_time_s=125.2,
        tokens=30 * 128,
        first_loss=6.93,
        last_loss=float("nan"),
        metrics_path="runs/latest/metrics.jsonl",
    )
    assert lines == [
        "run summary:",
        "  iterations: 30 (1 to 30)",
        "  wall time: 2m 05s",
        "  average throughput: 31 tokens/s (over the wall time, evaluation and checkpoints included)",
        "  lm loss: 6.9300 at iteration 1, nan at iteration 30",
        "  checkpoint: none saved (--save DIR keeps one)",
        "  metrics: runs/latest/metrics.jsonl",
    ]


def test_run_summary_when_no_iteration_ran():
    lines = run_summary(
        start_iteration=30,
        end_iteration=30,
        wall_time_s=0.4,
        tokens=0,
        checkpoint="ckpt/iter_0000030",
    )
    assert lines == [
        "run summary:",
        "  iterations: none run (the run was already at iteration 30)",
        "  wall time: 0.4 s",
        "  checkpoint: ckpt/iter_0000030",
    ]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="/dev/full plays the full disk")
def test_a_full_disk_under_metrics_is_said_once_with_the_path_and_the_run_goes_on(tmp_path):
    logger = metrics.MetricsLogger(tmp_path, stream=io.StringIO())
    logger._file.close()
    logger._file = open("/dev/full", "a")
    with pytest.warns(
        UserWarning, match=rf"cannot write {tmp_path}/metrics.jsonl \(No space left on device\)"
    ) as said:
        for step in range(1, 4):
            logger.log(step, {"loss": 1.0})
        logger.close()
    # once while logging, once at close
    assert len([w for w in said if "metrics.jsonl" in str(w.message)]) == 2
