"""The multi-GPU check: the shipped GPT recipe (examples/pretrain_gpt_1b_fp8.sh), as a user runs
it, shrunk to a few iterations of a small model of the same family, under every layout of 2 GPUs
(dp2, tp2 + SP, pp2, interleaved pp2) and, with 4 GPUs, of 4 (tp2 x pp2, pp2 x dp2, tp2 x dp2,
pp4, dp4): bf16, FP8 delayed and FP8 current with CUDA graphs (the recipe's default), FP8 delayed
without them, FP8 delayed saved half way and resumed, stopped by SIGTERM to its process group,
and with an error on its last rank.

    python -m tests.multigpu.check_layouts                  # every layout the GPUs allow
    python -m tests.multigpu.check_layouts --gpus 2 --output runs/check
    python -m tests.multigpu.check_layouts --cpu --layouts dp2 --precisions delayed   # gloo, CPU
    python -m tests.multigpu.check_layouts --layouts tp2 tp2dp2 --without-tp-comm-overlap
    python -m tests.multigpu.check_layouts --share 6 --time-limit 540   # within a 600 s call
    python -m tests.multigpu.check_layouts --layouts tp2 --precisions delayed --repeat 8 --share 8

The recipe's own overlaps are on, as it ships them: --tp-comm-overlap where tp > 1, the
distributed optimizer with --overlap-param-gather where dp > 1 (`--without-...` turns them off).
`--fp8-param-gather` adds that flag to the FP8 delayed runs of the distributed optimizer (their
FP8 primary weights all-gathered in FP8; not the recipe's default).

Each run must
- exit with status 0 within 30 s of its last iteration (teardown: graphs, NCCL, data workers);
- track one GPU of the same precision (losses within 1% at every iteration; straight runs);
- if graphed, give the eager run's losses (FP8 delayed; within 0.1%, as a resumed run);
- if resumed, give the straight run's losses from the checkpoint on (within 0.1%: graphed runs
  do not always repeat themselves bit for bit, docs/fp8.md);
- if signalled (SIGTERM to the launch's process group, as a scheduler preempts), save at the next
  step boundary and end within 30 s of the signal (torchrun itself exits 1 after a signal);
- if one rank fails, end, every rank, within 60 s (torchrun stops the others 30 s after).
A run still going 300 s after its start hangs: its processes are stopped, then one by one write
their Python stacks into its log (faulthandler, on SIGABRT; where cuda-gdb is installed, each
rank's kernels on its GPU and native stack first), then it and every process it started
(torchrun's ranks sit in sessions of their own) are killed.
Runs go side by side, `--share` of them on each GPU (most of a run is starting up), the one-GPU
references first, then the largest and of those the longest (`start_order`). A table closes the
output and the exit status is 1 if any run failed; `--output` keeps every log and a JSON record.
`--time-limit SECONDS` (a device call's limit) starts no run after it and stops those going: what
finished is judged, the rest named as not run (exit status 2 if nothing failed). `--repeat N`
makes every run but the one-GPU references N times (`-r2` and on in their names), each judged on
its own, for what fails only now and then (a hang seen once in three checks).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "pretrain_gpt_1b_fp8.sh"

# name: (GPUs, tp, pp, virtual stages per pipeline rank: the recipe's VPP). The recipe interleaves
# four at pp 2 (of the 4-layer model, balanced: half a layer each, attention or MLP); pp2 and pp4
# (one layer per stage) check plain 1F1B.
LAYOUTS = {
    "1gpu": (1, 1, 1, 1),
    "dp2": (2, 1, 1, 1),
    "tp2": (2, 2, 1, 1),
    "pp2": (2, 1, 2, 1),
    "vpp4": (2, 1, 2, 4),
    "tp2pp2": (4, 2, 2, 4),
    "pp2dp2": (4, 1, 2, 4),
    "tp2dp2": (4, 2, 1, 1),
    "pp4": (4, 1, 4, 1),
    "dp4": (4, 1, 1, 1),
}
PRECISIONS = ("bf16", "delayed", "current")  # checked by default; the others when asked for
PRECISION_CHOICES = (*PRECISIONS, "rowwise", "blockwise")
EXIT_WITHIN_S = 30.0
TRACK_TOLERANCE = 0.01
RESUME_TOLERANCE = 1e-3
# a run that has not exited by then hangs: its stacks are dumped, then it is killed
RUN_TIMEOUT_S = 300
PEER_TIMEOUT_S = 180  # the runs' --distributed-timeout-minutes, in seconds
STACKS_WITHIN_S = 5.0  # how long a hung run's processes get to write their stacks
STACK_GAP_S = 1.0  # between two processes' stacks, so that they do not interleave in the log
GPU_STATE_WITHIN_S = 60  # for cuda-gdb to attach to a hung rank and answer

# The shrunk recipe: the GPT-1.3B family at 4 layers of hidden 1024 (one layer per stage at pp4,
# eight virtual stages of half a layer at interleaved pp2), on the embedded sample corpus.
GPU_SHAPE = dict(
    SEQ="1024",
    MBS="2",
    GBS="16",
    ITERS="6",
    WARMUP="2",
    SHAPE="--num-layers 4 --hidden-size 1024 --num-attention-heads 16",
)
CPU_SHAPE = dict(
    SEQ="64",
    MBS="2",
    GBS="8",
    ITERS="6",
    WARMUP="2",
    SHAPE="--num-layers 4 --hidden-size 64 --num-attention-heads 4",
)
RESUME_AT = 3


KINDS = ("straight", "resumed", "sigterm", "fail")
SIGNAL_AT = FAIL_AT = RESUME_AT  # the iteration after which a run is signalled, or fails
ENDS_WITHIN_S = {"sigterm": 30.0, "fail": 60.0}


@dataclass(frozen=True)
class Run:
    layout: str
    precision: str
    graphs: bool
    kind: str = "straight"  # resumed: from the straight run's checkpoint at RESUME_AT
    repeat: int = 1  # the how-manieth of its kind (--repeat)

    @property
    def name(self) -> str:
        return (
            f"{self.layout}-{self.precision}-{'graphs' if self.graphs else 'eager'}"
            + ("" if self.kind == "straight" else f"-{self.kind}")
            + ("" if self.repeat == 1 else f"-r{self.repeat}")
        )

    @property
    def straight(self) -> Run:
        return Run(self.layout, self.precision, self.graphs, repeat=self.repeat)

    @property
    def eager(self) -> Run:
        """The eager twin of a straight run, of the same repeat."""
        return Run(self.layout, self.precision, False, repeat=self.repeat)

    @property
    def gpus(self) -> int:
        return LAYOUTS[self.layout][0]


def plan(layouts, precisions, graphs: bool, kinds=KINDS, repeat: int = 1) -> list[Run]:
    """The runs checking `layouts`: each precision as shipped (graphed on GPUs), FP8 delayed eager,
    FP8 delayed resumed, signalled and failing, each `repeat` times; one GPU of each precision
    once, as the reference. Without graphs (the CPU) every run is eager."""
    delayed = "delayed" if "delayed" in precisions else precisions[0]
    runs = [Run("1gpu", p, graphs) for p in precisions] if "straight" in kinds else []
    for r in range(1, repeat + 1):
        for layout in layouts:
            if "straight" in kinds:  # resumed runs need them (main() refuses resumed alone)
                runs += [Run(layout, p, graphs, repeat=r) for p in precisions]
                if graphs:
                    runs.append(Run(layout, delayed, False, repeat=r))
            runs += [Run(layout, delayed, graphs, kind, r) for kind in KINDS[1:] if kind in kinds]
    return runs


def overlap_flags(layout: str, tp_comm_overlap: bool, distributed_optimizer: bool) -> list[str]:
    """The trainer's overlap flags the recipe gives a layout: --tp-comm-overlap where tp > 1, the
    distributed optimizer with --overlap-param-gather where dp > 1 (each as asked)."""
    gpus, tp, pp, _ = LAYOUTS[layout]
    flags = ["--tp-comm-overlap"] if tp_comm_overlap and tp > 1 else []
    if distributed_optimizer and gpus // (tp * pp) > 1:
        flags += ["--use-distributed-optimizer", "--overlap-param-gather"]
    return flags


def fp8_param_gather_flags(run: Run, distributed_optimizer: bool, fp8_param_gather: bool) -> list:
    """--fp8-param-gather for `run` when asked for and it applies: FP8 delayed where the recipe
    runs the distributed optimizer (`overlap_flags`)."""
    distributed = "--use-distributed-optimizer" in overlap_flags(
        run.layout, False, distributed_optimizer
    )
    applies = run.precision == "delayed" and distributed
    return ["--fp8-param-gather"] if fp8_param_gather and applies else []


def environment(
    run: Run,
    work: Path,
    cpu: bool,
    devices: list[int],
    overlaps=(True, True),
    fp8_param_gather: bool = False,
) -> dict:
    """The recipe's environment for `run`; `overlaps`: the recipe's TP_COMM_OVERLAP and
    DISTRIBUTED_OPTIMIZER; `fp8_param_gather`: see fp8_param_gather_flags."""
    gpus, tp, pp, vpp = LAYOUTS[run.layout]
    shape = CPU_SHAPE if cpu else GPU_SHAPE
    save = work / "runs" / run.name
    extra = [shape["SHAPE"], "--save-interval", str(RESUME_AT), "--seed", "1234"]
    extra += fp8_param_gather_flags(run, overlaps[1], fp8_param_gather)
    # a rank left waiting for a peer fails, saying where (NCCL's watchdog, a copy-engine barrier's
    # message), before the check would call it hung
    extra += ["--distributed-timeout-minutes", str(PEER_TIMEOUT_S / 60)]
    if run.kind == "resumed":
        extra += ["--load", str(work / "runs" / run.straight.name / f"iter_{RESUME_AT:07d}")]
    # A signalled run runs until the signal (its longer run draws other batches: not compared).
    iterations = "1000" if run.kind == "sigterm" else shape["ITERS"]
    env = {
        **os.environ,
        "GPUS": str(gpus),
        "TP": str(tp),
        "PP": str(pp),
        "VPP": str(vpp),
        "MBS": shape["MBS"],
        "GBS": shape["GBS"],
        "SEQ": shape["SEQ"],
        "ITERS": iterations,
        "WARMUP": shape["WARMUP"],
        "LOG_INTERVAL": "1",
        "PRECISION": "bf16" if run.precision == "bf16" else "fp8",
        "FP8_RECIPE": run.precision,
        "CUDA_GRAPH": "1" if run.graphs else "0",
        "WORKDIR": str(work / "data"),
        "SAVE": str(save),
        "EXTRA_ARGS": " ".join(extra),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",  # a hung run's ranks answer SIGABRT with their stacks (_stop_hung)
        "CHECK_FAIL_AT": str(FAIL_AT),
        "TP_COMM_OVERLAP": str(int(overlaps[0])),
        "DISTRIBUTED_OPTIMIZER": str(int(overlaps[1])),
    }
    if cpu:
        env.update(CPU="1", CUDA_VISIBLE_DEVICES="")
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    return env


@dataclass
class Outcome:
    run: str
    layout: str
    precision: str
    graphs: bool
    kind: str
    returncode: int | None = None  # None: killed after RUN_TIMEOUT_S
    exit_after_last_s: float | None = None  # after its last logged iteration
    ended_after_event_s: float | None = None  # after the signal, or the planted failure
    wall_s: float = 0.0
    losses: dict | None = None  # iteration -> loss
    tokens_per_s: float | None = None
    problems: list | None = None


def failing_command(run: Run, work: Path, cpu: bool, flags=()) -> list[str]:
    """The recipe's trainer command for a run whose last rank fails (tests.multigpu.failing_rank),
    on synthetic tokens: what matters is how the ranks end, not the data."""
    gpus, tp, pp, vpp = LAYOUTS[run.layout]
    shape = CPU_SHAPE if cpu else GPU_SHAPE
    command = [
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        str(gpus),
        "-m",
        "tests.multigpu.failing_rank",
        "--model",
        "gpt-1.3b",
        "--seq-length",
        shape["SEQ"],
        "--max-position-embeddings",
        shape["SEQ"],
        *shape["SHAPE"].split(),
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        "--micro-batch-size",
        shape["MBS"],
        "--global-batch-size",
        shape["GBS"],
        "--train-iters",
        shape["ITERS"],
        "--lr",
        "2e-4",
        "--lr-warmup-iters",
        shape["WARMUP"],
        "--bf16",
        "--mock-data",
        "--vocab-size",
        "32768",
        "--log-interval",
        "1",
        "--save",
        str(work / "runs" / run.name),
    ]
    if run.precision != "bf16":  # the format the recipe gives it
        fmt = "e4m3" if run.precision in ("rowwise", "blockwise") else "hybrid"
        command += ["--fp8-format", fmt, "--fp8-recipe", run.precision]
    if tp > 1:
        command.append("--sequence-parallel")
    command += flags
    if pp > 1:
        command += ["--num-virtual-stages-per-pipeline-rank", str(vpp), "--balance-pipeline-split"]
    if run.graphs:
        command.append("--enable-cuda-graph")
    return command


def losses_of(metrics: Path) -> tuple[dict, float | None, float | None]:
    """({iteration: loss}, the last record's time, the last tokens/s) of a run's metrics.jsonl."""
    losses, last_time, speed = {}, None, None
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if "loss" in record:
                losses[record["iteration"]] = record["loss"]
                last_time = record["time"]
                speed = record.get("tokens_per_sec", speed)
    return losses, last_time, speed


# Within a size, the longest first, so that no long run is left to the end: a failing run lasts
# torchrun's 30 s of stopping the other ranks longer, a straight run that a resumed one waits for
# lasts as long as both.
_LONGEST_FIRST = {
    "fail": 0,
    "straight with a resumed run": 1,
    "sigterm": 2,
    "straight": 3,
    "resumed": 4,
}


def start_order(runs: list[Run]) -> list[Run]:
    """The one-GPU runs first (every other run is judged against them, so a check cut short can
    still judge what it finished), then the largest first (they pack best), each size's longest
    first."""
    resumed = {run.straight for run in runs if run.kind == "resumed"}

    def length(run: Run) -> int:
        kind = "straight with a resumed run" if run in resumed else run.kind
        return _LONGEST_FIRST[kind]

    return sorted(runs, key=lambda r: (r.layout != "1gpu", -r.gpus, length(r)))


class Launcher:
    """Runs the planned runs side by side on `gpus` devices (`share` runs per device at once)."""

    def __init__(
        self,
        work: Path,
        gpus: int,
        cpu: bool,
        share: int,
        overlaps=(True, True),
        fp8_param_gather: bool = False,
    ):
        # (tp_comm_overlap, distributed_optimizer)
        self.work, self.cpu, self.overlaps = work, cpu, overlaps
        self.fp8_param_gather = fp8_param_gather
        self.free = {d: share for d in range(max(gpus, 1))}
        self.running: dict = {}  # Run -> (process, devices, start, log file, processes it started)
        self.events: dict = {}  # Run -> when it was signalled or failed
        self.outcomes: dict = {}

    def start(self, run: Run) -> bool:
        devices = sorted((d for d in self.free if self.free[d] > 0), key=lambda d: -self.free[d])[
            : run.gpus
        ]
        if not self.cpu and len(devices) < run.gpus:
            return False
        for d in devices:
            self.free[d] -= 1
        save = self.work / "runs" / run.name
        shutil.rmtree(save, ignore_errors=True)
        save.mkdir(parents=True)
        log = open(self.work / "logs" / f"{run.name}.log", "w")
        flags = overlap_flags(run.layout, *self.overlaps)
        flags += fp8_param_gather_flags(run, self.overlaps[1], self.fp8_param_gather)
        command = (
            failing_command(run, self.work, self.cpu, flags)
            if run.kind == "fail"
            else ["bash", str(RECIPE)]
        )
        process = subprocess.Popen(
            command,
            env=environment(
                run, self.work, self.cpu, devices, self.overlaps, self.fp8_param_gather
            ),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_without_core_files,
        )
        self.running[run] = (process, devices, time.time(), log, set())
        return True

    def _event(self, run: Run, process) -> None:
        """Signal a sigterm run once it has logged SIGNAL_AT; note when a fail run's error happened
        (its last logged iteration is the one before)."""
        if run.kind not in ("sigterm", "fail") or run in self.events:
            return
        losses, last_time, _ = losses_of(self.work / "runs" / run.name / "metrics.jsonl")
        if run.kind == "sigterm" and SIGNAL_AT in losses:
            os.killpg(process.pid, signal.SIGTERM)
            self.events[run] = time.time()
        elif run.kind == "fail" and FAIL_AT - 1 in losses:
            self.events[run] = last_time

    def poll(self) -> list[Run]:
        done, parents = [], _process_parents()
        for run, (process, devices, start, log, started) in list(self.running.items()):
            self._event(run, process)
            started |= _descendants(process.pid, parents)  # the ranks, found while torchrun lives
            alive = (
                process.poll() is None or _group_alive(process.pid) or any(map(_running, started))
            )
            if alive and time.time() - start < RUN_TIMEOUT_S:
                continue
            if alive:
                _stop_hung(process.pid, started, log)
                process.wait()
            returncode = None if alive else process.returncode
            end = time.time()
            log.close()
            for d in devices:
                self.free[d] += 1
            losses, last_time, speed = losses_of(self.work / "runs" / run.name / "metrics.jsonl")
            event = self.events.get(run)
            self.outcomes[run] = Outcome(
                run.name,
                run.layout,
                run.precision,
                run.graphs,
                run.kind,
                returncode,
                None if last_time is None else round(end - last_time, 1),
                None if event is None else round(end - event, 1),
                round(end - start, 1),
                losses,
                speed,
            )
            del self.running[run]
            done.append(run)
        return done

    def run_all(self, runs: list[Run], time_limit: float | None = None) -> dict:
        """Every run in `start_order`, a resumed run once its straight run is done; the outcomes
        so far are written after each run, so a check cut short keeps them. Past `time_limit`
        seconds no run starts and those still going are stopped (they have no outcome). A check
        stopped (SIGTERM, Ctrl-C, an error) stops its runs too: left running, they would hold
        the GPUs and write into the next check's folders."""
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        waiting = start_order(runs)
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        start = time.time()
        try:
            while (waiting or self.running) and (
                time_limit is None or time.time() - start < time_limit
            ):
                for run in list(waiting):
                    if run.kind == "resumed" and run.straight not in self.outcomes:
                        continue
                    if self.cpu and self.running:
                        break  # one at a time on the CPU
                    if self.start(run):
                        waiting.remove(run)
                if self.poll():
                    self.record()
                time.sleep(0.5)
        finally:
            self.stop_all()
            signal.signal(signal.SIGTERM, previous)
        return self.outcomes

    def stop_all(self) -> None:
        """Kill every run still going, its launch's group and all the launch started."""
        parents = _process_parents()
        for process, _, _, log, started in self.running.values():
            _kill(process.pid, started | _descendants(process.pid, parents))
            process.wait()
            log.close()
        self.running.clear()

    def record(self) -> None:
        (self.work / "check_layouts.json").write_text(
            json.dumps([asdict(o) for o in self.outcomes.values()], indent=1)
        )


def judge(outcomes: dict, iterations: int, work: Path) -> None:
    """Fill each outcome's problems (an empty list: it passed)."""
    references = {
        run.precision: outcome.losses for run, outcome in outcomes.items() if run.layout == "1gpu"
    }
    for run, outcome in outcomes.items():
        problems = []
        losses = outcome.losses or {}
        if outcome.returncode is None:
            problems.append(
                f"still running {RUN_TIMEOUT_S} s after its start: killed (stacks in logs/{run.name}.log)"
            )
        elif run.kind in ENDS_WITHIN_S:
            problems += _judge_ending(run, outcome, work)
        else:
            if outcome.returncode != 0:
                problems.append(f"exit status {outcome.returncode}")
            if iterations not in losses:
                problems.append(f"no loss logged for iteration {iterations}")
            elif (
                outcome.exit_after_last_s is not None and outcome.exit_after_last_s > EXIT_WITHIN_S
            ):
                problems.append(
                    f"exited {outcome.exit_after_last_s:.0f} s after its last iteration"
                )
        if run.kind == "resumed":
            straight = outcomes.get(run.straight)
            worst = _worst(
                losses, straight and straight.losses, range(RESUME_AT + 1, iterations + 1)
            )
            if worst is None or worst > RESUME_TOLERANCE:
                problems.append(
                    f"resumed losses {_gap(worst)} off the straight run's (tolerance {RESUME_TOLERANCE:.1%})"
                )
        elif run.layout != "1gpu" and run.kind == "straight":
            reference = references.get(run.precision)
            worst = _worst(losses, reference, range(1, iterations + 1))
            if reference is None:
                problems.append(f"no one-GPU {run.precision} run finished to compare it with")
            elif worst is None or worst > TRACK_TOLERANCE:
                problems.append(
                    f"losses {_gap(worst)} off one GPU's (tolerance {TRACK_TOLERANCE:.0%})"
                )
            eager = outcomes.get(run.eager)
            if run.graphs and eager is not None:
                worst = _worst(losses, eager.losses, range(1, iterations + 1))
                if worst is None or worst > RESUME_TOLERANCE:
                    problems.append(
                        f"losses {_gap(worst)} off the eager run's (tolerance {RESUME_TOLERANCE:.1%})"
                    )
        outcome.problems = problems


def _judge_ending(run: Run, outcome: Outcome, work: Path) -> list:
    """How a signalled or failing run ended."""
    problems, limit = [], ENDS_WITHIN_S[run.kind]
    if outcome.ended_after_event_s is None:
        return [f"never reached iteration {SIGNAL_AT}"]
    if outcome.ended_after_event_s > limit:
        problems.append(
            f"ended {outcome.ended_after_event_s:.0f} s after the {run.kind} (limit {limit:.0f} s)"
        )
    log = (work / "logs" / f"{run.name}.log").read_text(errors="replace")
    if run.kind == "fail":
        if outcome.returncode == 0:
            problems.append("exit status 0 after a rank failed")
        return problems
    stopped = re.search(r"stopping at iteration (\d+) on SIGTERM", log)
    pointer = work / "runs" / run.name / "latest_checkpointed_iteration.txt"
    if stopped is None:
        problems.append("no 'stopping at iteration N on SIGTERM' in its log")
    elif not pointer.exists() or pointer.read_text().strip() != stopped.group(1):
        problems.append(f"stopped at iteration {stopped.group(1)} without its checkpoint")
    if re.search(r"\[rank\d+\]:\s*Traceback", log):
        problems.append("a rank's traceback")
    return problems


def _without_core_files() -> None:
    """A hung run's SIGABRT must not write its ranks' memory to disk."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _process_parents() -> dict:
    """{pid: parent pid} of every live process."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # it ended while being read
    return parents


def _descendants(pid: int, parents: dict | None = None) -> set:
    """The live processes started under `pid` (`parents`: _process_parents(), read once for
    several launches): torchrun starts each rank in a session of its own, beyond the reach of the
    launch's process group."""
    parents = _process_parents() if parents is None else parents
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _running(pid: int) -> bool:
    """Whether `pid` lives (a zombie, ended and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stop_hung(pgid: int, started: set, log=None) -> None:
    """A hung run: every process it started is stopped where it hangs (SIGSTOP: torchrun cannot
    tear the ranks down meanwhile), then one at a time each writes every thread's Python stack
    into the run's log (the run's PYTHONFAULTHANDLER answers SIGABRT so), whole, not interleaved
    with its peers'. With `log` (the run's log file) and cuda-gdb installed, what each rank runs
    on its GPU and where it is blocked natively go there first (`_gpu_states`). Then the launch's
    group and all it started are killed."""
    _signal(started, signal.SIGSTOP)
    if log is not None:
        _gpu_states(_ranks(started), log)
    for pid in sorted(started):
        _signal([pid], signal.SIGABRT)
        _signal([pid], signal.SIGCONT)  # the stopped process takes the SIGABRT now
        time.sleep(STACK_GAP_S)
    time.sleep(STACKS_WITHIN_S)
    _kill(pgid, started)


def _ranks(started: set) -> list:
    """The training processes among `started`: those torchrun started (not their data workers)."""
    parents = _process_parents()

    def launched_by_torchrun(pid: int) -> bool:
        try:
            command = Path(f"/proc/{parents.get(pid, 0)}/cmdline").read_bytes()
        except OSError:
            return False
        return b"torchrun" in command or b"torch.distributed.run" in command

    return sorted(pid for pid in started if launched_by_torchrun(pid))


def _gpu_states(ranks: list, log) -> None:
    """Where cuda-gdb is installed: the kernels each of `ranks` has on its GPU (`info cuda
    kernels`: one waiting for a peer stays there) and its main thread's native stack, written
    into `log` rank by rank; the debuggers attach at once, each given GPU_STATE_WITHIN_S."""
    debugger = shutil.which("cuda-gdb")
    if debugger is None or not ranks:
        return
    commands = ["info cuda kernels", "thread 1", "bt 30"]
    attached = {}  # pid -> (the debugger, the file of its answer)
    for pid in ranks:
        answer = tempfile.TemporaryFile("w+")
        debugging = subprocess.Popen(
            [debugger, "-q", "-batch", "-p", str(pid)]
            + [arg for command in commands for arg in ("-ex", command)],
            stdout=answer,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        attached[pid] = debugging, answer
    deadline = time.time() + GPU_STATE_WITHIN_S
    for pid, (debugging, answer) in attached.items():
        try:
            debugging.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            debugging.kill()
            debugging.wait()
        answer.seek(0)
        log.write(f"\n== rank process {pid}, cuda-gdb: {'; '.join(commands)}\n{answer.read()}\n")
        answer.close()
    log.flush()


def _kill(pgid: int, started: set) -> None:
    """Kill the processes `started` under a launch, then the launch's process group."""
    _signal(started, signal.SIGKILL)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _signal(pids, how) -> None:
    for pid in pids:
        try:
            os.kill(pid, how)
        except ProcessLookupError:
            pass


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _worst(losses: dict, reference: dict | None, iterations: range) -> float | None:
    """The largest relative difference of `losses` from `reference` over `iterations`; None if
    either misses one of them."""
    pairs = [(losses.get(i), (reference or {}).get(i)) for i in iterations]
    if not pairs or any(a is None or b is None for a, b in pairs):
        return None
    return max(abs(a - b) / abs(b) for a, b in pairs)


def _gap(worst) -> str:
    return "missing, so not compared" if worst is None else f"{worst:.2%}"


def table(outcomes: dict) -> str:
    lines = [
        f"{'run':34s} {'exit':>5s} {'ended s':>8s} {'tokens/s':>10s} {'loss 1 / last':>16s}  verdict",
        "(ended s: after the last iteration; for -sigterm and -fail runs, after the signal or the error)",
    ]
    for run, o in sorted(
        outcomes.items(), key=lambda item: (LAYOUTS[item[0].layout][0], item[0].name)
    ):
        losses = o.losses or {}
        first_last = f"{losses[min(losses)]:.4f} / {losses[max(losses)]:.4f}" if losses else "-"
        speed = f"{o.tokens_per_s:,.0f}" if o.tokens_per_s else "-"
        after = o.ended_after_event_s if o.kind in ENDS_WITHIN_S else o.exit_after_last_s
        after = "-" if after is None else f"{after:.1f}"
        verdict = "ok" if not o.problems else "FAIL: " + "; ".join(o.problems)
        lines.append(
            f"{o.run:34s} {str(o.returncode):>5s} {after:>8s} {speed:>10s} {first_last:>16s}  {verdict}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, help="GPUs to use (default: all torch sees)")
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=[name for name in LAYOUTS if name != "1gpu"],
        help="default: every layout of 2 GPUs, and of 4 with 4 or more",
    )
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=PRECISION_CHOICES,
        default=list(PRECISIONS),
        help="default: bf16, FP8 delayed and current (rowwise, blockwise: FP8 fine-grained scaling)",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=list(KINDS),
        help="straight: every precision and graphs off (and one GPU); resumed (needs straight); "
        "sigterm; fail (default: all)",
    )
    parser.add_argument("--share", type=int, default=2, help="runs per GPU at once (default 2)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="make every run but the one-GPU references N times, each judged on its own (for "
        "what fails only now and then; default 1)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        metavar="SECONDS",
        help="start no run after this many seconds and stop those still going; what finished is "
        "judged, the rest listed as not run (exit status 2 if nothing failed)",
    )
    parser.add_argument(
        "--without-tp-comm-overlap",
        action="store_true",
        help="layouts with tensor parallelism run without the recipe's --tp-comm-overlap",
    )
    parser.add_argument(
        "--without-distributed-optimizer",
        action="store_true",
        help="layouts with data parallelism run without the recipe's distributed optimizer "
        "(and its --overlap-param-gather)",
    )
    parser.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help="FP8 delayed runs with the distributed optimizer hold and all-gather their FP8 "
        "primary weights in FP8 (the trainer's --fp8-param-gather; not the recipe's default)",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="on the CPU with gloo (the recipe's CPU=1), no graphs"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("runs/check_layouts"),
        help="work folder: data, runs, logs, check_layouts.json (default runs/check_layouts)",
    )
    args = parser.parse_args(argv)
    if args.cpu:
        gpus = 0
    else:
        import torch

        gpus = args.gpus or torch.cuda.device_count()
        if gpus < 2:
            parser.error(
                f"needs at least 2 GPUs, torch sees {torch.cuda.device_count()}; --cpu runs it on the CPU"
            )
    capacity = gpus or 2  # on the CPU: the 2-process layouts unless asked for more
    layouts = args.layouts or [name for name, (n, *_) in LAYOUTS.items() if 2 <= n <= capacity]
    too_big = [name for name in layouts if not args.cpu and LAYOUTS[name][0] > gpus]
    if too_big:
        parser.error(
            f"{', '.join(too_big)} need{'s' if len(too_big) == 1 else ''} more than {gpus} GPUs"
        )
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give 1 or more (runs of each kind)")
    work = args.output.resolve()
    if "resumed" in args.kinds and "straight" not in args.kinds:
        parser.error(
            "--kinds resumed needs straight (a resumed run loads the straight run's checkpoint)"
        )
    runs = plan(layouts, args.precisions, graphs=not args.cpu, kinds=args.kinds, repeat=args.repeat)
    print(
        f"check_layouts: {len(runs)} runs of the shrunk GPT recipe on {gpus or 'the CPU, no'} GPUs, logs in "
        f"{work / 'logs'}",
        flush=True,
    )
    subprocess.run(
        ["bash", str(REPO / "examples" / "prepare_sample_data.sh"), str(work / "data"), "32768"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    start = time.time()
    launcher = Launcher(
        work,
        gpus,
        args.cpu,
        args.share,
        (not args.without_tp_comm_overlap, not args.without_distributed_optimizer),
        args.fp8_param_gather,
    )
    outcomes = launcher.run_all(runs, args.time_limit)
    judge(outcomes, int((CPU_SHAPE if args.cpu else GPU_SHAPE)["ITERS"]), work)
    launcher.record()
    failed = [o for o in outcomes.values() if o.problems]
    not_run = [run.name for run in runs if run not in outcomes]
    print(table(outcomes))
    print(
        f"check_layouts: {len(outcomes) - len(failed)} of {len(outcomes)} runs passed in {time.time() - start:.0f} s"
    )
    if not_run:
        print(
            f"check_layouts: incomplete: {len(not_run)} of {len(runs)} runs did not finish within "
            f"--time-limit {args.time_limit:g} s: {', '.join(not_run)}"
        )
    return 1 if failed else 2 if not_run else 0


if __name__ == "__main__":
    sys.exit(main())
