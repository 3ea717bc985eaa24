"""`--profile`: record a few training steps, as Megatron-LM's flags of the same names do.

Steps `--profile-step-start + 1` .. `--profile-step-end` (counted from 1) are recorded on each
rank of `--profile-ranks`. With `--use-pytorch-profiler`, torch.profiler writes, per rank, a
Chrome/Perfetto trace and a table of the operators and kernels that took the most device time
(CPU time without a GPU) under `<run dir>/profile/`; otherwise the steps are wrapped in a CUDA
profiler range, for `nsys profile --capture-range=cudaProfilerApi`.
"""

from __future__ import annotations

import bisect
import json
import re
import time
from pathlib import Path

import torch


class StepProfiler:
    def __init__(self, args, rank: int, run_dir, device: torch.device):
        self.enabled = bool(args.profile) and rank in args.profile_ranks
        self.start_step, self.end_step = args.profile_step_start, args.profile_step_end
        self.torch_profiler = args.use_pytorch_profiler
        self.rank, self.device = rank, device
        self.directory = Path(run_dir) / "profile"
        self._profiler = None
        self._started_at = None  # set while recording

    def before_step(self, steps_done: int) -> None:
        if not self.enabled or steps_done != self.start_step:
            return
        self._sync()
        if self.torch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
        else:
            torch.cuda.profiler.start()
        self._started_at = time.perf_counter()

    def after_step(self, steps_done: int) -> None:
        if self._started_at is not None and steps_done >= self.end_step:
            self.stop(steps_done)

    def stop(self, steps_done: int) -> None:
        """End the recording (also when the run ends before --profile-step-end) and write it."""
        if self._started_at is None:
            return
        self._sync()
        wall = time.perf_counter() - self._started_at
        self._started_at = None
        steps = steps_done - self.start_step
        if not self.torch_profiler:
            torch.cuda.profiler.stop()
            return
        self._profiler.stop()
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}_steps{self.start_step + 1}-{steps_done}"
        trace = self.directory / f"{name}.json"
        self._profiler.export_chrome_trace(str(trace))
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self._profiler.key_averages().table(
            sort_by=sort_by, row_limit=40, max_name_column_width=90
        )
        steps = max(steps, 1)
        lines = [
            f"rank {self.rank}: {steps} steps in {wall:.3f} s ({1000 * wall / steps:.1f} ms per step, "
            "profiler overhead included)"
        ]
        events = json.loads(trace.read_text())  # tens of MB for a big model: parsed once
        kernels = kernel_time(events)
        if kernels["kernels"]:
            lines.append(
                f"GPU busy {kernels['busy_ms'] / steps:.1f} ms per step ({100 * kernels['busy_ms'] / (1000 * wall):.0f}% "
                f"of the wall time): compute kernels {kernels['compute_ms'] / steps:.1f} ms, communication "
                f"{kernels['communication_ms'] / steps:.1f} ms, of which {kernels['communication_exposed_ms'] / steps:.1f} "
                "ms with no compute kernel running beside it"
            )
            lines.append(
                "communication by kind, ms per step (with no compute beside it): "
                + ", ".join(
                    f"{kind} {totals['ms'] / steps:.1f} ({totals['exposed_ms'] / steps:.1f}) in {totals['count'] / steps:.0f} transfers"
                    for kind, totals in kernels["by_kind"].items()
                )
            )
            lines.append(
                "kernel time by category, ms per step: "
                + ", ".join(
                    f"{category} {ms / steps:.1f}"
                    for category, ms in kernel_categories(events).items()
                )
            )
            gaps = idle_gaps(events, top=5)
            lines.append(
                f"GPU idle between its activities {gaps['idle_ms'] / steps:.1f} ms per step in "
                f"{gaps['gaps'] / steps:.0f} gaps ("
                + ", ".join(f"{size} {ms / steps:.1f}" for size, ms in gaps["by_size"].items())
                + "); the most after -> before: "
                + "; ".join(
                    f"{pair} {ms / steps:.1f} ms in {count / steps:.0f}"
                    for ms, count, pair in gaps["around"]
                )
            )
        summary = self.directory / f"{name}.txt"
        summary.write_text("\n".join(lines) + f"\n{table}\n")
        timeline = gpu_timeline(events)
        if timeline:
            (self.directory / f"{name}_timeline.txt").write_text(
                _timeline_text(timeline, self.rank)
            )
        print(
            f"rank {self.rank}: profile of steps {self.start_step + 1}-{steps_done} in {summary.parent}/{name}.*",
            flush=True,
        )
        self._profiler = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def communication_kind(event: dict) -> str | None:
    """The transfer a trace event is, or None for compute: an NCCL kernel by its collective
    (AllGather, ReduceScatter, AllReduce, SendRecv, ...), a peer-to-peer copy (the copy engines
    of `--tp-comm-overlap`'s symmetric memory, which the profiler names PtoP), or a barrier of
    symmetric memory (a one-block kernel that waits for the peers)."""
    name = event.get("name", "")
    if event.get("cat") == "gpu_memcpy":
        return "peer copies" if "PtoP" in name else None
    if event.get("cat") != "kernel":
        return None
    if "nccl" in name.lower():
        collective = re.search(r"ncclDevKernel_([A-Za-z]+)|ncclKernel_([A-Za-z]+)", name)
        return (
            next((group for group in collective.groups() if group), "NCCL")
            if collective
            else "NCCL"
        )
    return "symmetric-memory barriers" if "barrier_kernel" in name else None


def kernel_time(trace: dict) -> dict:
    """From a Chrome trace: milliseconds in which any GPU kernel or transfer ran (`busy_ms`), any
    compute kernel ran, communication ran (summed; `communication_kind`), and communication ran
    with no compute kernel beside it (nothing overlapped), in all and per kind (`by_kind`: count,
    ms, exposed ms). Idle wall time beyond `busy_ms` is time the GPU waited on the host (launches,
    Python) or on another rank."""
    timed = _gpu_events(trace)
    compute = _compute(timed)
    starts = [start for start, _ in compute]
    by_kind: dict = {}
    for start, end, kind, _ in timed:
        if kind is not None:
            totals = by_kind.setdefault(kind, {"count": 0, "ms": 0.0, "exposed_ms": 0.0})
            totals["count"] += 1
            totals["ms"] += (end - start) / 1000
            totals["exposed_ms"] += _length(_minus((start, end), compute, starts)) / 1000
    communication = _merged([(start, end) for start, end, kind, _ in timed if kind is not None])
    exposed = sum(_length(_minus(interval, compute, starts)) for interval in communication)
    busy = _merged(
        [(start, end) for start, end, kind, kernel in timed if kernel or kind is not None]
    )
    return {
        "kernels": sum(kernel for *_, kernel in timed),
        "busy_ms": _length(busy) / 1000,
        "compute_ms": _length(compute) / 1000,
        "communication_ms": sum(totals["ms"] for totals in by_kind.values()),
        "communication_exposed_ms": exposed / 1000,
        "by_kind": dict(sorted(by_kind.items(), key=lambda item: -item[1]["ms"])),
    }


def gpu_timeline(trace: dict, join_ms: float = 0.05) -> list:
    """From a Chrome trace: the GPU's time line as runs (start ms from the first one, length ms,
    what): "compute" (compute kernels, with any transfer beside them), a transfer kind
    (`communication_kind`) with no compute kernel beside it, or "idle" (nothing ran: the GPU waited
    for the host or, with communication alone, for another rank). Runs of one kind closer than
    `join_ms` are one run: where a pipeline rank waits shows as the long non-compute runs."""
    timed = _gpu_events(trace)
    compute = _compute(timed)
    starts = [start for start, _ in compute]
    runs = [(start, end, "compute") for start, end in compute]
    for start, end, kind, _ in timed:
        if kind is not None:
            runs += [(*part, kind) for part in _minus((start, end), compute, starts)]
    join_us = 1000 * join_ms
    joined: list = []
    for start, end, what in sorted(runs):
        if joined and joined[-1][2] == what and start - joined[-1][1] < join_us:
            joined[-1][1] = max(joined[-1][1], end)
        else:
            joined.append([start, end, what])
    if not joined:
        return []
    origin, timeline, reached = joined[0][0], [], None
    for start, end, what in joined:
        if reached is not None and start - reached >= join_us:
            timeline.append(((reached - origin) / 1000, (start - reached) / 1000, "idle"))
        timeline.append(((start - origin) / 1000, (end - start) / 1000, what))
        reached = end if reached is None else max(reached, end)
    return timeline


# (category, pattern of kernel names), first match wins; names as cuBLAS/cuDNN/Triton/ATen give them.
KERNEL_CATEGORIES = (
    ("communication", r"nccl|barrier_kernel"),
    ("FP8 GEMMs", r"nvjet_sm\d+_q|_f8|e4m3|e5m2"),
    ("other GEMMs", r"nvjet|gemm|cutlass|xmma|_mm_"),
    ("attention", r"flash|fmha|sdpa|attention|dot_do_o|convert_dq"),
    # A norm or activation that writes FP8 itself (docs/fp8.md, Neighbour fusion): its cast's share
    # is not separable, so the kernel counts as the norm or activation it replaces.
    ("norms/activations", r"_norm_quantize_kernel|_activation(_backward)?_quantize_kernel"),
    ("FP8 casts", r"_quantize_kernel"),
    ("loss", r"_statistics_kernel|_gradient_kernel|cross_entropy|softmax|nll_loss"),
    ("optimizer", r"adam|multi_tensor_apply|_delayed_update"),
    ("norms/activations", r"layer_norm|rms_?norm|GammaBeta|gelu|silu|Gelu|Silu|swiglu"),
)


def kernel_categories(trace: dict) -> dict:
    """From a Chrome trace: milliseconds of GPU kernel time per category (KERNEL_CATEGORIES,
    then "other elementwise"), largest first. Kernels replayed from CUDA graphs count under
    their own names."""
    totals: dict = {}
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel" or "dur" not in event:
            continue
        name = event.get("name", "")
        category = next(
            (c for c, pattern in KERNEL_CATEGORIES if re.search(pattern, name, re.IGNORECASE)),
            "other elementwise",
        )
        totals[category] = totals.get(category, 0.0) + event["dur"] / 1000
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


# Gap sizes idle_gaps sums by, in µs: the GPU's own latency between two dependent activities of a
# CUDA graph is a few µs; longer ones wait for another stream, another rank or the host.
GAP_SIZES = (5, 20, 200)


def idle_gaps(trace: dict, top: int = 10) -> dict:
    """From a Chrome trace: where the GPU sat idle between its activities (kernels, copies,
    memsets), which the timeline joins into its runs. {"idle_ms", "gaps", "by_size": {"< 5 us":
    ms, ...}, "around": [(ms, count, "before -> after"), ...]}: the `top` pairs of activities
    (short names) with the most idle time between them, the one that ended last and the next."""
    events = sorted(
        (e["ts"], e["ts"] + e["dur"], _short_name(e.get("name", "")))
        for e in trace.get("traceEvents", [])
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    )
    sizes = [f"< {size} us" for size in GAP_SIZES] + [f">= {GAP_SIZES[-1]} us"]
    by_size, around, gaps = dict.fromkeys(sizes, 0.0), {}, 0
    if events:
        busy_until, last = events[0][1], events[0][2]
        for start, end, name in events[1:]:
            if start > busy_until:
                gap = start - busy_until
                gaps += 1
                size = next((i for i, limit in enumerate(GAP_SIZES) if gap < limit), len(GAP_SIZES))
                by_size[sizes[size]] += gap / 1000
                total, count = around.get(f"{last} -> {name}", (0.0, 0))
                around[f"{last} -> {name}"] = (total + gap / 1000, count + 1)
            if end >= busy_until:
                busy_until, last = end, name
    ranked = sorted(around.items(), key=lambda item: -item[1][0])[:top]
    return {
        "idle_ms": sum(by_size.values()),
        "gaps": gaps,
        "by_size": by_size,
        "around": [(ms, count, pair) for pair, (ms, count) in ranked],
    }


def _short_name(name: str) -> str:
    """A device activity's name without return type, arguments and namespaces, cut at 60
    characters: `void at::native::f<8, at::native::Add<float>>(int)` -> `f<8, Add<float>>`."""
    name = re.sub(r"^void ", "", name).split("(")[0]
    return re.sub(r"\b(?:\w+::)+", "", name)[:60].strip(" ,")


def _timeline_text(timeline: list, rank: int) -> str:
    waits = sorted((run for run in timeline if run[2] != "compute"), key=lambda run: -run[1])
    lines = [
        f"rank {rank}: the GPU's time line (ms from the first kernel): compute, communication with "
        "no compute beside it, idle",
        "the longest waits: "
        + ", ".join(f"{what} {length:.2f} at {start:.2f}" for start, length, what in waits[:10]),
        "",
    ]
    lines += [f"{start:10.2f} {what:26s} {length:8.2f}" for start, length, what in timeline]
    return "\n".join(lines) + "\n"


def _gpu_events(trace: dict) -> list:
    """(start µs, end µs, communication kind or None, whether a kernel) of every kernel and
    device copy in a Chrome trace."""
    return [
        (e["ts"], e["ts"] + e["dur"], communication_kind(e), e.get("cat") == "kernel")
        for e in trace.get("traceEvents", [])
        if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e
    ]


def _compute(timed: list) -> list:
    """The compute kernels' time, merged into disjoint intervals."""
    return _merged([(start, end) for start, end, kind, kernel in timed if kind is None and kernel])


def _merged(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _minus(interval, merged, starts=None):
    """The parts of `interval` not covered by the sorted, disjoint `merged` intervals
    (`starts`: their start points, for a binary search)."""
    start, end = interval
    starts = starts if starts is not None else [s for s, _ in merged]
    parts = []
    for other_start, other_end in merged[max(bisect.bisect_right(starts, start) - 1, 0) :]:
        if other_start >= end:
            break
        if other_end <= start:
            continue
        if other_start > start:
            parts.append((start, other_start))
        start = max(start, other_end)
    if start < end:
        parts.append((start, end))
    return parts
