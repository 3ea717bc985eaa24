"""Training metrics: model FLOPs and MFU, throughput, memory, the logger
that writes them with the FP8 health of megafp8.fp8.health (a short line on stdout,
`metrics.jsonl`, TensorBoard when installed, Weights & Biases when asked for, a progress bar on
a terminal) and the end-of-run summary.

    throughput = Throughput(flops_per_token(config, seq_length), world_size, device=device)
    logger = MetricsLogger(run_dir, tensorboard_dir, rank_is_logger=rank == world_size - 1,
                           start_iteration=iteration, device=device)
    ...every iteration: throughput.add(global_batch_size * seq_length); logger.progress(iteration)
    ...every log step:  logger.log(iteration, {"loss": ..., "lr": ..., **throughput.read(),
                                              **memory_stats(device), **fp8_health(model)})  # megafp8.fp8
    ...at the end:      print("\n".join(run_summary(start_iteration=..., end_iteration=..., ...)))
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from time import perf_counter

import torch
from tqdm import tqdm

from megafp8.messages import check_integer
from megafp8.models import TransformerConfig

# -- FLOPs ----------------------------------------------------------------------------------


def flops_per_token(
    config: TransformerConfig, seq_length: int, recompute: str = "none", tp_size: int = 1
) -> int:
    """FLOPs of one token's forward and backward through the whole model.

    Megatron-LM's / PaLM's count: 2 FLOPs per multiply-add, backward = 2x forward, so
    6 x (matmul weights of the layers: QKV with its key/value heads, output projection, MLP
    with SwiGLU's third matrix) + 12 x layers x attention width x seq_length (QK^T and AV over
    the full s x s square, as both papers count it, not halved for the causal mask) + 6 x hidden x
    vocabulary (the output layer, vocabulary padded for `tp_size` as the GEMM runs it).
    Embedding lookups, norms, softmax and biases are left out.

    `recompute="none"` gives the model FLOPs, the numerator of MFU. "selective" adds a second
    forward of each attention core, "full" one of every layer: the FLOPs the hardware runs.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    layer_forward, core_forward, output_forward = _forward_flops(config, seq_length, tp_size)
    total = 3 * (config.num_layers * (layer_forward + core_forward) + output_forward)
    if recompute == "full":
        total += config.num_layers * (layer_forward + core_forward)
    elif recompute == "selective":
        total += config.num_layers * core_forward
    return total


# An FP8 layer's step runs this much faster than bf16's (GPT-1.3B, graphed, H100 and H200: 1.29x at
# micro-batch 1, 1.37x at 2 in benchmarks/results/planner/2026-11-26_2xH200_planner), so a bf16
# output layer beside FP8 layers costs more layers' worth than its FLOPs say.
FP8_LAYER_SPEEDUP = 1.35
# The output layer's one wide GEMM runs at more FLOP/s than a bf16 layer as a whole (its narrower
# GEMMs, attention core, norms and elementwise work): the pp 2 profile of GPT-1.3B (a vocabulary
# of 32,768, H200) puts the last rank's output layer and loss at 1.3 FP8 layers' time where their
# FLOPs at FP8_LAYER_SPEEDUP say 1.54
# (benchmarks/results/several_gpus/2026-11-27_4xH200_p2p_overlap).
OUTPUT_LAYER_EFFICIENCY = 1.18


def output_layer_cost(
    config: TransformerConfig,
    seq_length: int,
    tp_size: int = 1,
    fp8_layers: bool = False,
    fp8_output_layer: bool = False,
) -> float:
    """The output layer's time (with the loss) in layers' worth, estimated from FLOPs as
    `flops_per_token` counts them (its GEMM's over one layer's GEMMs and attention core), over
    OUTPUT_LAYER_EFFICIENCY, times FP8_LAYER_SPEEDUP where the layers run FP8 and the output
    layer does not."""
    layer_forward, core_forward, output_forward = _forward_flops(config, seq_length, tp_size)
    speedup = FP8_LAYER_SPEEDUP if fp8_layers and not fp8_output_layer else 1.0
    return speedup * output_forward / (layer_forward + core_forward) / OUTPUT_LAYER_EFFICIENCY


def _forward_flops(
    config: TransformerConfig, seq_length: int, tp_size: int
) -> tuple[int, int, int]:
    """Forward FLOPs per token of a layer's GEMMs, of its attention core, of the output layer."""
    check_integer("seq_length", seq_length)
    h = config.hidden_size
    attention_width = config.num_attention_heads * config.head_dim
    kv_width = config.kv_heads * config.head_dim
    attention_weights = h * (attention_width + 2 * kv_width) + attention_width * h
    mlp_weights = (3 if config.activation == "swiglu" else 2) * h * config.ffn_size
    core_forward = 2 * 2 * seq_length * attention_width  # QK^T, then AV
    return (
        2 * (attention_weights + mlp_weights),
        core_forward,
        2 * h * config.padded_vocab_size(tp_size),
    )


# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets; the first match wins.
_PEAK_BF16 = (
    ("h100 pcie", 756e12),
    ("h100 nvl", None),  # not in the table: better n/a than the SXM number
    ("h100", 989.4e12),  # SXM; GH200 matches "h200", which has the same peak
    ("h200", 989.4e12),
    ("a100", 312e12),
    ("b200", 2250e12),
)


def peak_bf16_flops_by_name(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU from its CUDA name ("NVIDIA H100 80GB HBM3"), or None."""
    name = name.lower()
    for key, peak in _PEAK_BF16:
        if key in name:
            return peak
    return None


def peak_bf16_flops(device) -> float | None:
    """Dense bf16 peak FLOP/s of `device` (a torch.device, "cuda:0", or a CUDA index), or None
    for the CPU and GPUs not in the table: MFU is then reported as n/a. FP8 runs are measured
    against the bf16 peak too, the usual convention, so FP8 and bf16 runs compare."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_bf16_flops_by_name(torch.cuda.get_device_name(device))


class Throughput:
    """Tokens and wall time between log steps, as tokens/s, TFLOP/s per GPU and MFU.

    `add(tokens)` once per iteration with the tokens of the whole global batch (every data
    parallel replica); `read()` at a log step returns the window's numbers and starts the next.
    `flops_per_token` are model FLOPs (`flops_per_token(..., recompute="none")`); pass the
    recompute count as `hardware_flops_per_token` to also report what the GPUs ran. On CUDA
    both ends of a window synchronize, so queued kernels count in the window that launched them.
    `peak_flops` defaults to `peak_bf16_flops(device)`.
    """

    def __init__(
        self,
        flops_per_token: float,
        world_size: int = 1,
        device=None,
        peak_flops: float | None = None,
        hardware_flops_per_token: float | None = None,
    ):
        self.flops_per_token = flops_per_token
        self.hardware_flops_per_token = hardware_flops_per_token
        self.world_size = world_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.peak_flops = peak_flops if peak_flops is not None else peak_bf16_flops(self.device)
        self.restart()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def restart(self) -> None:
        """Start a new window now (after evaluation or checkpointing, to leave them out)."""
        self._sync()
        self._begin(perf_counter())

    def _begin(self, start: float) -> None:
        self._start, self._tokens, self._iterations = start, 0, 0

    def add(self, tokens: int, iterations: int = 1) -> None:
        self._tokens += tokens
        self._iterations += iterations

    def read(self) -> dict:
        """iteration_time_ms, tokens_per_sec, tflops_per_gpu, mfu (None without a peak) and,
        with hardware FLOPs, hw_tflops_per_gpu, for the window since the last read."""
        self._sync()
        now = perf_counter()
        elapsed, tokens, iterations = now - self._start, self._tokens, self._iterations
        self._begin(now)  # the next window starts where this one ends
        if elapsed <= 0 or iterations == 0:
            return {}
        tokens_per_sec = tokens / elapsed
        flops_per_gpu = tokens_per_sec * self.flops_per_token / self.world_size
        stats = {
            "iteration_time_ms": 1000 * elapsed / iterations,
            "tokens_per_sec": tokens_per_sec,
            "tflops_per_gpu": flops_per_gpu / 1e12,
            "mfu": flops_per_gpu / self.peak_flops if self.peak_flops else None,
        }
        if self.hardware_flops_per_token is not None:
            stats["hw_tflops_per_gpu"] = (
                tokens_per_sec * self.hardware_flops_per_token / self.world_size / 1e12
            )
        return stats


# -- memory ---------------------------------------------------------------------------------


def memory_stats(device=None) -> dict:
    """{"memory_gib": ...}: on CUDA the most memory torch has allocated on `device` so far,
    elsewhere the process's resident set."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        used = torch.cuda.max_memory_allocated(device)
    else:
        used = _resident_bytes()
    return {"memory_gib": used / 2**30}


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc (macOS): the peak instead, which getrusage gives in bytes there
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# -- FP8 health -----------------------------------------------------------------------------


# -- the logger -----------------------------------------------------------------------------


class MetricsError(ValueError):
    """A logging option that cannot be honoured (a W&B project without wandb installed)."""


# The first line's fields after the iteration, in this order, then any other numeric key. The labels
# "lm loss", "tokens/s", "MFU" and "memory (GiB)" (and "iteration N/") are Megatron's, which scripts grep.
_LINE_FIELDS = (
    ("loss", "lm loss", "{:.6E}"),
    ("lr", "lr", "{:.2E}"),
    ("grad_norm", "grad norm", "{:.3f}"),
    ("tokens_per_sec", "tokens/s", "{:.0f}"),
    ("tflops_per_gpu", "TFLOP/s/GPU", "{:.1f}"),
    ("hw_tflops_per_gpu", "with recompute", "{:.1f}"),
    ("mfu", "MFU", None),
    ("iteration_time_ms", "ms/iter", "{:.0f}"),
    ("memory_gib", "memory (GiB)", "{:.2f}"),
)
# The second, indented line: FP8 health when the run has FP8 layers, skipped iterations when there are any.
_FP8_FIELDS = (("fp8_saturation", "fp8 saturated"), ("fp8_underflow", "fp8 underflowed"))
_SECOND_LINE = {"fp8_scale_min", "skipped_steps"} | {key for key, _ in _FP8_FIELDS}
# In metrics.jsonl (and TensorBoard, W&B) only.
_NOT_PRINTED = {"iteration", "train_iters", "fp8_scale_max", "fp8_layers", "consumed_samples"}
# Printed only with log_throughput, as Megatron's --log-throughput; metrics.jsonl always has them.
_THROUGHPUT_FIELDS = {"tflops_per_gpu", "hw_tflops_per_gpu"}
# Figures of a GPU: printed only when the run is on one.
_GPU_FIELDS = {"tflops_per_gpu", "hw_tflops_per_gpu", "mfu"}


class MetricsLogger:
    """Writes one record per log step: a short line on `stream` (a second, indented one with the FP8
    health and the skipped iterations when there are any; Megatron's labels), a JSON line in
    `<run_dir>/metrics.jsonl` (flushed at once, so a crash keeps every logged step), scalars to
    TensorBoard under `tensorboard_dir` when `torch.utils.tensorboard` imports, and to a Weights &
    Biases run with `wandb_project`. On a TTY a tqdm bar follows the iterations (`progress(step)`
    moves it between log steps; `write(line)` prints other messages above it).

    metrics.jsonl holds one run: with `start_iteration` 0 (a fresh run) an earlier run's file is
    moved aside; a run resuming from a checkpoint at `start_iteration` keeps the records up to it
    and drops the later ones, which it logs again. `device` is where the run computes: off CUDA the
    per-GPU figures (TFLOP/s, MFU) stay out of the line; TFLOP/s is printed only with
    `log_throughput`; the consumed samples are not printed. The file, TensorBoard and W&B get every
    number either way.

    W&B: `wandb.init(project=wandb_project, name=wandb_exp_name, dir=wandb_dir or <run_dir>/wandb,
    config=wandb_config)`; every numeric field is logged with the iteration as the step, and the
    run is finished by `close()`. Without wandb installed every rank raises MetricsError here.

    Only the logging rank (`rank_is_logger`) writes anything.
    """

    def __init__(
        self,
        run_dir,
        tensorboard_dir=None,
        rank_is_logger: bool = True,
        stream=None,
        total_iterations: int | None = None,
        start_iteration: int = 0,
        device=None,
        log_throughput: bool = False,
        wandb_project: str | None = None,
        wandb_exp_name: str | None = None,
        wandb_dir=None,
        wandb_config: dict | None = None,
    ):
        if start_iteration < 0:
            raise ValueError(f"start_iteration must be >= 0, got {start_iteration}")
        self.rank_is_logger = self.enabled = rank_is_logger
        # now: a redirection since import counts
        self.stream = stream if stream is not None else sys.stdout
        self.total_iterations = total_iterations
        self.log_throughput = log_throughput
        self.on_gpu = device is not None and torch.device(device).type == "cuda"
        self.metrics_path = None
        self._file = self._writer = self._bar = self._wandb_run = None
        self._terminal = False
        # On every rank, so that all of them stop at start-up with the same message instead of
        # the logging rank alone while the others wait for it in a collective.
        wandb = _import_wandb() if wandb_project else None
        if not self.enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = run_dir / "metrics.jsonl"
        if start_iteration == 0:
            self._move_earlier_run_aside(self.metrics_path)
        else:
            self._drop_records_after(self.metrics_path, start_iteration)
        self._file = open(self.metrics_path, "a")
        self._write_failed = False
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._print(
                    "tensorboard is not installed: metrics go to stdout and metrics.jsonl only"
                )
            else:
                self._writer = SummaryWriter(log_dir=str(tensorboard_dir))
        if wandb is not None:
            wandb_dir = Path(wandb_dir) if wandb_dir is not None else run_dir / "wandb"
            wandb_dir.mkdir(parents=True, exist_ok=True)
            self._wandb_run = wandb.init(
                project=wandb_project, name=wandb_exp_name, dir=str(wandb_dir), config=wandb_config
            )
        self._terminal = _isatty(self.stream)

    # -- metrics.jsonl holds one run -------------------------------------------------------------

    def _move_earlier_run_aside(self, path: Path) -> None:
        if not path.exists() or path.stat().st_size == 0:
            return
        # Named after the earlier run's last write; never over another file.
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        aside, n = path.with_name(f"metrics.{stamp}.jsonl"), 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"metrics.{stamp}-{n}.jsonl")
        path.rename(aside)
        self._print(f"{path} held an earlier run's metrics: moved to {aside}")

    def _drop_records_after(self, path: Path, iteration: int) -> None:
        """Keep the records up to `iteration` (where the resumed checkpoint was saved), and drop
        lines that are not JSON (a write cut short by a crash): atomically, via a rewritten copy."""
        if not path.exists():
            return
        temporary = path.with_name(path.name + ".tmp")
        dropped = unreadable = 0
        rewrite = False
        with open(path) as old, open(temporary, "w") as new:
            for line in old:
                try:
                    record = json.loads(line) if line.strip() else {}
                except json.JSONDecodeError:
                    record = None
                if not isinstance(record, dict):
                    unreadable += 1
                elif record.get("iteration", 0) > iteration:
                    dropped += 1
                else:
                    rewrite |= not line.endswith("\n")  # the next append would join this line
                    new.write(line if line.endswith("\n") else line + "\n")
            new.flush()
            os.fsync(new.fileno())
        if not (dropped or unreadable or rewrite):
            temporary.unlink()
            return
        os.replace(temporary, path)
        if dropped or unreadable:
            message = f"{path}: dropped {dropped} records logged after iteration {iteration}"
            if unreadable:
                message += f" and {unreadable} unreadable lines"
            self._print(
                message + f" (this run resumes from the checkpoint at iteration {iteration} "
                "and logs the later ones again)"
            )

    # -- output --------------------------------------------------------------------------------

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)  # above the bar, not through it
        else:
            print(line, file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """Print a message on the logging rank; with a progress bar, on its own line above it
        (a plain print would land after the bar, on the bar's line)."""
        if self.rank_is_logger:
            self._print(line)

    def progress(self, step: int) -> None:
        """Move the progress bar to iteration `step` (cheap; call it every iteration)."""
        if not self._terminal:
            return
        if self._bar is None:  # started at the first step seen, so a resumed run's rate is right
            self._bar = tqdm(
                total=self.total_iterations,
                initial=step,
                unit="it",
                file=self.stream,
                **_bar_size(self.stream),
            )
        elif step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def log(self, step: int, record: dict) -> None:
        if not self.enabled:
            return
        record = {key: _plain(value) for key, value in record.items()}
        self.progress(step)
        self._print(self._line(step, record))
        # default=str: an odd value in a record must not stop the training run.
        line = json.dumps(
            _json_safe({"iteration": step, "time": time.time(), **record}), default=str
        )
        self._append(line)
        scalars = {
            key: value
            for key, value in record.items()
            if isinstance(value, (int, float))
            and not isinstance(value, bool)
            and key != "iteration"
        }
        if self._writer is not None:
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)
        if self._wandb_run is not None and scalars:
            self._wandb_run.log(scalars, step=step)

    def _append(self, line: str) -> None:
        """One record into metrics.jsonl; a failed write (a full disk) is said once and the run goes on:
        losing log lines beats losing the steps since the last checkpoint (a full disk stops the run
        at its next save anyway, which keeps the checkpoint before)."""
        try:
            self._file.write(line + "\n")
            self._file.flush()
            self._write_failed = False
        except OSError as error:
            if not self._write_failed:
                warnings.warn(
                    f"cannot write {self.metrics_path} ({error.strerror or error}): the run goes on, and "
                    "records made meanwhile may be missing from it",
                    stacklevel=3,
                )
            self._write_failed = True

    def _printed(self, key: str) -> bool:
        return (key not in _GPU_FIELDS or self.on_gpu) and (
            key not in _THROUGHPUT_FIELDS or self.log_throughput
        )

    def _line(self, step: int, record: dict) -> str:
        """What a person reads of `record`: one short line; the FP8 health and the skipped
        iterations on a second one, indented under the first's iteration, when there are any."""
        total = record.get("train_iters", self.total_iterations)
        stamp = f"[{time.strftime('%H:%M:%S')}] "
        first = [
            stamp
            + (f"iteration {step:{len(str(total))}d}/{total}" if total else f"iteration {step}")
        ]
        for key, label, spec in _LINE_FIELDS:
            if key not in record or not self._printed(key):
                continue
            value = record[key]
            if key == "mfu":
                first.append(
                    f"MFU: {100 * value:.1f}%" if isinstance(value, (int, float)) else "MFU: n/a"
                )
            else:
                first.append(f"{label}: {_format(value, spec)}")
        known = {key for key, _, _ in _LINE_FIELDS} | _SECOND_LINE | _NOT_PRINTED
        for key, value in record.items():
            if key not in known and isinstance(value, (int, float)):
                first.append(f"{key}: {_format(value, '{:.6g}')}")
        second = []
        if record.get("fp8_scale_min") is not None:  # None: no FP8 layer in this run
            second.append(
                f"fp8 scale: [{record['fp8_scale_min']:.3g}, {record['fp8_scale_max']:.3g}]"
            )
            second += [
                f"{label}: {_format(record[key], '{:.2e}')}"
                for key, label in _FP8_FIELDS
                if key in record
            ]
        if record.get("skipped_steps"):
            second.append(f"skipped iterations: {record['skipped_steps']}")
        line = " | ".join(first)
        return line + "\n" + " " * len(stamp) + " | ".join(second) if second else line

    def close(self) -> None:
        for handle in (self._bar, self._writer, self._file):
            if handle is not None:
                try:
                    handle.close()
                except OSError as error:  # the last records could not be flushed
                    warnings.warn(
                        f"cannot write {self.metrics_path} ({error.strerror or error})",
                        stacklevel=2,
                    )
        if self._wandb_run is not None:
            self._wandb_run.finish()
        self._file = self._writer = self._bar = self._wandb_run = None
        self._terminal = self.enabled = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise MetricsError(
            "--wandb-project needs the wandb package, which is not installed: "
            "pip install wandb, or drop --wandb-project"
        ) from None
    return wandb


def _isatty(stream) -> bool:
    return bool(getattr(stream, "isatty", None) and stream.isatty())


def _bar_size(stream) -> dict:
    """tqdm's size arguments: follow the terminal's width, or 80 x 24 for a terminal that reports
    0 x 0 (a pseudo-terminal nobody sized, e.g. under `script` or some container shells), where
    tqdm would draw nothing at all."""
    try:
        size = os.get_terminal_size(stream.fileno())
    # no file descriptor (io.UnsupportedOperation is an OSError)
    except (
        AttributeError,
        OSError,
        ValueError,
    ):
        return {"dynamic_ncols": True}
    return (
        {"dynamic_ncols": True}
        if size.columns > 0 and size.lines > 0
        else {"ncols": 80, "nrows": 24}
    )


def _plain(value):
    """Tensors become numbers or lists, so every output sees plain Python values."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {key: _plain(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _json_safe(value):
    """inf and NaN become strings, since JSON has none."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _format(value, spec) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, str) or (isinstance(value, float) and not math.isfinite(value)):
        return str(value)
    try:
        return spec.format(value)
    except (ValueError, TypeError):  # e.g. an int spec given a float
        return f"{value:.6g}"


# -- the end of a run -------------------------------------------------------------------------


def run_summary(
    *,
    start_iteration: int,
    end_iteration: int,
    wall_time_s: float,
    tokens: int,
    first_loss: float | None = None,
    last_loss: float | None = None,
    valid_loss: float | None = None,
    checkpoint=None,
    metrics_path=None,
) -> list[str]:
    """The lines to print when a run ends: the iterations this run made (`start_iteration` is
    where it began: 0, or the checkpoint it resumed from), its wall time and average tokens/s
    over it (`tokens` trained in this run; evaluation and checkpoints count in the time), the
    training loss of its first and last iterations, the last validation loss, and where the
    last checkpoint and metrics.jsonl are (`checkpoint` None: none was saved)."""
    ran = end_iteration - start_iteration
    lines = ["run summary:"]
    if ran > 0:
        lines.append(f"  iterations: {ran} ({start_iteration + 1} to {end_iteration})")
    else:
        lines.append(f"  iterations: none run (the run was already at iteration {end_iteration})")
    lines.append(f"  wall time: {_duration(wall_time_s)}")
    if ran > 0 and wall_time_s > 0:
        lines.append(
            f"  average throughput: {tokens / wall_time_s:.0f} tokens/s "
            "(over the wall time, evaluation and checkpoints included)"
        )
    if first_loss is not None and last_loss is not None:
        lines.append(
            f"  lm loss: {first_loss:.4f} at iteration {start_iteration + 1}, "
            f"{last_loss:.4f} at iteration {end_iteration}"
        )
    if valid_loss is not None:
        lines.append(f"  validation loss: {valid_loss:.4f} (last evaluation)")
    lines.append(
        f"  checkpoint: {checkpoint}"
        if checkpoint is not None
        else "  checkpoint: none saved (--save DIR keeps one)"
    )
    if metrics_path is not None:
        lines.append(f"  metrics: {metrics_path}")
    return lines


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {seconds:02d}s" if hours else f"{minutes}m {seconds:02d}s"
