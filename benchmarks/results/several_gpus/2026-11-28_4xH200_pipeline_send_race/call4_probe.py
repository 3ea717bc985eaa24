"""Probe: pp4 delayed graphed runs' last-step loss (the check's shape), with variants, side by side."""
import json, os, subprocess, sys, time
from pathlib import Path
from tests.multigpu.check_layouts import Run, environment, overlap_flags, REPO, RECIPE, losses_of

out = Path(os.environ["OUT"]) / "pp4"
work = Path("/tmp/pp4w")
(work / "logs").mkdir(parents=True, exist_ok=True)
subprocess.run(["bash", str(REPO / "examples" / "prepare_sample_data.sh"), str(work / "data"), "32768"],
               check=True, stdout=subprocess.DEVNULL)
base = {"ITERS": "9"}
variants = {  # name: (layout, precision, graphs, env overrides, extra args)
    "bad": ("pp4", "delayed", True, base, ""),
    "log2": ("pp4", "delayed", True, {**base, "LOG_INTERVAL": "2"}, ""),
    "gbs8": ("pp4", "delayed", True, {**base, "GBS": "8"}, ""),
    "noclip": ("pp4", "delayed", True, base, "--clip-grad 0"),
    "hist16": ("pp4", "delayed", True, base, "--fp8-amax-history-len 16 --fp8-amax-compute-algo most_recent"),
    "tiny": ("pp4", "delayed", True, {**base, "SEQ": "64"}, "--hidden-size 64 --num-attention-heads 4"),
    "log2gbs8": ("pp4", "delayed", True, {**base, "LOG_INTERVAL": "2", "GBS": "8"}, ""),
    "eager": ("pp4", "delayed", False, base, ""),
    "eager-gbs8": ("pp4", "delayed", False, {**base, "GBS": "8"}, ""),
    "eager-tiny": ("pp4", "delayed", False, {**base, "SEQ": "64"}, "--hidden-size 64 --num-attention-heads 4"),
}
procs = {}
for name, (layout, precision, graphs, over, more) in variants.items():
    run = Run(layout, precision, graphs)
    devices = [0] if layout == "1gpu" else [0, 1, 2, 3]
    env = environment(run, work, False, devices)
    env.update(over, SAVE=str(work / "runs" / name))
    env["EXTRA_ARGS"] = env["EXTRA_ARGS"].replace("--save-interval 3", "--save-interval 100") + " " + more
    (work / "runs" / name).mkdir(parents=True, exist_ok=True)
    log = open(work / "logs" / f"{name}.log", "w")
    procs[name] = subprocess.Popen(["bash", str(RECIPE)], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
for name, p in procs.items():
    p.wait(timeout=400)
rows = {}
for name in variants:
    losses, _, speed = losses_of(work / "runs" / name / "metrics.jsonl")
    rows[name] = {"rc": procs[name].returncode, "losses": losses}
    print(f"{name:30s} rc={procs[name].returncode} " + " ".join(f"{v:.4f}" for k, v in sorted(losses.items())))
out.mkdir(parents=True, exist_ok=True)
json.dump(rows, open(out / "losses.json", "w"), indent=1)
subprocess.run(f"cp -r {work}/logs {out}/", shell=True)
