"""NCCL kernel time of a trainer profile trace (--use-pytorch-profiler), per collective: in all,
and with no compute kernel beside it.    python nccl_split.py TRACE.json"""
import collections
import json
import re
import sys


def _merged(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(intervals):
    return sum(end - start for start, end in intervals)


def _minus(interval, merged, starts):
    """The parts of `interval` outside the sorted, disjoint `merged` intervals."""
    import bisect
    start, end = interval
    parts = []
    for other_start, other_end in merged[max(bisect.bisect_right(starts, start) - 1, 0):]:
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


ev = json.load(open(sys.argv[1]))["traceEvents"]
k = [e for e in ev if e.get("cat") == "kernel" and "dur" in e]
comp = _merged([(e["ts"], e["ts"] + e["dur"]) for e in k if "nccl" not in e["name"].lower()])
starts = [s for s, _ in comp]
tot = collections.Counter(); exp = collections.Counter(); cnt = collections.Counter()
for e in k:
    if "nccl" not in e["name"].lower():
        continue
    m = re.search(r"(AllGather|ReduceScatter|AllReduce|SendRecv|Send|Recv|Broadcast)", e["name"])
    key = m.group(1) if m else e["name"][:40]
    tot[key] += e["dur"]; cnt[key] += 1
    exp[key] += _length(_minus((e["ts"], e["ts"] + e["dur"]), comp, starts))
span = max(e["ts"] + e["dur"] for e in k) - min(e["ts"] for e in k)
print(f"trace span {span/1000:.1f} ms; compute busy {_length(comp)/1000:.1f} ms")
for key in tot:
    print(f"{key:15s} n={cnt[key]:6d} total {tot[key]/1000:8.1f} ms exposed {exp[key]/1000:8.1f} ms")
