"""Run a test body in N processes joined by a process group: gloo on the CPU (every parallel
test), or NCCL with one GPU per process (GPU tests).

    def body(rank, world_size, x):          # module level, so the children can import it
        ...
        return something_picklable

    results = run_on_ranks(body, 2, x)       # [result of rank 0, result of rank 1]

An exception on any rank fails the test with that rank's traceback. Each worker runs with one
OpenMP thread (OMP_NUM_THREADS=1), so N workers do not fight over the CI machine's cores.

The workers fork from a server process that imported torch and megafp8 once (multiprocessing's
forkserver): a fresh interpreter spends about 3 s of CPU on those imports, most of what a small
parallel test costs. The ranks start in the launch's working directory, but the server keeps
the environment it started with, so a launch whose environment differs (a variable a test set,
such as TRITON_INTERPRET, which triton reads when imported) starts fresh interpreters instead.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 300
_SERVER_PRELOAD = ["torch", "torch.distributed", "megafp8.train", "tests.multiprocess"]
_server_environment: dict | None = None  # the environment the fork server started with


def _context(environment: dict):
    """The fork server's context for a launch in `environment` (the first launch starts the
    server with it), or spawn's where it differs from the server's."""
    global _server_environment
    if _server_environment is None:
        _server_environment = environment
        mp.set_forkserver_preload(_SERVER_PRELOAD)
    return mp.get_context("forkserver" if environment == _server_environment else "spawn")


def _worker(rank, world_size, store_path, results, fn, args, backend):
    torch.set_num_threads(1)
    # A spawned process makes "spawn" its own default start method, so the trainer's DataLoader
    # workers would each import the test module and torch again (about 4 s each, per run). A
    # torchrun rank, a plain process, has the platform's default (fork on Linux): restore that.
    multiprocessing.set_start_method(None, force=True)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        # Every rank connected before any body runs: a rank whose body needs no peer could
        # otherwise end, closing its sockets, while another is still in gloo's connectFullMesh,
        # which then fails ("Connection closed by peer"; seen on a loaded machine).
        dist.barrier()
        try:
            # As bytes: a tensor put on the queue as it is travels through shared memory that
            # disappears when this process exits, possibly before the parent reads it.
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buffer)
            results.put((rank, True, buffer.getvalue()))
        finally:
            if dist.is_initialized():  # the body may have replaced it, or failed to
                dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(
    fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gloo"
) -> list:
    """Call `fn(rank, world_size, *args)` on `world_size` ranks; return their results by rank.

    `backend="nccl"` runs rank r on GPU r (for GPU tests; needs world_size GPUs)."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children before torch starts there
    # (pytest names the running test in the environment: not a difference that matters)
    context = _context({k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"})
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            workers = [
                context.Process(
                    target=_worker,
                    args=(rank, world_size, os.path.join(tmp, "store"), results, fn, args, backend),
                )
                for rank in range(world_size)
            ]
            for worker in workers:
                worker.start()
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        outcomes = {}
        stopped_because = f"timed out after {timeout_s}s"
        deadline = time.monotonic() + timeout_s
        try:
            while len(outcomes) < world_size and time.monotonic() < deadline:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    # A worker that died without reporting (segfault, OOM kill) fails the test
                    # now, not at the timeout; the others may be waiting on it in a collective.
                    dead = [
                        r
                        for r, w in enumerate(workers)
                        if r not in outcomes and w.exitcode not in (None, 0)
                    ]
                    if dead:
                        stopped_because = f"rank {dead[0]} died"
                        break
                    continue
                outcomes[rank] = (ok, value)
                if not ok:
                    stopped_because = f"rank {rank} failed"
                    break
        finally:
            # A rank in the middle of exiting gets a moment to finish, and the codes are read
            # before the rest are killed: a rank stopped here must not look like one that died.
            join_until = time.monotonic() + (30.0 if len(outcomes) == world_size else 1.0)
            for worker in workers:
                worker.join(timeout=max(0.0, join_until - time.monotonic()))
            exit_codes = [w.exitcode for w in workers]
            for worker in workers:
                if worker.is_alive():
                    worker.kill()
    problems = [
        f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok
    ]
    for rank in sorted(set(range(world_size)) - set(outcomes)):
        if exit_codes[rank] is None:
            problems.append(
                f"rank {rank} gave no result: still running when stopped ({stopped_because})"
            )
        else:
            problems.append(f"rank {rank} gave no result: died with exit code {exit_codes[rank]}")
    if problems:
        raise AssertionError("a distributed test body failed\n" + "\n".join(problems))
    return [
        torch.load(io.BytesIO(outcomes[rank][1]), weights_only=False) for rank in range(world_size)
    ]
