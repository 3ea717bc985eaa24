"""The gloo multi-process helper that every parallel test uses."""

import os

import pytest
import torch
import torch.distributed as dist

from .multiprocess import run_on_ranks


def all_reduce_rank(rank, world_size, base):
    t = torch.tensor([float(rank + base)])
    dist.all_reduce(t)
    return {
        "sum": t.item(),
        "threads": torch.get_num_threads(),
        "omp": os.environ["OMP_NUM_THREADS"],
    }


def raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


def die_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def test_results_come_back_by_rank_with_one_thread_each():
    results = run_on_ranks(all_reduce_rank, 3, 10)
    assert [r["sum"] for r in results] == [33.0] * 3
    assert all(r["threads"] == 1 and r["omp"] == "1" for r in results)


def test_an_exception_on_one_rank_fails_with_its_traceback():
    with pytest.raises(AssertionError, match="rank 1:(.|\\n)*rank one is broken"):
        run_on_ranks(raise_on_rank_one, 2)


def test_a_rank_that_dies_without_a_traceback_fails_fast():
    # Rank 0 may see the broken connection and fail on its own, or still wait in the barrier;
    # either way the run must stop because rank 1 died, not at the timeout.
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(die_on_rank_one, 2, timeout_s=120)
    message = str(failure.value)
    assert "rank 1 gave no result: died with exit code 3" in message
    assert "timed out" not in message


def environment_and_folder(rank, world_size, name):
    return os.environ.get(name), os.getcwd()


def test_the_ranks_see_the_launchs_environment_and_folder(monkeypatch, tmp_path):
    # The first launch starts the fork server; a variable set after it started (as a test may set
    # one) must still reach the ranks, which then start as fresh interpreters.
    run_on_ranks(all_reduce_rank, 2, 0)
    monkeypatch.chdir(tmp_path)
    assert (
        run_on_ranks(environment_and_folder, 2, "MEGAFP8_TEST_VARIABLE")
        == [(None, str(tmp_path))] * 2
    )
    monkeypatch.setenv("MEGAFP8_TEST_VARIABLE", "set")
    assert (
        run_on_ranks(environment_and_folder, 2, "MEGAFP8_TEST_VARIABLE")
        == [("set", str(tmp_path))] * 2
    )
