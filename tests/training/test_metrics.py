"""Metrics: the FLOPs count, throughput and MFU, FP8 health, and the logger's outputs."""
import io
import json
import math
import sys
import types

import pytest
import torch
from torch import nn

from megafp8 import Fp8Linear, fp8_autocast
from megafp8.models import TransformerLM, preset
from megafp8.training import metrics
from megafp8.training.metrics import (
    MetricsLogger,
    Throughput,
    flops_per_token,
    fp8_health,
    memory_stats,
    peak_bf16_flops,
    peak_bf16_flops_by_name,
)

from ..multiprocess import run_on_ranks

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
    per_layer = 6 * gemm_weights + 3 * (2 * s * 64 + 2 * s * 64)  # + QK^T and AV, forward and backward
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
    config = preset("gpt-tiny")  # vocabulary 1000: 1024 at tp 1 (multiples of 128), 1152 at tp 3 (of 384)
    assert flops_per_token(config, 32, tp_size=3) - flops_per_token(config, 32) == 6 * 64 * 128


# -- peaks, throughput, MFU -----------------------------------------------------------------


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.4e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA B200", 2250e12),
    ("NVIDIA H100 NVL", None),
    ("NVIDIA GeForce RTX 4090", None),
])
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
    throughput = Throughput(flops_per_token=6e6, world_size=4, peak_flops=1e12,
                            hardware_flops_per_token=8e6)
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


def test_no_peak_means_mfu_na(monkeypatch, tmp_path):
    fake_clock(monkeypatch, [0.0, 1.0])
    throughput = Throughput(flops_per_token=1e6, device="cpu")
    throughput.add(100)
    stats = throughput.read()
    assert stats["mfu"] is None
    stream = io.StringIO()
    with MetricsLogger(tmp_path, stream=stream) as logger:
        logger.log(1, stats)
    assert "MFU: n/a" in stream.getvalue()


def test_memory_on_the_cpu_is_the_resident_set():
    assert 0.01 < memory_stats("cpu")["memory_gib"] < 1024


# -- the logger -----------------------------------------------------------------------------


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_line_and_jsonl_record(tmp_path):
    stream = io.StringIO()
    logger = MetricsLogger(tmp_path, stream=stream, total_iterations=100)
    record = {"consumed_samples": 640, "loss": torch.tensor(2.5), "lr": 3e-4, "grad_norm": 1.25,
              "skipped_steps": 1, "tokens_per_sec": 12345.6, "tflops_per_gpu": 123.4, "mfu": 0.25,
              "memory_gib": 1.5, "fp8_scale_min": 2.0, "fp8_scale_max": 448.0, "fp8_saturation": 1e-5}
    logger.log(10, record)
    # Flushed at once: a crash right now keeps the record.
    (written,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert written["iteration"] == 10 and written["loss"] == 2.5 and written["mfu"] == 0.25
    assert set(record) <= set(written) and "time" in written
    line = stream.getvalue()
    for part in ("iteration       10/     100", "consumed samples:          640", "lm loss: 2.500000E+00",
                 "learning rate: 3.000000E-04", "grad norm: 1.250", "number of skipped iterations:   1",
                 "tokens/s: 12346", "throughput per GPU (TFLOP/s/GPU): 123.4", "MFU: 25.0%",
                 "memory (GiB): 1.50", "fp8 scale: [2, 448]", "fp8 saturated: 1.00e-05"):
        assert part in line
    logger.close()


def test_jsonl_appends_on_resume_and_keeps_non_finite_values(tmp_path):
    with MetricsLogger(tmp_path, stream=io.StringIO()) as logger:
        logger.log(1, {"loss": 3.0})
        logger.log(2, {"loss": float("nan"), "grad_norm": float("inf")})
    with MetricsLogger(tmp_path, stream=io.StringIO()) as logger:  # a resumed run
        logger.log(2, {"loss": 2.0, "valid_loss": 2.5})
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["iteration"], r["loss"]) for r in records] == [(1, 3.0), (2, "nan"), (2, 2.0)]
    assert records[1]["grad_norm"] == "inf" and records[2]["valid_loss"] == 2.5


def test_other_numbers_are_printed_by_name(tmp_path):
    stream = io.StringIO()
    with MetricsLogger(tmp_path, stream=stream) as logger:
        logger.log(5, {"valid_loss": 2.5, "valid_ppl": 12.18})
    assert "valid_loss: 2.5 | valid_ppl: 12.18 |" in stream.getvalue()


def test_no_tensorboard_is_one_info_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as when not installed
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
        logger.log(3, {"loss": torch.tensor(2.0), "mfu": None, "fp8_layers": {"0": {}}, "skipped_steps": 1})
    assert scalars == [("loss", 2.0, 3), ("skipped_steps", 1, 3), "closed"]


def test_only_the_logging_rank_writes(tmp_path):
    stream = io.StringIO()
    logger = MetricsLogger(tmp_path / "run", tensorboard_dir=tmp_path / "tb", rank_is_logger=False, stream=stream)
    logger.progress(1)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert stream.getvalue() == "" and not (tmp_path / "run").exists()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal(tmp_path):
    pytest.importorskip("tqdm")
    terminal, pipe = _Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        with MetricsLogger(tmp_path / type(stream).__name__, stream=stream, total_iterations=4) as logger:
            logger.progress(1)
            logger.log(2, {"loss": 1.0})
            logger.progress(4)
    assert "lm loss: 1.000000E+00" in terminal.getvalue()
    assert "1/4" in terminal.getvalue() and "4/4" in terminal.getvalue()
    assert pipe.getvalue().count("\n") == 1 and "\r" not in pipe.getvalue()


# -- FP8 health -----------------------------------------------------------------------------


def test_saturation_fraction_on_the_cpu_path():
    torch.manual_seed(0)
    model = nn.Sequential(Fp8Linear(64, 32), nn.Linear(32, 16))  # the gradient into the FP8 layer: x-free
    x = torch.randn(16, 64)
    with fp8_autocast():  # fits the delayed scales to x
        model(x).sum().backward()
    x[:2, :10] = 3 * x.abs().max()  # 20 inputs beyond the input scale
    with fp8_autocast(collect_saturation=True):
        model(x).sum().backward()
    health = fp8_health(model)
    roles = health["fp8_layers"]["0"]["roles"]
    assert roles["input"]["saturation"] == 20 / x.numel()
    assert roles["grad_output"]["saturation"] == 0.0
    assert roles["weight"]["saturation"] is None  # the cached weight cast was not redone
    assert health["fp8_saturation"] == 20 / (16 * 64 + 16 * 32)
    assert fp8_health(model)["fp8_saturation"] is None  # read once, then reset


def test_fp8_health_of_a_tiny_gpt():
    torch.manual_seed(0)
    model = TransformerLM(preset("gpt-tiny"))  # fp32 parameters on the CPU
    tokens = torch.randint(0, 1000, (2, 32))
    with fp8_autocast(collect_saturation=True):
        model(tokens, labels=tokens).mean().backward()
    health = fp8_health(model)
    layers = health["fp8_layers"]
    assert sorted(layers) == sorted(f"layers.{i}.{name}" for i in range(2)
                                    for name in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2"))
    scales = [r["scale"] for layer in layers.values() for r in layer["roles"].values()]
    assert len(scales) == 2 * 4 * 3 and all(math.isfinite(s) and s > 0 for s in scales)
    assert health["fp8_scale_min"] == min(scales) and health["fp8_scale_max"] == max(scales)
    for layer in layers.values():
        assert layer["scale_min"] == min(r["scale"] for r in layer["roles"].values())
        # Every scale was fitted to its own tensor on the first pass: nothing saturates.
        assert [r["saturation"] for r in layer["roles"].values()] == [0.0, 0.0, 0.0]
    assert health["fp8_saturation"] == 0.0
    assert "fp8_layers" not in fp8_health(model, per_layer=False)


def saturation_counts(model):
    return [s.saturation.tolist() for s in model.modules() if hasattr(s, "amax_history")]


def test_recomputation_does_not_count_twice():
    tokens = torch.randint(0, 1000, (2, 32))
    counts = []
    for recompute in ("none", "full", "selective"):
        model = TransformerLM(preset("gpt-tiny"), recompute=recompute)
        with fp8_autocast(collect_saturation=True):
            model(tokens, labels=tokens).mean().backward()
        counts.append(saturation_counts(model))
    assert counts[0] == counts[1] == counts[2]
    assert all(cast > 0 for _, cast in counts[0])


def test_collection_off_leaves_nothing_to_report():
    model = TransformerLM(preset("gpt-tiny"))
    tokens = torch.randint(0, 1000, (2, 32))
    with fp8_autocast():
        model(tokens, labels=tokens).mean().backward()
    assert all(c == [0, 0] for c in saturation_counts(model))
    health = fp8_health(model)
    assert health["fp8_saturation"] is None and health["fp8_scale_min"] > 0


def test_a_model_without_fp8_reports_none():
    model = TransformerLM(preset("gpt-tiny"))
    assert fp8_health(model, per_layer=False) == {"fp8_scale_min": None, "fp8_scale_max": None,
                                                  "fp8_saturation": None}


def _health_over_ranks(rank, world_size):
    layer = Fp8Linear(16, 16)
    layer.fp8_scaling["input"].scale.fill_(2.0 ** (rank + 1))
    layer.fp8_scaling["input"].saturation.copy_(torch.tensor([rank + 1, 100]))
    return fp8_health(layer, group=torch.distributed.group.WORLD, per_layer=False)


def test_health_reduced_over_a_group():
    results = run_on_ranks(_health_over_ranks, 2)
    expected = {"fp8_scale_min": 2.0, "fp8_scale_max": 4.0, "fp8_saturation": 3 / 200}
    assert results == [expected, expected]
