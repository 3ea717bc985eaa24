"""A profiled step, rank by rank, as runs of compute kernels, communication kernels and idle
time: where a pipeline rank waits. Reads the trainer's --use-pytorch-profiler chrome traces.

    python timeline.py runs/latest/profile/rank0_*.json runs/latest/profile/rank1_*.json
"""

import json
import sys

from megafp8.training.profiling import communication_kind

IDLE_MS = 0.05  # gaps shorter than this join the runs around them


def gpu_events(path):
    events = json.load(open(path))["traceEvents"]
    out = []
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            kind = communication_kind(e) or "compute"
            out.append((e["ts"] / 1000, (e["ts"] + e["dur"]) / 1000, kind))
    return sorted(out)


def runs(events):
    """Merge events into (start, end, what): compute runs (communication beside compute counts
    as compute), communication alone, and idle gaps."""
    compute = _merge([(s, e) for s, e, k in events if k == "compute"])
    result = []
    for s, e in compute:
        result.append((s, e, "compute"))
    for s, e, k in events:
        if k == "compute":
            continue
        for piece in _minus((s, e), compute):
            result.append((*piece, k))
    result.sort()
    merged = []
    for s, e, k in result:
        if merged and merged[-1][2] == k and s - merged[-1][1] < IDLE_MS:
            merged[-1] = (merged[-1][0], max(e, merged[-1][1]), k)
        else:
            merged.append((s, e, k))
    out, end = [], None
    for s, e, k in merged:
        if end is not None and s - end >= IDLE_MS:
            out.append((end, s, "idle"))
        out.append((s, e, k))
        end = e if end is None else max(end, e)
    return out


def _merge(intervals):
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1] + IDLE_MS:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _minus(interval, merged):
    s, e = interval
    pieces = []
    for ms, me in merged:
        if me <= s or ms >= e:
            continue
        if ms > s:
            pieces.append((s, ms))
        s = max(s, me)
    if s < e:
        pieces.append((s, e))
    return pieces


def main(paths):
    timelines = [runs(gpu_events(p)) for p in paths]
    origin = min(t[0][0] for t in timelines)
    for rank, timeline in enumerate(timelines):
        print(f"== {paths[rank]}")
        totals = {}
        for s, e, k in timeline:
            totals[k] = totals.get(k, 0) + e - s
            print(f"{s - origin:9.2f} {k:10s} {e - s:7.2f}")
        print("totals ms:", {k: round(v, 1) for k, v in totals.items()})


if __name__ == "__main__":
    main(sys.argv[1:])
