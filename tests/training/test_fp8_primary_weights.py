"""FP8 primary weights (Fp8Linear.make_weight_fp8, MixedPrecisionAdamW.make_weights_fp8,
--fp8-primary-weights): the FP8 linears hold their weights only as FP8 bytes and transposes,
written from the fp32 masters; what reads them in high precision gets them dequantized, their
gradients reach main_grad, checkpoints store their values."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from megafp8.models.config import gpt_config
from megafp8.models.transformer import TransformerLM
from megafp8.parallel.data_parallel import GradientBuffer

from megafp8.fp8.autocast import fp8_autocast
from megafp8.fp8.linear import Fp8Linear
from megafp8.fp8.quantize import quantize_torch
from megafp8.fp8.recipe import CurrentScaling, DelayedScaling
from megafp8.fp8.tensor import scale_from_amax
from megafp8.training import arguments, checkpointing
from megafp8.training.optimizer import MixedPrecisionAdamW
from megafp8.training.trainer import pretrain

from ..interpreter import run_interpreted_checks
from ..multiprocess import run_on_ranks
from .test_trainer import TINY, resume_body

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 tensor cores",
)


def build(device, fp8_primary, fused, dp_group=None, amax_group=None, clip_grad=1.0, **options):
    """Two FP8 linears ([144, 80] and [48, 144]: partial kernel tiles both ways) in fp32, their
    gradient buffer and optimizer; with `fp8_primary`, weights held in FP8 only. With
    `dp_group`, the distributed optimizer over it, the weights' amaxes agreed over `amax_group`
    (over two ranks: both weights in one bucket, the first rank's slice ends inside a row of
    the first layer's weight, the second owns none of the second layer's)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        [
            Fp8Linear(80, 144, device=device, dtype=torch.float32),
            Fp8Linear(144, 48, device=device, dtype=torch.float32),
        ]
    )
    for layer in layers:  # as the fused pass sets it for its own: both runs alike
        layer.keep_weight_cast_addresses = True
    params = list(layers.named_parameters())
    distributed = dp_group is not None
    buffer = GradientBuffer(
        [p for _, p in params],
        dp_group,
        bucket_size=20_000,
        shard=distributed,
        bucket_apart=[layer.weight for layer in layers] if distributed else (),
    )
    optimizer = MixedPrecisionAdamW(
        params,
        buffer,
        lr=1e-2,
        weight_decay=0.1,
        clip_grad=clip_grad,
        dp_group=dp_group,
        distributed=distributed,
        fused=fused,
        fp8_linears=list(layers),
        **options,
    )
    if fp8_primary:
        optimizer.make_weights_fp8(list(layers), amax_reduction_group=amax_group)
    return layers, buffer, optimizer


def train(layers, buffer, optimizer, steps=4, recipe=None, amax_group=None):
    recipe = recipe or DelayedScaling(amax_history_len=4)
    x = torch.randn(32, 80, device=layers[0].weight.device, generator=None)
    outputs = []
    for step in range(steps):
        with fp8_autocast(
            recipe=recipe, amax_reduction_group=amax_group, collect_saturation=step == 2
        ):
            y = layers[1](layers[0](x))
        buffer.zero()
        y.float().square().sum().backward()
        buffer.finish()
        assert optimizer.step()[0]
        outputs.append(y.detach())
    return outputs


def check_fp8_primary_weights_train_as_fp32_weights(device, fused):
    """fp32 weights are their masters, so FP8 linears that cast them make, step after step, the
    bytes that FP8 primary weights get from the masters directly: outputs, masters, scales,
    histories and the weights' bytes are the same, bit for bit; and each FP8 weight is the cast
    of its master with the weight's scale (both layouts, amax, inverse scale). A logging step's
    saturation counts of the weights are those of the same casts."""
    runs = []
    for fp8_primary in (False, True):
        layers, buffer, optimizer = build(device, fp8_primary, fused)
        torch.manual_seed(1)
        outputs = train(layers, buffer, optimizer)
        masters = [master for *_, master in optimizer.shards]
        states = [
            (s.scale.clone(), s.amax_history.clone(), s.cast_counts.clone())
            for layer in layers
            for s in layer.fp8_scaling.values()
        ]
        runs.append((outputs, [m.clone() for m in masters], states))
        if fp8_primary:
            master_of = {id(param): master for param, *_, master in optimizer.shards}
            for layer in layers:
                master = master_of[id(layer.weight)]
                assert layer.fp8_scaling["weight"].cast_counts[1] == layer.weight.numel()
                assert layer.weight.dtype == torch.float8_e4m3fn
                cast = layer._weight_fp8[1]
                state = layer.fp8_scaling["weight"]
                ref = quantize_torch(
                    master.view(layer.weight.shape).cpu(),
                    torch.float8_e4m3fn,
                    state.scale.cpu(),
                    0,
                    True,
                    True,
                )
                for got, want in (
                    (layer.weight.detach(), ref.data),
                    (cast.data_t, ref.data_t),
                    (cast.scale_inv, ref.scale_inv),
                    (state.amax, ref.amax),
                ):
                    got = got.cpu()
                    if got.element_size() == 1:
                        got, want = got.view(torch.uint8), want.view(torch.uint8)
                    assert torch.equal(got, want)
    (out_a, masters_a, states_a), (out_b, masters_b, states_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(out_a, out_b))
    assert all(torch.equal(a, b) for a, b in zip(masters_a, masters_b))
    assert all(torch.equal(a, b) for s, t in zip(states_a, states_b) for a, b in zip(s, t))


def test_fp8_primary_weights_train_as_fp32_weights():
    check_fp8_primary_weights_train_as_fp32_weights("cpu", fused=False)


def distributed_body(rank, world_size, fused, reduce_amax, device="cpu"):
    """FP8 primary weights under the distributed optimizer, every rank on the same batch (so
    that the averaged gradient is one rank's, exactly): what each rank holds."""
    group = dist.group.WORLD
    amax_group = group if reduce_amax else None
    layers, buffer, optimizer = build(
        device, True, fused, dp_group=group, amax_group=amax_group, clip_grad=0.0
    )
    assert all(
        len({p.dtype for p in bucket.params}) == 1 for bucket in buffer.buckets
    )  # FP8 weights apart from the biases
    torch.manual_seed(1)
    for step in (1, 2):  # a resumed optimizer's first step casts alike
        outputs = train(layers, buffer, optimizer, steps=2, amax_group=amax_group)
        states = optimizer.state_for_checkpoint()
        if step == 1:
            optimizer.load_checkpoint_state(states, optimizer.step_count())
    masters = {name: s["master"].cpu() for name, s in states.items()}
    return [y.cpu() for y in outputs], fp8_weights_of(layers), masters


def fp8_weights_of(layers):
    """Each layer's weight bytes, transpose, inverse scale, scale, amax history and counts."""
    held = []
    for layer in layers:
        cast, state = layer._weight_fp8[1], layer.fp8_scaling["weight"]
        held.append(
            tuple(
                t.cpu().clone()
                for t in (
                    layer.weight.detach().view(torch.uint8),
                    cast.data_t.view(torch.uint8),
                    cast.scale_inv,
                    state.scale,
                    state.amax_history,
                    state.cast_counts,
                )
            )
        )
    return held


def check_the_distributed_optimizer_gathers_fp8_primary_weights_as_one_rank_holds_them(
    fused, device="cpu", world_size=2, backend="gloo"
):
    """Two data-parallel ranks cast their slices with the weights' scales and all-gather the
    bytes: each rank holds, step after step, what one process with whole weights holds (bytes,
    transposes, inverse scales, scales, histories, the weights' saturation counts summed over
    the ranks), bit for bit, and the same masters; with the forward's amax reduction over the
    data-parallel ranks, or without it (the optimizer agrees the weights' amaxes itself).
    No clipping: the norm of slices sums in another order."""
    layers, buffer, optimizer = build(device, True, fused, clip_grad=0.0)
    torch.manual_seed(1)
    want_outputs = train(layers, buffer, optimizer, steps=2)
    optimizer.load_checkpoint_state(optimizer.state_for_checkpoint(), optimizer.step_count())
    want_outputs = [y.cpu() for y in train(layers, buffer, optimizer, steps=2)]
    want = fp8_weights_of(layers)
    masters = {name: s["master"].cpu() for name, s in optimizer.state_for_checkpoint().items()}
    for reduce_amax in (True, False):
        ranks = run_on_ranks(
            distributed_body, world_size, fused, reduce_amax, device, backend=backend
        )
        for outputs, held, got_masters in ranks:
            assert all(torch.equal(a, b) for a, b in zip(outputs, want_outputs))
            for got_layer, want_layer in zip(held, want):
                *same, counts = got_layer
                assert all(torch.equal(a, b) for a, b in zip(same, want_layer))
            assert all(torch.equal(got_masters[n], masters[n]) for n in masters)
        summed = [sum(held[i][-1] for _, held, _ in ranks) for i in range(len(want))]
        assert all(torch.equal(a, b[-1]) for a, b in zip(summed, want))


def test_the_distributed_optimizer_gathers_fp8_primary_weights_as_one_rank_holds_them():
    check_the_distributed_optimizer_gathers_fp8_primary_weights_as_one_rank_holds_them(False)


@pytest.mark.gpu
@needs_fp8_gpu
def test_the_fused_pass_casts_fp8_primary_weight_slices_on_cuda():
    """The compiled kernel's slice casts: one NCCL rank (its slices are whole buckets) against
    whole weights, bit for bit."""
    check_the_distributed_optimizer_gathers_fp8_primary_weights_as_one_rank_holds_them(
        True, "cuda", world_size=1, backend="nccl"
    )


def test_a_bucket_mixing_fp8_primary_weights_with_other_parameters_is_refused():
    body_result = run_on_ranks(mixed_bucket_body, 2)
    assert all("bucket_apart" in message for message in body_result)


def mixed_bucket_body(rank, world_size):
    layer = Fp8Linear(64, 48, dtype=torch.float32)
    buffer = GradientBuffer(list(layer.parameters()), dist.group.WORLD, shard=True)
    optimizer = MixedPrecisionAdamW(
        list(layer.named_parameters()),
        buffer,
        lr=1e-3,
        dp_group=dist.group.WORLD,
        distributed=True,
        fused=False,
        fp8_linears=[layer],
    )
    with pytest.raises(ValueError, match="bucket_apart") as refused:
        optimizer.make_weights_fp8([layer])
    return str(refused.value)


def test_the_first_scale_is_the_one_a_first_forward_cast_fits():
    """Fitted to the weight, with the recipe's margin: a first forward cast's scale."""
    for margin in (0, 2):
        layer = Fp8Linear(64, 48, dtype=torch.float32)
        amax = layer.weight.detach().abs().max()
        layer.make_weight_fp8(margin=margin)
        want = scale_from_amax(amax, torch.float8_e4m3fn, margin)
        assert torch.equal(layer.fp8_scaling["weight"].scale, want)


def interpreted_checks():
    check_fp8_primary_weights_train_as_fp32_weights("cpu", fused=True)
    check_the_distributed_optimizer_gathers_fp8_primary_weights_as_one_rank_holds_them(True)


@needs_triton
def test_fp8_primary_weights_in_the_fused_pass_in_the_triton_interpreter():
    run_interpreted_checks(__name__)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_fp8_primary_weights_train_as_fp32_weights_on_cuda(fused):
    check_fp8_primary_weights_train_as_fp32_weights("cuda", fused)


def test_the_weight_is_held_in_fp8_only():
    """The parameter object stays (with its attributes), its storage becomes one byte an element,
    the transpose sits beside it, and its values are the weight's within E4M3's rounding."""
    layer = Fp8Linear(64, 48, dtype=torch.bfloat16)
    layer.weight.partition = "kept"
    param, values = layer.weight, layer.weight.detach().float().clone()
    layer.make_weight_fp8()
    assert layer.weight is param and param.partition == "kept" and param.requires_grad
    assert param.dtype == torch.float8_e4m3fn
    assert param.untyped_storage().nbytes() == param.numel()
    cast = layer._weight_fp8[1]
    assert cast.data_t.shape == (64, 48) and torch.equal(
        cast.data_t.view(torch.uint8), param.detach().t().view(torch.uint8)
    )
    dequantized = layer.dequantized_weight()
    assert dequantized.dtype == torch.bfloat16 == layer.high_precision_dtype
    error = (dequantized.float() - values).abs() / values.abs()
    assert error.max() <= 2.0**-4 + 2.0**-8  # half an E4M3 step, plus bf16's rounding
    with pytest.raises(ValueError, match="in FP8 already"):
        layer.make_weight_fp8()


def test_high_precision_gemms_read_the_dequantized_weight_and_fill_main_grad():
    """Outside fp8_autocast, and for each GEMM a recipe keeps in high precision, the layer
    computes with the dequantized weight; the weight gradient reaches main_grad (fp32 buffer)
    as the reference computes it, the input gradient too."""
    torch.manual_seed(0)
    layer = Fp8Linear(64, 48, dtype=torch.float32)
    layer.make_weight_fp8()
    buffer = GradientBuffer(list(layer.parameters()), bucket_size=10_000)
    w = layer.dequantized_weight().double()
    x = torch.randn(32, 64, requires_grad=True)
    for recipe in (
        None,
        DelayedScaling(override_linear_precision=(True, True, True)),
        DelayedScaling(override_linear_precision=(False, True, True)),
    ):
        buffer.zero()
        x.grad = None
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = layer(x)
        if recipe is None or recipe.override_linear_precision[0]:
            want = x.double() @ w.t() + layer.bias.double()
            assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)
        dy = torch.randn_like(y)
        y.backward(dy)
        buffer.finish()
        grad_w = dy.double().t() @ x.double()
        assert torch.allclose(layer.weight.main_grad.double(), grad_w, rtol=1e-5, atol=1e-5)
        assert layer.weight.grad is None
        assert torch.allclose(x.grad.double(), dy.double() @ w, rtol=1e-5, atol=1e-5)


def test_fp8_gemms_accumulate_micro_batches_into_main_grad():
    """The FP8 weight gradient overwrites main_grad at a step's first micro-batch; the later
    ones are added there too (autograd, which would cast them to FP8, gets none)."""
    torch.manual_seed(0)
    layer = Fp8Linear(64, 48, dtype=torch.float32)
    layer.make_weight_fp8()
    buffer = GradientBuffer(list(layer.parameters()), bucket_size=10_000)
    xs = [torch.randn(32, 64) for _ in range(3)]
    grads = []
    buffer.zero()
    for x in xs:
        with fp8_autocast(recipe=DelayedScaling()):
            y = layer(x)
        dy = torch.randn_like(y)
        y.backward(dy)
        grads.append(dy.double().t() @ x.double())
    buffer.finish()
    want = sum(grads)
    error = (layer.weight.main_grad.double() - want).norm() / want.norm()
    assert error < 0.1  # E5M2 gradients, E4M3 inputs
    assert layer.weight.grad is None


def test_state_dict_holds_the_values_and_loads_by_casting_them():
    torch.manual_seed(0)
    layer = Fp8Linear(64, 48, dtype=torch.bfloat16)
    layer.make_weight_fp8()
    state = layer.state_dict()
    assert state["weight"].dtype == torch.bfloat16
    assert torch.equal(state["weight"], layer.dequantized_weight())
    plain = Fp8Linear(64, 48, dtype=torch.bfloat16)
    plain.load_state_dict(state)
    assert torch.equal(plain.weight.detach(), state["weight"])
    other = Fp8Linear(64, 48, dtype=torch.bfloat16)
    other.make_weight_fp8()
    other.load_state_dict(state)  # the scale comes with the values: the same bytes
    assert torch.equal(other.weight.view(torch.uint8), layer.weight.view(torch.uint8))
    assert torch.equal(other.fp8_scaling["weight"].scale, layer.fp8_scaling["weight"].scale)


def test_what_fp8_primary_weights_cannot_do_is_refused():
    layer = Fp8Linear(64, 48, dtype=torch.float32)
    layer.make_weight_fp8()
    with pytest.raises(ValueError, match="under delayed scaling"):
        with fp8_autocast(recipe=CurrentScaling()):
            layer(torch.randn(16, 64))
    y = layer(torch.randn(16, 64, requires_grad=True))  # high precision: needs main_grad
    with pytest.raises(RuntimeError, match="takes its gradient in main_grad"):
        y.sum().backward()
    linear = Fp8Linear(64, 48, bias=False, dtype=torch.bfloat16)
    buffer = GradientBuffer([linear.weight], bucket_size=10_000)
    optimizer = MixedPrecisionAdamW(
        [("weight", linear.weight)],
        buffer,
        lr=1e-3,
        fused=False,
        fp8_linears=[],
    )
    with pytest.raises(ValueError, match="not among this optimizer's fp8_linears"):
        optimizer.make_weights_fp8([linear])


@pytest.mark.parametrize(
    "extra, on",
    [
        (["--fp8-format", "hybrid"], True),
        (["--fp8-format", "hybrid", "--fp8-recipe", "current"], False),
        (["--fp8-format", "hybrid", "--no-fp8-primary-weights"], False),
        (["--fp8-format", "hybrid", "--no-gradient-accumulation-fusion"], False),
        (["--fp8-format", "hybrid", "--use-distributed-optimizer"], False),
        (["--fp8-format", "hybrid", "--use-distributed-optimizer", "--fp8-param-gather"], True),
        ([], False),
    ],
)
def test_fp8_primary_weights_are_on_by_default_where_they_apply(extra, on):
    args = arguments.parse_args(TINY + ["--train-iters", "3", *extra])
    assert args.fp8_primary_weights is on


def test_fp8_primary_weights_asked_for_where_they_cannot_run_are_refused():
    with pytest.raises(arguments.ArgumentsError, match="--fp8-recipe current"):
        arguments.parse_args(
            TINY
            + ["--train-iters", "3", "--fp8-format", "hybrid", "--fp8-recipe", "current"]
            + ["--fp8-primary-weights"]
        )
    with pytest.raises(arguments.ArgumentsError, match="add --fp8-format"):
        arguments.parse_args(TINY + ["--train-iters", "3", "--fp8-primary-weights"])
    fp8 = TINY + ["--train-iters", "3", "--fp8-format", "hybrid"]
    with pytest.raises(arguments.ArgumentsError, match="give --use-distributed-optimizer"):
        arguments.parse_args(fp8 + ["--fp8-param-gather"])
    with pytest.raises(arguments.ArgumentsError, match="leave out --no-fp8-primary-weights"):
        arguments.parse_args(
            fp8 + ["--use-distributed-optimizer", "--fp8-param-gather", "--no-fp8-primary-weights"]
        )


def reshard_body(rank, world_size, argv):
    return pretrain(argv).history


def test_a_run_with_fp8_primary_weights_resumes_bitwise_and_in_any_other_way(tmp_path):
    """bf16 parameters, where FP8 primary weights are not the casts of a bf16 copy: the resumed
    run is the straight one bit for bit, and its checkpoint resumes with bf16 weights, or with
    the distributed optimizer over two data-parallel ranks (bf16 weights, or FP8 ones gathered
    in FP8), as the same run up to rounding."""
    argv = TINY + ["--bf16", "--fp8-format", "hybrid"]
    straight, first, second = run_on_ranks(resume_body, 1, argv, str(tmp_path))[0]
    assert [i for i, _ in first] == [1, 2, 3] and first + second == straight
    resume = ["--train-iters", "8", "--load", str(tmp_path)]
    fp8 = run_on_ranks(reshard_body, 1, argv + resume)[0]
    bf16 = run_on_ranks(reshard_body, 1, argv + resume + ["--no-fp8-primary-weights"])[0]
    dp2 = run_on_ranks(reshard_body, 2, argv + resume + ["--use-distributed-optimizer"])[0]
    gathered = ["--use-distributed-optimizer", "--fp8-param-gather"]
    dp2_fp8 = run_on_ranks(reshard_body, 2, argv + resume + gathered)[0]
    assert [i for i, _ in fp8] == [7, 8]
    for other in (bf16, dp2, dp2_fp8):
        assert [i for i, _ in other] == [7, 8]
        assert [loss for _, loss in other] == pytest.approx([loss for _, loss in fp8], rel=1e-3)


def gather_dtypes_body(rank, world_size, argv):
    """The dtypes of the parameters and of the distributed optimizer's all-gather inputs."""
    trainer = pretrain(argv + ["--train-iters", "3"])
    inputs = trainer.optimizer._gather_inputs.values()
    return {p.dtype for p in trainer.model.parameters()}, {t.dtype for t in inputs}


def test_fp8_parameter_gather_resumes_bitwise_and_trains_as_whole_weights(tmp_path):
    """--use-distributed-optimizer --fp8-param-gather over two data-parallel ranks (bf16, the
    gathers overlapped with the forward): the resumed run is the straight one bit for bit, and
    it trains as the replicated optimizer with FP8 primary weights does, up to the gradient
    norm's summation order."""
    argv = TINY + ["--bf16", "--fp8-format", "hybrid"]
    gathered = argv + [
        "--use-distributed-optimizer",
        "--overlap-param-gather",
        "--fp8-param-gather",
    ]
    ranks = run_on_ranks(resume_body, 2, gathered, str(tmp_path))
    for straight, first, second in ranks:
        assert [i for i, _ in first] == [1, 2, 3] and first + second == straight
    held, gathered_dtypes = run_on_ranks(gather_dtypes_body, 2, gathered)[0]
    assert held == {torch.bfloat16, torch.float8_e4m3fn}
    assert gathered_dtypes == {torch.bfloat16, torch.float8_e4m3fn}
    replicated = run_on_ranks(reshard_body, 2, argv + ["--train-iters", "6"])[0]
    assert [loss for _, loss in ranks[0][0]] == pytest.approx(
        [loss for _, loss in replicated], rel=1e-3
    )


def small_run(seed):
    """A two-layer GPT in bf16 with FP8 primary weights, its buffer and optimizer."""
    config = gpt_config(2, 64, 4, vocab_size=256, max_position_embeddings=32)
    torch.manual_seed(seed)
    model = TransformerLM(config, dtype=torch.bfloat16)
    buffer = GradientBuffer(list(model.parameters()), bucket_size=100_000)
    optimizer = MixedPrecisionAdamW(
        list(model.named_parameters()),
        buffer,
        lr=1e-2,
        fused=False,
        fp8_linears=model.fp8_linears(),
    )
    optimizer.make_weights_fp8(model.fp8_linears())
    return config, model, buffer, optimizer


def test_checkpoints_store_fp8_primary_weights_as_their_masters_and_load_them_back(tmp_path):
    """The checkpoint stores an FP8 primary weight as a bf16-weight run would: its master in
    bf16. Loaded with the optimizer, the FP8 bytes are the saved run's, bit for bit (cast again
    from the masters with the saved scales); without it (a finetune), the masters start from
    those bf16 values, not from the coarser FP8 ones."""
    config, model, buffer, optimizer = small_run(0)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        buffer.zero()
        with fp8_autocast(recipe=DelayedScaling()):
            model(tokens[:, :-1], tokens[:, 1:]).float().mean().backward()
        buffer.finish()
        optimizer.step()
    checkpointing.save_checkpoint(
        tmp_path, 2, model, optimizer, groups=None, train_state={}, args={}, model_config=config
    )
    name = "layers.0.mlp.fc1.weight"
    param = model.get_parameter(name)
    saved = {
        f"model/{name}": torch.empty(param.shape, dtype=torch.bfloat16),
        f"optimizer/{name}/master": torch.empty(param.shape),
    }
    checkpointing.read_state(saved, checkpointing.latest_checkpoint(tmp_path))
    master = saved[f"optimizer/{name}/master"]
    assert torch.equal(saved[f"model/{name}"], master.to(torch.bfloat16))

    _, resumed, _, resumed_optimizer = small_run(1)
    checkpointing.load_checkpoint(tmp_path, resumed, resumed_optimizer, groups=None)
    for a, b in zip(model.fp8_linears(), resumed.fp8_linears()):
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
        assert torch.equal(
            a._weight_fp8[1].data_t.view(torch.uint8), b._weight_fp8[1].data_t.view(torch.uint8)
        )

    _, finetuned, _, finetuned_optimizer = small_run(2)
    checkpointing.load_checkpoint(
        tmp_path, finetuned, finetuned_optimizer, groups=None, load_optimizer=False
    )
    master_of = {id(p): m for p, *_, m in finetuned_optimizer.shards}
    finetuned_master = master_of[id(finetuned.get_parameter(name))]
    assert torch.equal(finetuned_master.view(param.shape), saved[f"model/{name}"].float())
