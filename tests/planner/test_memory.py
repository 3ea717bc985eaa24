"""megafp8.planner.memory against what the trainer holds on the CPU: parameters, gradient
buffer, optimizer states and FP8 weight casts exactly, per rank of tensor/pipeline/data-parallel
layouts; activations (what autograd saves in a forward) within 10%."""
import pytest
import torch

from megafp8.fp8 import CurrentScaling, DelayedScaling, Fp8Linear, fp8_autocast
from megafp8.models.config import gpt_config, llama_config
from megafp8.models.transformer import TransformerLM
from megafp8.planner.memory import MemoryLayout, estimate, micro_batches_in_flight, static_bytes
from megafp8.training.trainer import pretrain

from ..multiprocess import run_on_ranks

RECIPES = {None: None, "delayed": DelayedScaling, "current": CurrentScaling}
GPT = gpt_config(2, 256, 4, vocab_size=1000, max_position_embeddings=128)
LLAMA = llama_config(2, 256, 4, 2, 512, vocab_size=1000, max_position_embeddings=128)


def weight_cast_storages(model):
    # Fp8Linear's cached cast of its weight (both layouts): static memory, not an activation.
    storages = set()
    for module in model.modules():
        if isinstance(module, Fp8Linear) and module._weight_fp8 is not None:
            for t in (module._weight_fp8[1].data, module._weight_fp8[1].data_t):
                if t is not None:
                    storages.add(t.untyped_storage()._cdata)
    return storages


def saved_bytes(model, recipe, inputs, labels, tp_group=None):
    """Bytes of the distinct storages autograd saves in one forward (with the loss), parameters,
    buffers and weight casts left out. The saved tensors are held, so no storage is reused."""
    held = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
        with fp8_autocast(enabled=recipe is not None, recipe=RECIPES[recipe]() if recipe else None,
                          amax_reduction_group=tp_group):
            model(inputs, labels)
    static = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    static |= weight_cast_storages(model)
    seen = {}
    for t in held:
        storage = t.untyped_storage()
        if storage._cdata not in static:
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activations_within_ten_percent(config, recipe, recompute):
    seq, batch = 64, 2
    torch.manual_seed(0)
    model = TransformerLM(config, dtype=torch.bfloat16, device="cpu", recompute=recompute)
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    measured = saved_bytes(model, recipe, tokens, torch.randint(0, config.vocab_size, (batch, seq)))
    layout = MemoryLayout(seq_length=seq, micro_batch_size=batch, fp8=recipe, recompute=recompute,
                          norm_on_cuda=False)
    predicted = estimate(config, layout)[0]["activations"]
    assert abs(predicted / measured - 1) < 0.10, (predicted, measured)


def test_micro_batches_in_flight_follow_the_schedules():
    # What parallel/schedules.py keeps (tests/parallel/test_pipeline.py measures it), per rank of pp 4.
    for rank in range(4):
        layout = MemoryLayout(seq_length=8, pp=4, num_micro_batches=8)
        assert micro_batches_in_flight(layout, rank) == 4 - rank
        assert micro_batches_in_flight(MemoryLayout(seq_length=8, pp=4, num_micro_batches=2), rank) == min(4 - rank, 2)
        interleaved = MemoryLayout(seq_length=8, pp=4, vpp=2, num_micro_batches=8)
        assert micro_batches_in_flight(interleaved, rank) == ((4 - rank - 1) * 2 + 4 + 1) / 2
        assert micro_batches_in_flight(MemoryLayout(seq_length=8, pp=4, vpp=2, num_micro_batches=4), rank) == 4
    assert micro_batches_in_flight(MemoryLayout(seq_length=8, num_micro_batches=16), 0) == 1


def trainer_bytes(trainer):
    """What a trainer holds, by kind, on this rank."""
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    gradients = trainer.buffer.data.numel() * trainer.buffer.data.element_size()
    optimizer = 0
    for *_, master in trainer.optimizer.shards:
        state = trainer.optimizer.optimizer.state[master]
        optimizer += sum(t.numel() * t.element_size() for t in (master, state["exp_avg"], state["exp_avg_sq"]))
    for gathered in getattr(trainer.optimizer, "_gather_inputs", {}).values():
        optimizer += gathered.numel() * gathered.element_size()
    casts = 0
    for module in trainer.model.modules():
        if isinstance(module, Fp8Linear) and module._weight_fp8 is not None:
            q = module._weight_fp8[1]
            casts += sum(t.numel() for t in (q.data, q.data_t) if t is not None)
    return {"parameters": params, "gradients": gradients, "optimizer": optimizer, "fp8_weight_casts": casts}


LAYOUTS = {  # name: (flags, MemoryLayout fields)
    "tp2-pp2-fp8": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                     "--sequence-parallel", "--fp8-format", "hybrid"],
                    dict(tp=2, pp=2, sequence_parallel=True, fp8="delayed")),
    "pp2-dp2-vpp2-distributed": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                                  "--use-distributed-optimizer"],
                                 dict(pp=2, dp=2, vpp=2, distributed_optimizer=True)),
}
BASE = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1",
        "--lr", "1e-3", "--lr-warmup-iters", "0", "--mock-data", "--bf16", "--seed", "3", "--log-interval", "1"]


def layouts_body(rank, world_size, model):
    out = {}
    for name, (flags, _) in LAYOUTS.items():
        trainer = pretrain(["--model", model, "--num-layers", "4", *BASE, *flags])
        out[name] = (trainer.groups.pp_rank, trainer_bytes(trainer), trainer.config)
    return out


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_static_memory_is_exact_on_every_rank(model):
    results = run_on_ranks(layouts_body, 4, model)
    for name, (_, fields) in LAYOUTS.items():
        for rank_result in results:
            pp_rank, measured, config = rank_result[name]
            layout = MemoryLayout(seq_length=32, micro_batch_size=2, num_micro_batches=4 // fields.get("dp", 1),
                                  **fields)
            predicted = static_bytes(config, layout, pp_rank)
            assert predicted["parameters"] == measured["parameters"], (name, pp_rank)
            assert predicted["fp8_weight_casts"] == measured["fp8_weight_casts"], (name, pp_rank)
            # The distributed optimizer pads each bucket to a multiple of dp: under dp elements a bucket.
            slack = 4 * 4 * fields.get("dp", 1) if fields.get("distributed_optimizer") else 0
            assert 0 <= measured["gradients"] - predicted["gradients"] <= slack, (name, pp_rank)
            assert 0 <= measured["optimizer"] - predicted["optimizer"] <= 14 * slack / 4, (name, pp_rank)


def tp2_activations_body(rank, world_size):
    import torch.distributed as dist

    out = {}
    for name, config in (("gpt", GPT), ("llama", LLAMA)):
        for recipe in (None, "delayed", "current"):
            for sp in (False, True):
                torch.manual_seed(0)
                model = TransformerLM(config, tp_group=dist.group.WORLD, sequence_parallel=sp, dtype=torch.bfloat16,
                                      device="cpu")
                tokens = torch.randint(0, config.vocab_size, (2, 64))
                out[(name, recipe, sp)] = saved_bytes(model, recipe, tokens, tokens, tp_group=dist.group.WORLD)
    return out


def test_tensor_parallel_activations_within_ten_percent():
    measured = run_on_ranks(tp2_activations_body, 2)[0]
    for (name, recipe, sp), value in measured.items():
        layout = MemoryLayout(seq_length=64, micro_batch_size=2, tp=2, sequence_parallel=sp, fp8=recipe,
                              norm_on_cuda=False)
        predicted = estimate({"gpt": GPT, "llama": LLAMA}[name], layout)[0]["activations"]
        assert abs(predicted / value - 1) < 0.10, (name, recipe, sp, predicted, value)


def test_against_the_peaks_measured_on_eight_gpus(capsys):
    """benchmarks/validate_planner.py over the records of RESULTS.md's eight-GPU layouts
    (8 x H200, 2026-11-22): every run within 10% of its measured peak."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "validate_planner.py"
    spec = importlib.util.spec_from_file_location("validate_planner", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| gpt") or
            line.startswith("| llama")]
    assert len(rows) == 9  # GPT-1.3B in six layouts, Llama-2-7B in three
    errors = [float(row.split("|")[6].strip().rstrip("%")) for row in rows]
    assert max(map(abs, errors)) < 10, rows
    assert tool.main(["/nonexistent"]) == 2
