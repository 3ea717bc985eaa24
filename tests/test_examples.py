"""The example scripts as a user runs them: the quickstart run again in the same folder resumes
(one metrics file, one run); a GPU recipe on a machine without a GPU stops at once and says why."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(script, **env):
    # `python` and `torchrun` in the scripts must be this interpreter's (the one with megafp8 installed).
    env = {**os.environ, **env, "OMP_NUM_THREADS": "1",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    return subprocess.run(["bash", str(EXAMPLES / script)], env=env, capture_output=True, text=True)


def quickstart(workdir, iterations):
    done = example("quickstart.sh", WORKDIR=str(workdir), ITERS=str(iterations))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_running_the_quickstart_again_resumes_it(tmp_path):
    first = quickstart(tmp_path, 3)
    assert "starting from scratch" in first and "run summary:" in first
    assert "nothing to do: the checkpoint is at iteration 3" in quickstart(tmp_path, 3)
    more = quickstart(tmp_path, 5)
    assert "loaded" in more and "at iteration 3" in more
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text() == "5"
    records = [json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "loss" in r] == [3, 5]  # one run, not two
    assert not list(checkpoints.glob("metrics.*.jsonl"))  # nothing was moved aside: it is the same run


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
@pytest.mark.parametrize("recipe,model", [("pretrain_gpt_1b_fp8.sh", "gpt-1.3b"),
                                          ("pretrain_llama2_7b_fp8.sh", "llama2-7b")])
def test_a_gpu_recipe_without_a_gpu_stops_at_once_and_says_what_to_do(tmp_path, recipe, model):
    done = example(recipe, WORKDIR=str(tmp_path / "run"))
    assert done.returncode == 1
    assert f"{model} needs NVIDIA GPUs" in done.stderr and "quickstart.sh" in done.stderr and "CPU=1" in done.stderr
    assert not (tmp_path / "run").exists()  # before preparing any data
