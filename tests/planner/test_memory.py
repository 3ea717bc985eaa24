"""megafp8.planner.memory against what the trainer holds on the CPU: parameters, gradient
buffer, optimizer states and FP8 weight casts exactly, per rank of tensor/pipeline/data-parallel
layouts; activations (what autograd saves in a forward) within 1%, and a layer's by what keeps
them (the model's roles)."""

import pytest
import torch
import torch.nn.functional as F
from megafp8.models import transformer
from megafp8.models.config import gpt_config, llama_config
from megafp8.models.transformer import TransformerLayer, TransformerLM

from megafp8.fp8 import (
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    Fp8Linear,
    Fp8Tensor,
    RowwiseScaling,
    fp8_autocast,
)
from megafp8.planner.memory import (
    MemoryLayout,
    estimate,
    layer_activation_roles,
    micro_batches_in_flight,
    rank_parameters,
    static_bytes,
)
from megafp8.planner.throughput import weight_cast_bytes
from megafp8.training.flags import LEAN_OPTIMIZER_STATES
from megafp8.training.trainer import pretrain

from ..multiprocess import run_on_ranks

RECIPES = {
    None: None,
    "delayed": DelayedScaling,
    "current": CurrentScaling,
    "rowwise": RowwiseScaling,
    "blockwise": BlockwiseScaling,
}
GPT = gpt_config(2, 256, 4, vocab_size=1000, max_position_embeddings=128)
LLAMA = llama_config(2, 256, 4, 2, 512, vocab_size=1000, max_position_embeddings=128)


def weight_cast_storages(model):
    # Fp8Linear's cached cast of its weight (both layouts): static memory, not an activation.
    storages = set()
    for module in model.modules():
        if isinstance(module, Fp8Linear) and module._weight_fp8 is not None:
            cast = module._weight_fp8[1]
            # a tensorwise cast's two layouts, or a rowwise cast's (each with its scales)
            tensors = (
                (cast.data, cast.data_t)
                if isinstance(cast, Fp8Tensor)
                else (*cast.rows, *cast.columns)
            )
            for t in tensors:
                if t is not None:
                    storages.add(t.untyped_storage()._cdata)
    return storages


def saved_bytes(model, recipe, inputs, labels, tp_group=None):
    """Bytes of the distinct storages autograd saves in one forward (with the loss), parameters,
    buffers and weight casts left out. The saved tensors are held, so no storage is reused."""
    held = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
        with fp8_autocast(
            enabled=recipe is not None,
            recipe=RECIPES[recipe]() if recipe else None,
            amax_reduction_group=tp_group,
        ):
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
@pytest.mark.parametrize("recipe", [None, "delayed", "current", "rowwise", "blockwise"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activations_within_one_percent(config, recipe, recompute):
    seq, batch = 64, 2
    torch.manual_seed(0)
    model = TransformerLM(config, dtype=torch.bfloat16, device="cpu", recompute=recompute)
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    measured = saved_bytes(model, recipe, tokens, torch.randint(0, config.vocab_size, (batch, seq)))
    layout = MemoryLayout(
        seq_length=seq, micro_batch_size=batch, fp8=recipe, recompute=recompute, norm_on_cuda=False
    )
    predicted = estimate(config, layout)[0]["activations"]
    assert abs(predicted / measured - 1) < 0.01, (predicted, measured)


LINEARS = ("qkv", "proj", "fc1", "fc2")


def saved_bytes_by_role(model, recipe, tokens, monkeypatch):
    """Bytes of the distinct storages autograd saves in one forward inside the transformer layers,
    by the memory model's role (layer_activation_roles), told from where each storage was made:
    a norm's input or what a norm saves ("norms"; a fused norm's fp32 statistics, saved by its
    linear, too); a linear's input, or any FP8 copy ("linear_inputs"); QKV's output ("qkv"); RoPE's
    ("rotated_qk"); the attention core's ("attention_output") and what else it saves
    ("log_sum_exp"); fc1's output ("activation_input"); what else fc2 saves with the activation
    ("silu_gate"). The casts' 4-byte scales are left out, as the model leaves them."""
    made, saves, inside = {}, [], []

    def mark(tensor, role):
        # The first role a storage takes; held, so that no later tensor reuses its address.
        storage = tensor.untyped_storage()
        made.setdefault(storage._cdata, (role, storage))

    def enter(name):
        return lambda module, args: inside.append(name)

    def leave(module, args, output):
        inside.pop()

    for layer in (m for m in model.modules() if isinstance(m, TransformerLayer)):
        layer.register_forward_pre_hook(enter("layer"))
        layer.register_forward_hook(leave)
        for norm in (layer.input_norm, layer.mlp_norm):
            norm.register_forward_pre_hook(enter("norm"))
            norm.register_forward_hook(leave)
        for block in (layer.attention, layer.mlp):  # their input is their norm's
            block.register_forward_pre_hook(lambda module, args: mark(args[0], "norms"))
        linears = dict(
            zip(LINEARS, (layer.attention.qkv, layer.attention.proj, layer.mlp.fc1, layer.mlp.fc2))
        )
        for name, linear in linears.items():
            linear.register_forward_pre_hook(enter(name))
            linear.register_forward_hook(leave)
        linears["qkv"].register_forward_hook(lambda module, args, y: mark(y, "qkv"))
        linears["fc1"].register_forward_hook(lambda module, args, y: mark(y, "activation_input"))

    def marking(function, role, mark_input=False):
        def wrapped(*args, **kwargs):
            out = function(*args, **kwargs)
            mark(args[1] if mark_input else out, role)
            return out

        return wrapped

    def attention_core(*args, **kwargs):
        inside.append("core")
        out = sdpa(*args, **kwargs)
        inside.pop()
        mark(out, "attention_output")
        return out

    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", attention_core)
    monkeypatch.setattr(
        transformer, "apply_rotary", marking(transformer.apply_rotary, "rotated_qk")
    )
    for method in ("high_precision_linear", "fp8_linear"):
        monkeypatch.setattr(
            Fp8Linear, method, marking(getattr(Fp8Linear, method), "linear_inputs", mark_input=True)
        )

    def pack(t):
        if inside:
            saves.append((t.untyped_storage(), t.dtype, t.dim(), inside[-1]))
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        fp8_autocast(enabled=recipe is not None, recipe=RECIPES[recipe]() if recipe else None),
    ):
        model(tokens, tokens)
    static = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    static |= weight_cast_storages(model)
    roles, seen = {}, set()
    for storage, dtype, dim, where in saves:
        if storage._cdata in static | seen or dim == 0:
            continue
        seen.add(storage._cdata)
        role, _ = made.get(storage._cdata, (None, None))
        if role is None:
            if dtype.itemsize == 1 and dtype.is_floating_point:
                role = "linear_inputs"  # an FP8 copy
            elif where == "norm" or (where in LINEARS and dtype == torch.float32):
                role = "norms"
            else:
                role = {"core": "log_sum_exp", "fc2": "silu_gate"}.get(
                    where, f"unknown, saved in {where}"
                )
        roles[role] = roles.get(role, 0) + storage.nbytes()
    return roles


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_each_role_of_a_layers_activations(config, recipe, recompute, monkeypatch):
    """What the model counts for each thing a layer keeps for backward (the rotated q and k, the
    log-sum-exp, ...) is what autograd saves for it, within 1% (the CPU's LayerNorm keeps its
    statistics in bf16, 4 bytes a token less than CUDA's fp32)."""
    seq, batch = 64, 2
    torch.manual_seed(0)
    model = TransformerLM(config, dtype=torch.bfloat16, device="cpu", recompute=recompute)
    measured = saved_bytes_by_role(
        model, recipe, torch.randint(0, config.vocab_size, (batch, seq)), monkeypatch
    )
    layout = MemoryLayout(
        seq_length=seq, micro_batch_size=batch, fp8=recipe, recompute=recompute, norm_on_cuda=False
    )
    predicted = {
        role: config.num_layers * value
        for role, value in layer_activation_roles(config, layout).items()
    }
    assert set(measured) <= set(predicted), measured
    for role, value in predicted.items():
        assert abs(measured.get(role, 0) - value) <= 0.01 * value, (role, measured, predicted)


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("recipe", [None, "delayed"])
def test_stages_that_end_inside_a_layer(config, recipe):
    """Two stages cut after layer 1's attention: each holds the activations of the parts it runs
    (the first its attention, the last its MLP, and the logits), within 1%."""
    seq, batch = 64, 2
    layout = MemoryLayout(
        seq_length=seq,
        micro_batch_size=batch,
        pp=2,
        fp8=recipe,
        first_stage_layers=1.5,
        norm_on_cuda=False,
    )
    predicted = [stage["activations"] for stage in estimate(config, layout)]
    torch.manual_seed(0)
    first = TransformerLM(config, layers=(0, 1.5), dtype=torch.bfloat16, device="cpu")
    last = TransformerLM(config, layers=(1.5, 2), dtype=torch.bfloat16, device="cpu")
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    hidden = torch.randn(seq, batch, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    measured = [saved_bytes(first, recipe, tokens, None), saved_bytes(last, recipe, hidden, tokens)]
    assert micro_batches_in_flight(layout, 0) == 1  # one micro-batch a step
    for stage in range(2):
        assert abs(predicted[stage] / measured[stage] - 1) < 0.01, (stage, predicted, measured)


def test_micro_batches_in_flight_follow_the_schedules():
    # What parallel/schedules.py keeps (tests/parallel/test_pipeline.py measures it), per rank of pp 4.
    for rank in range(4):
        layout = MemoryLayout(seq_length=8, pp=4, num_micro_batches=8)
        assert micro_batches_in_flight(layout, rank) == 4 - rank
        assert micro_batches_in_flight(
            MemoryLayout(seq_length=8, pp=4, num_micro_batches=2), rank
        ) == min(4 - rank, 2)
        interleaved = MemoryLayout(seq_length=8, pp=4, vpp=2, num_micro_batches=8)
        assert micro_batches_in_flight(interleaved, rank) == ((4 - rank - 1) * 2 + 4 + 1) / 2
        assert (
            micro_batches_in_flight(
                MemoryLayout(seq_length=8, pp=4, vpp=2, num_micro_batches=4), rank
            )
            == 4
        )
    assert micro_batches_in_flight(MemoryLayout(seq_length=8, num_micro_batches=16), 0) == 1


def trainer_bytes(trainer):
    """What a trainer holds, by kind, on this rank."""
    # an FP8 primary weight's bytes are its cast's
    params = sum(
        p.numel() * p.element_size()
        for p in trainer.model.parameters()
        if p.dtype != torch.float8_e4m3fn
    )
    gradients = trainer.buffer.data.numel() * trainer.buffer.data.element_size()
    optimizer = 0
    for *_, master in trainer.optimizer.shards:
        state = trainer.optimizer.state[master]
        # the moments (and an FP8 one's block scales); the step counts are one small tensor
        kept = [t for key, t in state.items() if key != "step"]
        optimizer += sum(t.numel() * t.element_size() for t in (master, *kept))
    for gathered in getattr(trainer.optimizer, "_gather_inputs", {}).values():
        optimizer += gathered.numel() * gathered.element_size()
    casts = 0
    for module in trainer.model.modules():
        if isinstance(module, Fp8Linear) and module._weight_fp8 is not None:
            q = module._weight_fp8[1]
            casts += sum(t.numel() for t in (q.data, q.data_t) if t is not None)
    return {
        "parameters": params,
        "gradients": gradients,
        "optimizer": optimizer,
        "fp8_weight_casts": casts,
    }


LAYOUTS = {  # name: (flags, MemoryLayout fields)
    # the stages end half-way into layer 2: its attention on the first, its MLP on the last
    "tp2-pp2-fp8-half-layer": (
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--fp8-format",
            "hybrid",
            "--decoder-last-pipeline-num-layers",
            "1.5",
        ],
        dict(
            tp=2,
            pp=2,
            sequence_parallel=True,
            fp8="delayed",
            last_stage_layers=1.5,
            fp8_primary_weights=True,
        ),
    ),
    "tp2-pp2-fp8-bf16-weights": (
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--fp8-format",
            "hybrid",
            "--no-fp8-primary-weights",
        ],
        dict(tp=2, pp=2, fp8="delayed"),
    ),
    "pp2-dp2-vpp2-distributed": (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--use-distributed-optimizer",
        ],
        dict(pp=2, dp=2, vpp=2, distributed_optimizer=True),
    ),
    "pp2-dp2-fp8-param-gather": (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
            "--fp8-format",
            "hybrid",
            "--fp8-param-gather",
        ],
        dict(pp=2, dp=2, distributed_optimizer=True, fp8="delayed", fp8_primary_weights=True),
    ),
}
BASE = [
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "1",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "0",
    "--mock-data",
    "--bf16",
    "--seed",
    "3",
    "--log-interval",
    "1",
]


MODELS = ("gpt-tiny", "llama-tiny")


def layouts_body(rank, world_size):
    out = {}
    for model in MODELS:
        for name, (flags, _) in LAYOUTS.items():
            trainer = pretrain(["--model", model, "--num-layers", "4", *BASE, *flags])
            out[model, name] = (trainer.groups.pp_rank, trainer_bytes(trainer), trainer.config)
    return out


@pytest.fixture(scope="module")
def layout_bytes():
    """Each rank's {(model, layout): (pp rank, bytes held, config)}, every run in one launch."""
    return run_on_ranks(layouts_body, 4)


def lean_body(rank, world_size):
    out = {}
    for exp_avg in ("bf16", "fp8"):
        flags = [*LEAN_OPTIMIZER_STATES, "--exp-avg-dtype", exp_avg, "--use-distributed-optimizer"]
        trainer = pretrain(["--model", "gpt-tiny", *BASE, *flags])
        out[exp_avg] = trainer_bytes(trainer), trainer.config, len(trainer.optimizer.shards)
    return out


def test_static_memory_with_lean_optimizer_states(monkeypatch):
    """Every lean state, the first moment in bf16 or FP8, with the distributed optimizer over two
    ranks (in Triton's interpreter: the fused pass keeps them): what the model says the gradients
    and the optimizer hold."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for runs in run_on_ranks(lean_body, 2):
        for exp_avg, (measured, config, shards) in runs.items():
            layout = MemoryLayout(
                seq_length=32,
                micro_batch_size=2,
                num_micro_batches=2,
                dp=2,
                distributed_optimizer=True,
                exp_avg_dtype=exp_avg,
                exp_avg_sq_dtype="bf16",
                main_grads_dtype="bf16",
                store_param_remainders=True,
            )
            predicted = static_bytes(config, layout, 0)
            # Buckets padded to a multiple of dp, as in test_static_memory_is_exact_on_every_rank:
            # 2 bytes a gradient, 8 an owned element (remainder, moments, the gather's input);
            # an FP8 moment's last scale of each shard covers a partial block.
            slack = 2 * 4 * 2
            blocks = 4 * shards if exp_avg == "fp8" else 0
            assert 0 <= measured["gradients"] - predicted["gradients"] <= slack, exp_avg
            assert 0 <= measured["optimizer"] - predicted["optimizer"] <= 8 * slack / 2 + blocks
            # the default states: 14 bytes an owned element (12 + the gather's input) against 8
            # (bf16 first moment) or 7 and a 32nd (FP8)
            default = static_bytes(
                config, MemoryLayout(seq_length=32, dp=2, distributed_optimizer=True), 0
            )
            lean_bytes = 8 if exp_avg == "bf16" else 7 + 1 / 32
            assert default["optimizer"] / predicted["optimizer"] == pytest.approx(14 / lean_bytes)
            assert default["gradients"] / predicted["gradients"] == 2


@pytest.mark.parametrize("model", MODELS)
def test_static_memory_is_exact_on_every_rank(layout_bytes, model):
    results = [{name: r[model, name] for name in LAYOUTS} for r in layout_bytes]
    for name, (_, fields) in LAYOUTS.items():
        for rank_result in results:
            pp_rank, measured, config = rank_result[name]
            layout = MemoryLayout(
                seq_length=32,
                micro_batch_size=2,
                num_micro_batches=4 // fields.get("dp", 1),
                **fields,
            )
            predicted = static_bytes(config, layout, pp_rank)
            assert predicted["parameters"] == measured["parameters"], (name, pp_rank)
            assert predicted["fp8_weight_casts"] == measured["fp8_weight_casts"], (name, pp_rank)
            # The distributed optimizer pads each bucket to a multiple of dp: under dp elements a bucket.
            slack = 4 * 4 * fields.get("dp", 1) if fields.get("distributed_optimizer") else 0
            assert 0 <= measured["gradients"] - predicted["gradients"] <= slack, (name, pp_rank)
            assert 0 <= measured["optimizer"] - predicted["optimizer"] <= 14 * slack / 4, (
                name,
                pp_rank,
            )


def tp2_activations_body(rank, world_size):
    import torch.distributed as dist

    out = {}
    for name, config in (("gpt", GPT), ("llama", LLAMA)):
        # blockwise with 4 sequences: each rank's 128 tokens cast and gathered in FP8; with 2,
        # 64 tokens a rank, gathered in bf16
        for recipe, batch in TP2_RECIPES:
            for sp in (False, True):
                torch.manual_seed(0)
                model = TransformerLM(
                    config,
                    tp_group=dist.group.WORLD,
                    sequence_parallel=sp,
                    dtype=torch.bfloat16,
                    device="cpu",
                )
                tokens = torch.randint(0, config.vocab_size, (batch, 64))
                out[(name, recipe, batch, sp)] = saved_bytes(
                    model, recipe, tokens, tokens, tp_group=dist.group.WORLD
                )
    return out


TP2_RECIPES = [
    (None, 2),
    ("delayed", 2),
    ("current", 2),
    ("rowwise", 2),
    ("blockwise", 2),
    ("blockwise", 4),
]


def test_tensor_parallel_activations_within_one_percent():
    measured = run_on_ranks(tp2_activations_body, 2)[0]
    for (name, recipe, batch, sp), value in measured.items():
        layout = MemoryLayout(
            seq_length=64,
            micro_batch_size=batch,
            tp=2,
            sequence_parallel=sp,
            fp8=recipe,
            norm_on_cuda=False,
        )
        predicted = estimate({"gpt": GPT, "llama": LLAMA}[name], layout)[0]["activations"]
        assert abs(predicted / value - 1) < 0.01, (name, recipe, sp, predicted, value)


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
    rows = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| gpt") or line.startswith("| llama")
    ]
    assert len(rows) == 9  # GPT-1.3B in six layouts, Llama-2-7B in three
    errors = [float(row.split("|")[6].strip().rstrip("%")) for row in rows]
    assert max(map(abs, errors)) < 10, rows
    assert tool.main(["/nonexistent"]) == 2


def test_fp8_primary_weights_hold_no_bf16_copy_of_the_fp8_weights():
    """FP8 primary weights drop 2 bytes from each FP8 weight's parameter bytes (the cast, counted
    apart, is then the weight); the throughput model's optimizer pass writes the cast in place of
    the bf16 weight; the distributed optimizer gathers them in FP8; only delayed scaling has
    them."""
    bf16_weights = MemoryLayout(seq_length=64, fp8="delayed")
    fp8_weights = MemoryLayout(seq_length=64, fp8="delayed", fp8_primary_weights=True)
    counts = rank_parameters(LLAMA, bf16_weights, 0)
    before, after = static_bytes(LLAMA, bf16_weights, 0), static_bytes(LLAMA, fp8_weights, 0)
    assert before["parameters"] - after["parameters"] == 2 * counts["fp8_weights"]
    assert {k: v for k, v in before.items() if k != "parameters"} == {
        k: v for k, v in after.items() if k != "parameters"
    }
    assert weight_cast_bytes(fp8_weights) == weight_cast_bytes(bf16_weights) - 2
    # With the distributed optimizer the weights' slices are gathered in FP8: a byte an owned
    # element less in the gather's input, and the pass writes 1 byte in place of the bf16 2.
    sharded = dict(seq_length=64, fp8="delayed", dp=4, distributed_optimizer=True)
    bf16_gather = static_bytes(LLAMA, MemoryLayout(**sharded), 0)
    fp8_layout = MemoryLayout(**sharded, fp8_primary_weights=True)
    fp8_gather = static_bytes(LLAMA, fp8_layout, 0)
    assert bf16_gather["optimizer"] - fp8_gather["optimizer"] == counts["fp8_weights"] / 4
    assert bf16_gather["parameters"] - fp8_gather["parameters"] == 2 * counts["fp8_weights"]
    assert weight_cast_bytes(fp8_layout) == -1
    with pytest.raises(ValueError, match="fp8='delayed'"):
        MemoryLayout(seq_length=64, fp8="current", fp8_primary_weights=True)
