"""tools/plan_parallel.py: every layout checked by the trainer's own rules and the memory model;
what does not divide or fit is rejected with the reason; the plan is deterministic."""
import json

from megafp8.models.config import preset
from megafp8.training.memory_model import MemoryLayout, estimate

from .load import load_tool

plan_parallel = load_tool("plan_parallel")
LLAMA_7B = ["--model", "llama2-7b", "--gpus", "16", "--gpu-memory", "80", "--seq-length", "4096",
            "--global-batch-size", "48", "--micro-batch-sizes", "1", "2"]


def test_a_plan_lists_what_fits_and_why_the_rest_does_not(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_parallel.main(LLAMA_7B + ["--fp8", "delayed", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert plan["budget_gib"] == 72.0 and plan["fits"] and "not ranked by throughput" in text
    reasons = {r["reason"] for r in plan["rejected"]}
    # The trainer's own message for a micro-batch split that does not divide the batch ...
    assert any("--global-batch-size 48 is not divisible" in r for r in reasons), reasons
    # ... for layers that do not split into the stages, and the memory that does not fit.
    assert any(r.startswith("32 layers do not split into 16 pipeline stages x 4 virtual stages") for r in reasons)
    assert any(r.startswith("needs ") and "GiB per GPU" in r and "over 72.0 GiB" in r for r in reasons)
    # A layout's memory is the memory model's for its fullest stage.
    entry = next(e for e in plan["fits"] if (e["tp"], e["pp"], e["vpp"], e["micro_batch_size"], e["recompute"],
                                             e["distributed_optimizer"]) == (2, 2, 1, 1, "selective", True))
    layout = MemoryLayout(seq_length=4096, micro_batch_size=1, num_micro_batches=12, tp=2, pp=2, dp=4,
                          sequence_parallel=True, distributed_optimizer=True, recompute="selective", fp8="delayed")
    assert entry["memory_gib"] == max(s["total"] for s in estimate(preset("llama2-7b"), layout)) / 2**30
    assert all(e["memory_gib"] <= 72.0 for e in plan["fits"])
    # Without the distributed optimizer one GPU's copy of the fp32 states alone is over budget.
    assert not any(e["tp"] == 1 and e["pp"] == 1 and not e["distributed_optimizer"] for e in plan["fits"])


def test_heads_that_tp_does_not_divide_are_refused_with_the_trainers_message(tmp_path):
    out = tmp_path / "plan.json"
    plan_parallel.main(["--model", "llama-120m", "--gpus", "8", "--gpu-memory", "80", "--seq-length", "1024",
                        "--global-batch-size", "64", "--json", str(out)])
    plan = json.loads(out.read_text())
    assert {e["tp"] for e in plan["fits"]} == {1, 2, 4}  # 12 heads, 4 key/value heads
    eight = [r["reason"] for r in plan["rejected"] if r["tp"] == 8]
    assert eight and all("does not divide" in r for r in eight), eight


def test_the_plan_is_deterministic(tmp_path):
    for name in ("a", "b"):
        plan_parallel.main(LLAMA_7B + ["--json", str(tmp_path / f"{name}.json")])
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()


def test_nothing_fits_says_so(capsys):
    assert plan_parallel.main(LLAMA_7B[:5] + ["1"] + LLAMA_7B[6:]) == 1  # 1 GiB GPUs
    assert "no layout fits" in capsys.readouterr().err
