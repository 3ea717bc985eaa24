"""Where the GPU waits in a profiled step: the gaps between its kernels, each charged to the host
op that launched the kernel after it (a late launch: the host was behind the GPU there).

    python benchmarks/profile_gaps.py RUN_DIR/profile/rank0_steps11-12.json [--min-gap-us 15]

The trace is the trainer's `--profile --use-pytorch-profiler` Chrome trace. Prints the total of
the gaps over the threshold, their sum per launching op (innermost four host ops), and the
largest gaps.
"""

import argparse
import collections
import json


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--min-gap-us", type=float, default=15.0)
    args = parser.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    kernels = sorted(
        (
            e
            for e in events
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
        ),
        key=lambda e: e["ts"],
    )
    if not kernels:
        raise SystemExit(
            f"{args.trace}: no GPU kernels in this trace (was it taken with --use-pytorch-profiler?)"
        )
    launches = {
        e["args"].get("correlation"): e
        for e in events
        if e.get("cat") == "cuda_runtime" and "args" in e
    }
    host_ops = sorted(
        (
            e
            for e in events
            if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and "dur" in e
        ),
        key=lambda e: e["ts"],
    )

    def launched_in(ts):
        return " > ".join(e["name"][:40] for e in host_ops if e["ts"] <= ts <= e["ts"] + e["dur"])

    gaps, end = [], kernels[0]["ts"] + kernels[0]["dur"]
    for kernel in kernels[1:]:
        gap = kernel["ts"] - end
        if gap > args.min_gap_us:
            launch = launches.get(kernel["args"].get("correlation"))
            where = (
                " > ".join(launched_in(launch["ts"]).split(" > ")[-4:])
                if launch
                else "(no launch event)"
            )
            gaps.append((gap, kernel["name"][:50], where))
        end = max(end, kernel["ts"] + kernel["dur"])
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    print(
        f"kernels span {span / 1000:.1f} ms; {len(gaps)} gaps over {args.min_gap_us:g} us, "
        f"{sum(g[0] for g in gaps) / 1000:.2f} ms in all"
    )
    per_op = collections.Counter()
    for gap, _, where in gaps:
        per_op[where] += gap
    for where, us in per_op.most_common(15):
        print(f"{us / 1000:7.2f} ms  before a launch in [{where}]")
    print("largest:")
    for gap, name, where in sorted(gaps, reverse=True)[:20]:
        print(f"{gap:8.0f} us  before {name}  launched in [{where}]")


if __name__ == "__main__":
    main()
