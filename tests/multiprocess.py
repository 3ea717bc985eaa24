"""Run a test body in N processes joined by a process group: gloo on the CPU (every parallel
test), or NCCL with one GPU per process (GPU tests).

    def body(rank, world_size, x):          # module level, so the children can import it
        ...
        return something_picklable

    results = run_on_ranks(body, 2, x)       # [result of rank 0, result of rank 1]

An exception on any rank fails the test with that rank's traceback. Each worker runs with one
OpenMP thread (OMP_NUM_THREADS=1), so N workers do not fight over the CI machine's cores.
"""
from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 300


def _worker(rank, world_size, store_path, results, fn, args, backend):
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
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


def run_on_ranks(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gloo") -> list:
    """Call `fn(rank, world_size, *args)` on `world_size` ranks; return their results by rank.

    `backend="nccl"` runs rank r on GPU r (for GPU tests; needs world_size GPUs)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children before torch starts there
    with tempfile.TemporaryDirectory() as tmp:
        try:
            workers = [
                context.Process(target=_worker, args=(rank, world_size, os.path.join(tmp, "store"), results, fn, args, backend))
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
        deadline = time.monotonic() + timeout_s
        try:
            while len(outcomes) < world_size and time.monotonic() < deadline:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    # A worker that died without reporting (segfault, OOM kill) fails the test
                    # now, not at the timeout; the others may be waiting on it in a collective.
                    if any(w.exitcode not in (None, 0) for w in workers):
                        break
                    continue
                outcomes[rank] = (ok, value)
                if not ok:
                    break
        finally:
            for worker in workers:
                worker.join(timeout=0 if len(outcomes) < world_size else 30)
                if worker.is_alive():
                    worker.kill()
    problems = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
    missing = sorted(set(range(world_size)) - set(outcomes))
    if missing:
        codes = {rank: workers[rank].exitcode for rank in missing}
        problems.append(f"ranks {missing} gave no result (exit codes {codes}; None: still running "
                        f"when stopped, after {timeout_s}s at most)")
    if problems:
        raise AssertionError("a distributed test body failed\n" + "\n".join(problems))
    return [torch.load(io.BytesIO(outcomes[rank][1]), weights_only=False) for rank in range(world_size)]
