"""tools/plan_parallel.py: every layout checked by the trainer's own rules and the memory model;
what does not divide or fit is rejected with the reason; the plan is deterministic."""

import json

import pytest
from megafp8.models.config import preset
from megafp8.parallel.stages import balanced_stage_split

from megafp8.planner.memory import MemoryLayout, estimate
from megafp8.training.metrics import output_layer_cost

from .load import load_tool

plan_parallel = load_tool("plan_parallel")
LLAMA_7B = [
    "--model",
    "llama2-7b",
    "--gpus",
    "16",
    "--gpu-memory",
    "80",
    "--seq-length",
    "4096",
    "--global-batch-size",
    "48",
    "--micro-batch-sizes",
    "1",
    "2",
]


def test_a_plan_lists_what_fits_and_why_the_rest_does_not(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_parallel.main(LLAMA_7B + ["--fp8", "delayed", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert plan["budget_gib"] == 72.0 and plan["fits"] and "not ranked by throughput" in text
    reasons = {r["reason"] for r in plan["rejected"]}
    # The trainer's own message for a micro-batch split that does not divide the batch ...
    assert any("--global-batch-size 48 is not divisible" in r for r in reasons), reasons
    # ... and the memory that does not fit. 32 layers do split over pp 16 x vpp 4: half a layer
    # (an attention or an MLP) per virtual stage.
    assert not any("cannot be split" in r for r in reasons), reasons
    assert any(e["pp"] == 16 and e["vpp"] == 4 for e in plan["fits"] + plan["rejected"])
    assert any(
        r.startswith("needs ") and "GiB per GPU" in r and "over 72.0 GiB" in r for r in reasons
    )
    # A layout's memory is the memory model's for its fullest stage.
    entry = next(
        e
        for e in plan["fits"]
        if (
            e["tp"],
            e["pp"],
            e["vpp"],
            e["micro_batch_size"],
            e["recompute"],
            e["distributed_optimizer"],
        )
        == (2, 2, 1, 1, "selective", True)
    )
    # as the recipes split a pipeline: the output layer's rank given less work
    first, last = balanced_stage_split(
        32, 2, output_layer_cost=output_layer_cost(preset("llama2-7b"), 4096, 2, fp8_layers=True)
    )
    layout = MemoryLayout(
        seq_length=4096,
        micro_batch_size=1,
        num_micro_batches=12,
        tp=2,
        pp=2,
        dp=4,
        first_stage_layers=first,
        last_stage_layers=last,
        sequence_parallel=True,
        distributed_optimizer=True,
        recompute="selective",
        fp8="delayed",
    )
    assert (
        entry["memory_gib"]
        == max(s["total"] for s in estimate(preset("llama2-7b"), layout)) / 2**30
    )
    assert all(e["memory_gib"] <= 72.0 for e in plan["fits"])
    # Without the distributed optimizer one GPU's copy of the fp32 states alone is over budget.
    assert not any(
        e["tp"] == 1 and e["pp"] == 1 and not e["distributed_optimizer"] for e in plan["fits"]
    )


def test_heads_that_tp_does_not_divide_are_refused_with_the_trainers_message(tmp_path):
    out = tmp_path / "plan.json"
    plan_parallel.main(
        [
            "--model",
            "llama-120m",
            "--gpus",
            "8",
            "--gpu-memory",
            "80",
            "--seq-length",
            "1024",
            "--global-batch-size",
            "64",
            "--json",
            str(out),
        ]
    )
    plan = json.loads(out.read_text())
    assert {e["tp"] for e in plan["fits"]} == {1, 2, 4}  # 12 heads, 4 key/value heads
    eight = [r["reason"] for r in plan["rejected"] if r["tp"] == 8]
    assert eight and all("does not divide" in r for r in eight), eight


def test_the_plan_is_deterministic(tmp_path):
    for name in ("a", "b"):
        plan_parallel.main(LLAMA_7B + ["--json", str(tmp_path / f"{name}.json")])
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()


def test_lean_optimizer_states_fit_more(tmp_path):
    """--lean-optimizer-states plans with the trainer's lean flags: each layout's optimizer and
    gradients take the memory model's lean bytes, so more layouts fit."""
    plans = {}
    for lean in (False, True):
        out = tmp_path / f"{lean}.json"
        plan_parallel.main(
            LLAMA_7B + ["--json", str(out)] + (["--lean-optimizer-states"] if lean else [])
        )
        plans[lean] = json.loads(out.read_text())

    def key(entry):
        return tuple(
            entry[k]
            for k in ("tp", "pp", "vpp", "micro_batch_size", "recompute", "distributed_optimizer")
        )

    default_fits = {key(e): e for e in plans[False]["fits"]}
    lean_fits = {key(e): e for e in plans[True]["fits"]}
    assert set(default_fits) < set(lean_fits)
    for layout, entry in default_fits.items():
        assert lean_fits[layout]["memory_gib"] < entry["memory_gib"], layout


def test_fine_grained_recipes_are_planned_in_e4m3(tmp_path):
    """--fp8 rowwise / blockwise: the trainer accepts each layout with E4M3 (the recipes'
    format), and the memory model plans it (the fine-grained casts keep no FP8 weight history)."""
    for recipe in ("rowwise", "blockwise"):
        out = tmp_path / f"{recipe}.json"
        assert plan_parallel.main(LLAMA_7B + ["--fp8", recipe, "--json", str(out)]) == 0
        plan = json.loads(out.read_text())
        assert plan["fits"], recipe
        assert not any("--fp8-format" in r["reason"] for r in plan["rejected"]), recipe


def test_nothing_fits_says_so(capsys):
    assert plan_parallel.main(LLAMA_7B[:5] + ["1"] + LLAMA_7B[6:]) == 1  # 1 GiB GPUs
    captured = capsys.readouterr()
    assert "no layout fits" in captured.err
    assert "GiB per GPU, over 0.9 GiB" in captured.out and "not its margin" not in captured.out


def test_out_of_memory_layouts_are_summed_up_by_the_range_they_need_and_the_nearest_miss(
    tmp_path, capsys
):
    out = tmp_path / "plan.json"
    plan_parallel.main(LLAMA_7B + ["--json", str(out)])
    text = capsys.readouterr().out
    over = [e for e in json.loads(out.read_text())["rejected"] if "memory_gib" in e]
    needs = sorted(e["memory_gib"] for e in over)
    # a near miss on 80 GiB GPUs among them
    assert len(over) > 1 and needs[0] < 80 < needs[-1], needs
    nearest = min(over, key=lambda e: e["memory_gib"])
    assert (
        f"{len(over):4d} x need {needs[0]:.1f} to {needs[-1]:.1f} GiB per GPU, over 72.0 GiB  (the nearest miss: "
        f"{plan_parallel.layout_name(nearest)}, {needs[0]:.1f} GiB, within the GPU's 80 GiB but not its margin)"
    ) in text, text
    assert text.count("GiB per GPU, over") == 1  # one line for them all


def test_the_listing_is_in_the_order_it_says(tmp_path, capsys):
    """Without measurements the layouts are listed in the order the output and --help state."""
    out = tmp_path / "plan.json"
    plan_parallel.main(LLAMA_7B + ["--top", "1000", "--json", str(out)])
    text = capsys.readouterr().out
    assert f"simplest first: {plan_parallel.SIMPLEST_FIRST})" in text
    assert " ".join(plan_parallel.SIMPLEST_FIRST.split()) in " ".join(plan_parallel.__doc__.split())
    fits = json.loads(out.read_text())["fits"]
    listed = [line.strip().split("  ")[0] for line in text.splitlines() if line.startswith("  tp")]
    assert listed == [plan_parallel.layout_name(e) for e in fits]
    stated = [
        (
            e["tp"] * e["pp"],
            e["vpp"],
            ("none", "selective", "full").index(e["recompute"]),
            -e["micro_batch_size"],
            e["memory_gib"],
        )
        for e in fits
    ]
    assert stated == sorted(stated)
    # Not the micro-batch size before the recomputation, nor the memory before the micro-batch size.
    assert len({s[2] for s in stated}) == 3 and len({s[3] for s in stated}) == 2


def test_the_help_example_is_one_command(capsys):
    with pytest.raises(SystemExit) as exit:
        plan_parallel.main(["--help"])
    assert exit.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(
        i
        for i, line in enumerate(lines)
        if line.strip().startswith("python tools/plan_parallel.py")
    )
    end = lines.index("", start)
    assert end - start > 1 and all(line.endswith(" \\") for line in lines[start : end - 1]), lines[
        start:end
    ]
    assert not lines[end - 1].endswith("\\")


def _layer_map(path, tp, times, host=0.9):
    """A gpt-1.3b layer map at sequence 2048, micro-batch 4, tensor-parallel size `tp`:
    times = {recipe: (layer ms, its forward ms, output end ms)}; an eager step's host time `host`
    times the GPU's (0.9: the host keeps up)."""
    from megafp8.models.config import preset

    point = {
        "arch": "gpt",
        "hidden": 2048,
        "heads": 16,
        "kv_heads": 16,
        "ffn": 8192,
        "seq": 2048,
        "tp": tp,
        "micro_batch": 4,
        "model": "gpt-1.3b",
        "vocab": preset("gpt-1.3b").vocab_size,
    }
    for recipe, (layer, forward, head) in times.items():
        point.update(
            {
                f"{recipe}_ms": layer,
                f"{recipe}_fwd_ms": forward,
                f"{recipe}_host_ms": host * layer,
                f"head_{recipe}_ms": head,
            }
        )
    path.write_text(
        json.dumps({"device": "NVIDIA H200", "tp": tp, "copy_gbs": 4000.0, "points": [point]})
    )
    return str(path)


def test_pipeline_beats_tensor_parallelism_under_fp8(tmp_path, capsys):
    """GPT-1.3B on two GPUs with layer times shaped after the 2 x H200 runs of benchmarks/RESULTS.md
    (FP8 delayed 1.25x bf16 on whole layers; at tp 2 each rank's FP8 layer slower than its bf16
    one): the planner ranks pipeline parallelism over tensor parallelism for FP8, both for a
    quarter over it, and data parallelism first."""
    maps = [
        _layer_map(tmp_path / "tp1.json", 1, {"bf16": (5.0, 1.6, 8.0), "delayed": (4.0, 1.3, 8.0)}),
        _layer_map(tmp_path / "tp2.json", 2, {"bf16": (3.4, 1.1, 5.0), "delayed": (4.3, 1.4, 5.0)}),
    ]
    coll = tmp_path / "collectives.json"
    coll.write_text(
        json.dumps(
            {
                "device": "NVIDIA H200",
                "gpus": 2,
                "results": [
                    {
                        "op": op,
                        "group_size": 2,
                        "bytes": 2**b,
                        "ms": 1.0,
                        "algbw_gbs": 300.0,
                        "busbw_gbs": 300.0,
                    }
                    for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
                    for b in (20, 30)
                ],
            }
        )
    )
    out = tmp_path / "plan.json"
    assert (
        plan_parallel.main(
            [
                "--model",
                "gpt-1.3b",
                "--gpus",
                "2",
                "--gpu-memory",
                "141",
                "--seq-length",
                "2048",
                "--global-batch-size",
                "32",
                "--micro-batch-sizes",
                "4",
                "--fp8",
                "delayed",
                "--layer-maps",
                *maps,
                "--collectives",
                str(coll),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "ranked by predicted tokens/s per GPU" in text and "tokens/s/GPU" in text
    assert "warning" not in text  # maps and collectives of one GPU
    plan = json.loads(out.read_text())
    plain = [
        e
        for e in plan["fits"]
        if e["recompute"] == "none" and e["vpp"] == 1 and not e["distributed_optimizer"]
    ]
    order = [(e["tp"], e["pp"], e["dp"]) for e in plain]
    # data, then pipeline, then tensor parallelism
    assert order == [(1, 1, 2), (1, 2, 1), (2, 1, 1)], order
    speeds = {(e["tp"], e["pp"]): e["tokens_per_s_per_gpu"] for e in plain}
    assert speeds[(1, 2)] > 1.25 * speeds[(2, 1)]
    speeds = [e["tokens_per_s_per_gpu"] for e in plan["fits"]]
    assert speeds == sorted(speeds, reverse=True)
    # The ranking is deterministic: the same measurements give the same plan, byte for byte.
    again = tmp_path / "again.json"
    plan_parallel.main(
        [
            "--model",
            "gpt-1.3b",
            "--gpus",
            "2",
            "--gpu-memory",
            "141",
            "--seq-length",
            "2048",
            "--global-batch-size",
            "32",
            "--micro-batch-sizes",
            "4",
            "--fp8",
            "delayed",
            "--layer-maps",
            *maps,
            "--collectives",
            str(coll),
            "--json",
            str(again),
        ]
    )
    assert again.read_text() == out.read_text()
    # Virtual stages of 24 layers over 2 ranks divide; full recomputation is predicted slower.
    full = next(e for e in plan["fits"] if (e["tp"], e["pp"], e["recompute"]) == (1, 1, "full"))
    assert full["tokens_per_s_per_gpu"] < speeds[0]
    # Without a map of the recipe the layouts that fit are listed apart, with what to measure.
    assert (
        plan_parallel.main(
            [
                "--model",
                "gpt-1.3b",
                "--gpus",
                "2",
                "--gpu-memory",
                "141",
                "--seq-length",
                "2048",
                "--global-batch-size",
                "32",
                "--micro-batch-sizes",
                "4",
                "--fp8",
                "current",
                "--layer-maps",
                *maps,
                "--collectives",
                str(coll),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    plan = json.loads(out.read_text())
    assert not plan["fits"] and plan["not_predicted"]
    assert "no measured current layer" in capsys.readouterr().out
    # Collectives of another machine's GPUs: ranked all the same, with a warning that says why not to.
    coll.write_text(coll.read_text().replace("NVIDIA H200", "NVIDIA H100 80GB HBM3"))
    plan_parallel.main(
        [
            "--model",
            "gpt-1.3b",
            "--gpus",
            "2",
            "--gpu-memory",
            "141",
            "--seq-length",
            "2048",
            "--global-batch-size",
            "32",
            "--micro-batch-sizes",
            "4",
            "--fp8",
            "delayed",
            "--layer-maps",
            *maps,
            "--collectives",
            str(coll),
        ]
    )
    assert (
        "warning: the measurements come from different GPUs (NVIDIA H100 80GB HBM3, NVIDIA H200): measure "
        "the layer maps, the collectives and the runs compared with them on one machine"
    ) in capsys.readouterr().out


def test_calibration_files_are_checked(tmp_path, capsys):
    (tmp_path / "empty.json").write_text("{}")
    args = [
        "--model",
        "gpt-1.3b",
        "--gpus",
        "2",
        "--gpu-memory",
        "141",
        "--seq-length",
        "2048",
        "--global-batch-size",
        "32",
    ]
    with pytest.raises(SystemExit) as exit:
        plan_parallel.main(args + ["--layer-maps", str(tmp_path / "empty.json")])
    assert exit.value.code == 2 and "no layer-map points" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        plan_parallel.main(args + ["--collectives", str(tmp_path / "empty.json")])
    assert (
        exit.value.code == 2 and "--collectives goes with --layer-maps" in capsys.readouterr().err
    )


def test_graphed_pipelines_leave_the_eager_host_out(tmp_path):
    """With a host slower than the GPU, an eager pipeline (--eager-pipelines) waits on it; by
    default pipelines are predicted as the recipes run them, graphed (the layers' graphed GPU
    times), and layouts without a pipeline (always graphed) the same either way. FP8 at tp x pp,
    eagerly, is not predicted, with the reason."""
    maps = [
        _layer_map(tmp_path / "tp1.json", 1, {"delayed": (4.0, 1.3, 8.0)}, host=2.0),
        _layer_map(tmp_path / "tp2.json", 2, {"delayed": (2.5, 0.8, 8.0)}, host=2.0),
    ]
    coll = tmp_path / "collectives.json"
    coll.write_text(
        json.dumps(
            {
                "device": "NVIDIA H200",
                "gpus": 4,
                "results": [
                    {
                        "op": op,
                        "group_size": 2,
                        "bytes": 2**b,
                        "ms": 1.0,
                        "algbw_gbs": 300.0,
                        "busbw_gbs": 300.0,
                    }
                    for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
                    for b in (20, 30)
                ],
            }
        )
    )
    speeds, plans = {}, {}
    for eager in (False, True):
        out = tmp_path / f"plan{eager}.json"
        plan_parallel.main(
            [
                "--model",
                "gpt-1.3b",
                "--gpus",
                "4",
                "--gpu-memory",
                "141",
                "--seq-length",
                "2048",
                "--global-batch-size",
                "32",
                "--micro-batch-sizes",
                "4",
                "--fp8",
                "delayed",
                "--layer-maps",
                *maps,
                "--collectives",
                str(coll),
                "--json",
                str(out),
                *(["--eager-pipelines"] if eager else []),
            ]
        )
        plans[eager] = json.loads(out.read_text())
        speeds[eager] = {
            (e["tp"], e["pp"]): e["tokens_per_s_per_gpu"]
            for e in plans[eager]["fits"]
            if e["recompute"] == "none" and e["vpp"] == 1 and not e["distributed_optimizer"]
        }
    assert speeds[False][(1, 2)] > 1.5 * speeds[True][(1, 2)]
    assert speeds[False][(1, 1)] == speeds[True][(1, 1)]
    assert (2, 2) in speeds[False] and (2, 2) not in speeds[True]
    reasons = {(e["tp"], e["pp"]): e["reason"] for e in plans[True]["not_predicted"]}
    assert "FP8 with tensor and pipeline parallelism, run eagerly, is host-bound" in reasons[(2, 2)]
