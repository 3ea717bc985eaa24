"""The copies of a rank's own blocks into its shared region, in a profiled tp 2 step (the trainer's
`--profile --use-pytorch-profiler` Chrome trace, rank 0): how many ran slower than at full speed
and how much later they let the peers' reads start.

    python staging_copies.py rank0_steps11-12.json [--steps 2]

A staging copy is a `memcpy128` kernel on the copy stream followed by a barrier (or by another
staging copy, then a barrier). Full speed: an 8 MB block in 4.5 us.
"""

import argparse
import collections
import json

FULL_SPEED_US = 4.5

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("trace")
parser.add_argument("--steps", type=int, default=2)
args = parser.parse_args()
events = json.load(open(args.trace))["traceEvents"]
kernels = sorted(
    (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e),
    key=lambda e: e["ts"],
)
copy_stream = collections.Counter(e["args"]["stream"] for e in kernels if "PtoP" in e["name"])
copy_stream = copy_stream.most_common(1)[0][0]
on_copy_stream = [e for e in kernels if e["args"].get("stream") == copy_stream]
count, late_us = collections.Counter(), collections.Counter()
for i, event in enumerate(on_copy_stream[:-2]):
    if event["name"] != "memcpy128":
        continue
    after = [e["name"] for e in on_copy_stream[i + 1 : i + 3]]
    staging = "barrier" in after[0] or (after[0] == "memcpy128" and "barrier" in after[1])
    if staging:
        slow = event["dur"] > 2 * FULL_SPEED_US
        count[slow] += 1
        late_us[slow] += event["dur"] - FULL_SPEED_US
for slow in (False, True):
    print(
        f"staging copies {'slower than' if slow else 'at'} full speed: {count[slow] / args.steps:.0f} a step, "
        f"{late_us[slow] / args.steps / 1000:.1f} ms a step beyond {FULL_SPEED_US} us each"
    )
