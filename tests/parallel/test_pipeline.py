"""Pipeline parallelism (gloo): 1F1B and interleaved 1F1B over pp = 2 and 4 stages, and
tp2 x pp2 x dp2 with sequence parallelism, train several steps to the same losses and
gradients as one process running the whole model (no pipelining), with FP8 on and off;
the tied embedding's gradient sync; the 1F1B in-flight bound; the order of passes within a
stage (FP8 amax collectives); the pairing of transfers; layer splits and bad arguments."""

import functools
import types

import pytest
import torch
import torch.distributed as dist
from megafp8.models import TransformerLM, preset
from megafp8.parallel import (
    P2PCommunicator,
    ParallelGroups,
    check_embeddings_in_sync,
    finalize_grads,
    forward_backward,
    pipeline_tensor_shape,
    schedules,
    stage_layers,
)
from megafp8.parallel.data_parallel import GradientBuffer
from megafp8.parallel.stages import LAYER_PARTS, layer_parts

from megafp8 import DelayedScaling, fp8_autocast
from megafp8.fp8 import scaling

from ..fp8.helpers import rel_err
from ..models.test_model_parallel import shard_of
from ..multiprocess import run_on_ranks

LAYERS, SEQ, MICRO_BATCH, NUM_MICRO_BATCHES, STEPS, LR, SEED = 4, 16, 1, 4, 3, 0.5, 7
RECIPE = DelayedScaling(amax_history_len=4)
TIMEOUT_S = 120


def config_of(name):
    return preset(name, num_layers=LAYERS)  # gpt-tiny: tied embeddings; llama-tiny: untied, RoPE


def micro_batches(config, step, dp_rank=0, dp=1, eval_=False):
    """This dp rank's (tokens, labels) micro-batches of one step; dp=1 with dp_rank=None gives
    the global batch: micro-batch i of every dp rank concatenated (the one-process reference)."""
    g = torch.Generator().manual_seed(1000 * step + (99 if eval_ else 0))
    data = torch.randint(
        0, config.vocab_size, (NUM_MICRO_BATCHES, dp, MICRO_BATCH, 2, SEQ), generator=g
    )
    picked = data.flatten(1, 2) if dp_rank is None else data[:, dp_rank]
    return [(batch[:, 0], batch[:, 1]) for batch in picked]


def make_forward_step(fp8, amax_group):
    def forward_step(chunk_index, chunk, input_tensor, batch):
        device = next(chunk.parameters()).device
        tokens, labels = (t.to(device) for t in batch)
        with fp8_autocast(enabled=fp8, recipe=RECIPE, amax_reduction_group=amax_group):
            out = chunk(
                tokens if input_tensor is None else input_tensor,
                labels if chunk.post_process else None,
            )
        if not chunk.post_process:
            return out
        loss = out.mean()
        return loss / NUM_MICRO_BATCHES, loss.detach()

    return forward_step


def train(chunks, groups, fp8, dp_rank, dp, sequence_parallel=False, schedule=None, overlap=False):
    """STEPS steps of plain SGD on main_grad, then one forward-only evaluation; per step the
    reported losses, every main_grad (after dp averaging, tp sums of sequence-parallel
    parameters and the tied-embedding sync) and the schedule's stats. `overlap`: the
    schedules' overlap_p2p_comm."""
    config = chunks[0].config
    params = [p for chunk in chunks for p in chunk.parameters()]
    # one buffer for all chunks
    buffer = GradientBuffer(params, groups.dp_group if groups else None)
    forward_step = make_forward_step(fp8, groups.amax_reduction_group if groups else None)
    shape = dict(
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH * (1 if dp_rank is not None else dp),
        hidden_size=config.hidden_size,
        dtype=torch.float32,
        sequence_parallel=sequence_parallel,
        overlap_p2p_comm=overlap,
    )
    results = []
    for step in range(STEPS):
        buffer.zero()
        stats = {}
        losses = forward_backward(
            schedule,
            chunks,
            data_iterator=iter(micro_batches(config, step, dp_rank, dp)),
            forward_step=forward_step,
            num_micro_batches=NUM_MICRO_BATCHES,
            groups=groups,
            grad_buffers=buffer,
            stats=stats,
            **shape,
        )
        finalize_grads(chunks, groups, buffer)
        grads = {
            name: param.main_grad.cpu().clone()
            for chunk in chunks
            for name, param in chunk.named_parameters()
        }
        with torch.no_grad():
            for param in params:
                param.sub_(LR * param.main_grad)
        results.append({"losses": [loss.item() for loss in losses], "grads": grads, "stats": stats})
    eval_losses = forward_backward(
        schedule,
        chunks,
        data_iterator=iter(micro_batches(config, 0, dp_rank, dp, eval_=True)),
        forward_step=forward_step,
        num_micro_batches=NUM_MICRO_BATCHES,
        groups=groups,
        forward_only=True,
        **shape,
    )
    buffer.remove_hooks()
    return {"steps": results, "eval": [loss.item() for loss in eval_losses]}


@functools.cache
def reference(name, fp8, dp=1, device="cpu"):
    """One process, the whole model, no pipelining; micro-batches of dp ranks concatenated."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers
    try:
        return train(
            [TransformerLM(config_of(name), seed=SEED, device=device)], None, fp8, None, dp
        )
    finally:
        torch.set_num_threads(threads)


def count_fp8_collectives():
    """Count, in this process, the end-of-pass FP8 amax reductions that run a collective."""
    counter = {"collectives": 0}
    flush = scaling.AmaxPass.flush

    def counting_flush(self):
        if self.observations and self.group is not None and dist.get_world_size(self.group) > 1:
            counter["collectives"] += 1
        flush(self)

    scaling.AmaxPass.flush = counting_flush
    return counter


def layout_body(rank, world_size, layouts, device="cpu", overlap=False, splits=None):
    """Train every (name, tp, pp, vpp, sequence_parallel, fp8) layout; this rank's results.
    `splits`: {layout: (first_stage_layers, last_stage_layers)} where not even."""
    counter = count_fp8_collectives()
    out = {}
    for layout in layouts:
        name, tp, pp, vpp, sp, fp8 = layout
        groups = ParallelGroups(tp, pp)
        config = config_of(name)
        chunks = [
            TransformerLM(
                config,
                tp_group=groups.tp_group,
                sequence_parallel=sp,
                layers=span,
                seed=SEED,
                device=device,
            )
            for span in stage_layers(
                config.num_layers, pp, groups.pp_rank, vpp, *(splits or {}).get(layout, ())
            )
        ]
        check_embeddings_in_sync(chunks, groups)
        before = counter["collectives"]
        result = train(chunks, groups, fp8, groups.dp_rank, groups.dp_size, sp, overlap=overlap)
        result.update(
            fp8_collectives=counter["collectives"] - before,
            tp_rank=groups.tp_rank,
            pp_rank=groups.pp_rank,
            dp_rank=groups.dp_rank,
            rank=rank,
        )
        out[(name, tp, pp, vpp, sp, fp8)] = result
    return out


def compare(results, layout, tp=1, ref=None):
    """The layout's results against the one-process reference: per step, the largest relative
    error of any parameter's gradient and the relative error of all gradients together (every
    rank's shard against the reference's slice); and the largest relative error of the losses
    (per step and the final evaluation). Also checks every parameter and loss was seen."""
    name, fp8 = layout[0], layout[-1]
    dp = len({r[layout]["dp_rank"] for r in results})
    ref = ref or reference(name, fp8, dp)
    config = config_of(name)
    per_parameter, together, seen = [0.0] * STEPS, [], set()
    for step in range(STEPS):
        difference = norm = 0.0
        for r in results:
            mine = r[layout]
            for param_name, grad in mine["steps"][step]["grads"].items():
                full = shard_of(
                    param_name,
                    ref["steps"][step]["grads"][param_name],
                    grad,
                    tp,
                    mine["tp_rank"],
                    config,
                )
                per_parameter[step] = max(per_parameter[step], rel_err(grad, full))
                difference += (grad.double() - full.double()).norm().item() ** 2
                norm += full.double().norm().item() ** 2
                seen.add(param_name)
        together.append((difference / norm) ** 0.5)
    assert seen == set(ref["steps"][0]["grads"]), set(ref["steps"][0]["grads"]) ^ seen
    # The losses, on the last stage: each reference micro-batch is the mean of the dp ranks' ones.
    last = [r[layout] for r in results if r[layout]["steps"][0]["losses"]]
    assert len(last) == tp * dp
    ours = torch.tensor(
        [[s["losses"] for s in r["steps"]] + [r["eval"]] for r in last], dtype=torch.float64
    )
    theirs = torch.tensor([s["losses"] for s in ref["steps"]] + [ref["eval"]], dtype=torch.float64)
    assert ours.shape[1:] == (STEPS + 1, NUM_MICRO_BATCHES)
    loss = ((ours.mean(0) - theirs).abs() / theirs.abs()).max().item()
    return {"per_parameter": per_parameter, "together": together, "loss": loss}


def worst(errors):
    return max(max(errors["per_parameter"]), errors["loss"])


@functools.cache
def fp8_own_error(name, dp=1):
    """FP8's own error per step: the one-process FP8 run against the fp32 one, all gradients together."""
    fp8, plain = reference(name, True, dp), reference(name, False, dp)
    errors = []
    for step in range(STEPS):
        grads = fp8["steps"][step]["grads"], plain["steps"][step]["grads"]
        difference = sum(
            (grads[0][n].double() - grads[1][n].double()).norm() ** 2 for n in grads[1]
        )
        errors.append(
            (difference / sum(grads[1][n].double().norm() ** 2 for n in grads[1])).sqrt().item()
        )
    return errors


def check_pass_order_within_stages(results, layout):
    """Every rank of a stage (the FP8 amax-reduction group: tp x dp) ran the same passes in
    the same order, and so reached the same FP8 collectives."""
    by_stage = {}
    for r in results:
        mine = r[layout]
        by_stage.setdefault(mine["pp_rank"], []).append(
            ([s["stats"]["order"] for s in mine["steps"]], mine["fp8_collectives"])
        )
    for stage, entries in by_stage.items():
        assert all(entry == entries[0] for entry in entries), f"stage {stage} ranks disagree"
    return {stage: entries[0][1] for stage, entries in by_stage.items()}


def check_p2p_pairing(results, layout):
    """For every pair of ranks, the kinds (activation / gradient) one sends the other, in
    order, are the kinds the other receives from it, in order: NCCL pairs them that way."""
    logs = {
        r[layout]["rank"]: [e for s in r[layout]["steps"] for e in s["stats"].get("p2p", [])]
        for r in results
    }
    transfers = 0
    for a in logs:
        for b in logs:
            sent = [kind for op, peer, kind in logs[a] if op == "send" and peer == b]
            received = [kind for op, peer, kind in logs[b] if op == "recv" and peer == a]
            assert sent == received, (a, b, sent, received)
            transfers += len(sent)
    assert transfers > 0


# -- pp = 2: 1F1B and interleaved (2 virtual stages), GPT (tied) and Llama, FP8 on and off ------

PP2 = [
    (name, 1, 2, vpp, False, fp8)
    for name in ("gpt-tiny", "llama-tiny")
    for vpp in (1, 2)
    for fp8 in (False, True)
]


# Stages that end after a layer's attention: 1.5, 1, 1 and 0.5 layers on 2 x 2 virtual stages
# (every stage holds a half), 1.5 and 2.5 on two; and a layout of every stage's layers, 1, 1.5, 1
# and 0.5, where rank 0's second chunk starts at a layer's MLP and ends after the next one's attention.
HALVES = {
    ("gpt-tiny", 1, 2, 2, False, True): (1.5, 0.5),
    ("llama-tiny", 1, 2, 1, False, False): (1.5, None),
    ("gpt-tiny", 1, 2, 2, False, False): (None, None, (1, 1.5, 1, 0.5)),
}


def pp2_body(rank, world_size):
    out = layout_body(rank, world_size, PP2)
    out["overlapped"] = layout_body(rank, world_size, PP2, overlap=True)
    out["halves"] = layout_body(rank, world_size, list(HALVES), splits=HALVES)
    out["embedding_check"] = check_embeddings_body(rank)
    out["posting_order"] = posting_order_body()
    return out


@pytest.fixture(scope="module")
def pp2_results():
    return run_on_ranks(pp2_body, 2, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(
    "layout", PP2, ids=lambda x: f"{x[0]}-vpp{x[3]}-{'fp8' if x[-1] else 'fp32'}"
)
def test_pp2_equals_one_process(pp2_results, layout):
    error = worst(compare(pp2_results, layout))
    # Each stage runs exactly the reference's operations on the same values (activations cross
    # stages exactly), so only sums in another order differ: the tied embedding's two gradient
    # parts summed across stages instead of inside autograd (~1e-7), which later steps carry
    # into the weights. With FP8 the scales are the same too (each layer sees the same amax
    # sequence: its passes run in micro-batch order and amax groups are single ranks here), so
    # the same holds unless a last-bit weight difference moves a value across an FP8 rounding
    # boundary; measured well below 1e-5.
    assert error < 1e-5, error


@pytest.mark.parametrize("layout", HALVES, ids=lambda x: f"{x[0]}-vpp{x[3]}")
def test_stages_ending_inside_a_layer_equal_one_process(pp2_results, layout):
    """A stage that ends after a layer's attention hands the residual stream to the next, which
    runs the layer's MLP: the same training as one process, as with whole layers."""
    results = [result["halves"] for result in pp2_results]
    assert worst(compare(results, layout)) < 1e-5
    check_p2p_pairing(results, layout)


def test_pp2_stage_order_and_pairing(pp2_results):
    for layout in PP2:
        check_pass_order_within_stages(pp2_results, layout)
        check_p2p_pairing(pp2_results, layout)
    # Interleaved: each rank runs each of its 2 chunks on every micro-batch.
    stats = pp2_results[0][("gpt-tiny", 1, 2, 2, False, False)]["steps"][0]["stats"]
    assert stats["forwards"] == stats["backwards"] == [NUM_MICRO_BATCHES] * 2


def assert_same_training(a, b):
    """Two runs of one layout on one rank trained alike: the same losses and gradients, bit for
    bit, and the same passes and transfers in the same order."""
    assert a["eval"] == b["eval"]
    for step_a, step_b in zip(a["steps"], b["steps"], strict=True):
        assert step_a["losses"] == step_b["losses"]
        assert step_a["grads"].keys() == step_b["grads"].keys()
        for name, grad in step_a["grads"].items():
            assert torch.equal(grad, step_b["grads"][name]), name
        assert step_a["stats"]["order"] == step_b["stats"]["order"]
        assert step_a["stats"]["p2p"] == step_b["stats"]["p2p"]


@pytest.mark.parametrize(
    "layout", PP2, ids=lambda x: f"{x[0]}-vpp{x[3]}-{'fp8' if x[-1] else 'fp32'}"
)
def test_overlapped_p2p_trains_as_waiting_p2p(pp2_results, layout):
    """overlap_p2p_comm posts the transfers in two batches and waits later: the same transfers
    in the same order, so the same training, bit for bit."""
    for result in pp2_results:
        assert_same_training(result["overlapped"][layout], result[layout])


def posting_order_body():
    """One overlapped interleaved step (gpt-tiny, pp 2 x 2 virtual stages) with each exchange
    recorded among the passes, as ("post", sends an activation, sends a gradient)."""
    communicate = schedules._Step.communicate

    def recorded(self, *, send_next=None, **transfers):
        self.order.append(("post", send_next is not None, transfers.get("send_prev") is not None))
        return communicate(self, send_next=send_next, **transfers)

    schedules._Step.communicate = recorded
    try:
        groups = ParallelGroups(1, 2)
        config = config_of("gpt-tiny")
        chunks = [
            TransformerLM(config, layers=span, seed=SEED)
            for span in stage_layers(config.num_layers, 2, groups.pp_rank, 2)
        ]
        stats = {}
        forward_backward(
            None,
            chunks,
            data_iterator=iter(micro_batches(config, 0)),
            forward_step=make_forward_step(False, None),
            num_micro_batches=NUM_MICRO_BATCHES,
            groups=groups,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            hidden_size=config.hidden_size,
            dtype=torch.float32,
            overlap_p2p_comm=True,
            stats=stats,
        )
        return groups.pp_rank, stats["order"]
    finally:
        schedules._Step.communicate = communicate


def test_overlapped_interleaved_sends_each_output_before_the_next_backward(pp2_results):
    """With overlap_p2p_comm, a forward's output goes to the next stage as soon as the forward
    is done: its exchange is posted before the backward that follows it in the steady state, so
    the peer's next forward does not wait for this rank's backward too."""
    for rank, order in (result["posting_order"] for result in pp2_results):
        passes = [i for i, entry in enumerate(order) if entry[0] in ("F", "B")]
        steady = 0
        for here, after in zip(passes, passes[1:]):
            (kind, chunk, _), (next_kind, *_) = order[here], order[after]
            last_stage = rank == 1 and chunk == 1  # runs the loss: nothing to send on
            if kind == "F" and next_kind == "B" and not last_stage:
                assert ("post", True, False) in order[here + 1 : after], (rank, order)
                steady += 1
        assert steady > 0, order  # the step has a steady state on this rank


def test_tied_embedding_gradients_are_synced(pp2_results):
    """The first stage's embedding and the last stage's copy get the same, full gradient."""
    for layout in [x for x in PP2 if x[0] == "gpt-tiny"]:
        first, last = (pp2_results[rank][layout] for rank in (0, 1))
        for step in range(STEPS):
            grads = (
                first["steps"][step]["grads"]["embedding.weight"],
                last["steps"][step]["grads"]["embedding.weight"],
            )
            assert torch.equal(*grads)
            ref = reference("gpt-tiny", layout[-1])["steps"][step]["grads"]["embedding.weight"]
            assert rel_err(grads[0], ref) < 1e-5


# -- pp = 4: 1F1B (and interleaved on 8 virtual stages), the in-flight bound ----------------------

PP4 = [("llama-tiny", 1, 4, 1, False, fp8) for fp8 in (False, True)] + [
    ("gpt-tiny", 1, 4, 1, False, True)
]


def pp4_body(rank, world_size):
    out = layout_body(rank, world_size, PP4)
    groups = ParallelGroups(1, 4)
    config = config_of("gpt-tiny").replace(num_layers=8)
    # In flight: 1F1B with more micro-batches than stages, and interleaved with 2 chunks; the
    # same with overlap_p2p_comm (on a ring of 4, where the previous and next stage differ).
    live, sizes, runs = {}, {}, {}
    for vpp, num, overlap in (
        (1, 8, False),
        (1, 2, False),
        (2, 8, False),
        (2, 4, False),
        (1, 8, True),
        (2, 8, True),
    ):
        chunks = [
            TransformerLM(config, layers=span, seed=SEED)
            for span in stage_layers(config.num_layers, 4, groups.pp_rank, vpp)
        ]
        g = torch.Generator().manual_seed(num)
        batches = [(torch.randint(0, 1000, (1, SEQ), generator=g),) * 2 for _ in range(num)]
        sent = []  # the outputs handed to the next stage

        def forward_step(chunk_index, chunk, input_tensor, batch):
            out = chunk(
                batch[0] if input_tensor is None else input_tensor,
                batch[1] if chunk.post_process else None,
            )
            if not chunk.post_process:
                sent.append(out)
            return out.mean() / num if chunk.post_process else out

        stats = {}
        losses = forward_backward(
            None,
            chunks,
            data_iterator=iter(batches),
            forward_step=forward_step,
            num_micro_batches=num,
            groups=groups,
            seq_length=SEQ,
            micro_batch_size=1,
            hidden_size=config.hidden_size,
            dtype=torch.float32,
            stats=stats,
            overlap_p2p_comm=overlap,
        )
        grads = [p.grad.clone() for chunk in chunks for p in chunk.parameters()]
        runs[(vpp, num, overlap)] = (losses, grads, stats)
        if not overlap:
            live[(vpp, num)] = stats["max_live_forwards"]
            sizes[(vpp, num)] = sorted({t.numel() for t in sent})
    out["live"], out["sent_sizes"], out["runs"] = live, sizes, runs
    return out


@pytest.fixture(scope="module")
def pp4_results():
    return run_on_ranks(pp4_body, 4, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("layout", PP4, ids=lambda x: f"{x[0]}-{'fp8' if x[-1] else 'fp32'}")
def test_pp4_equals_one_process(pp4_results, layout):
    error = worst(compare(pp4_results, layout))
    assert error < 1e-5, error  # as for pp = 2
    check_pass_order_within_stages(pp4_results, layout)
    check_p2p_pairing(pp4_results, layout)


def test_1f1b_keeps_at_most_pp_micro_batches_in_flight(pp4_results):
    pp = 4
    for rank, result in enumerate(pp4_results):
        live = result["live"]
        assert live[(1, 8)] == pp - rank  # the first stage holds pp, whatever the micro-batch count
        assert live[(1, 2)] == min(pp - rank, 2)
        # Interleaved (Megatron's warm-up): (pp - rank - 1) * 2 + (vpp - 1) * pp + 1 passes, or all
        # of them when num_micro_batches == pp.
        assert live[(2, 8)] == (pp - rank - 1) * 2 + pp + 1
        assert live[(2, 4)] == 2 * 4


@pytest.mark.parametrize("vpp", [1, 2])
def test_overlapped_p2p_on_a_ring_of_four(pp4_results, vpp):
    """pp = 4 (the next and previous stage are different ranks): overlap_p2p_comm gives the same
    losses and gradients, bit for bit, through the same passes and transfers."""
    for result in pp4_results:
        (losses, grads, stats), (o_losses, o_grads, o_stats) = (
            result["runs"][(vpp, 8, overlap)] for overlap in (False, True)
        )
        assert [loss.item() for loss in losses] == [loss.item() for loss in o_losses]
        assert all(torch.equal(a, b) for a, b in zip(grads, o_grads, strict=True))
        for key in ("order", "p2p", "max_live_forwards"):
            assert stats[key] == o_stats[key], key


def test_sent_outputs_keep_no_values(pp4_results):
    """Megatron's deallocate_output_tensor: an output sent to the next stage keeps one element
    until its backward (which the equality tests above run from its gradient edge)."""
    for rank, result in enumerate(pp4_results):
        for (vpp, num), sizes in result["sent_sizes"].items():
            # The last rank sends nothing without virtual stages; every other output was freed.
            assert sizes == ([] if vpp == 1 and rank == 3 else [1]), (rank, vpp, num, sizes)


# -- tp2 x pp2 x dp2, sequence parallel, FP8 on and off: 8 processes ------------------------------

PP_TP_DP = [("gpt-tiny", 2, 2, vpp, True, fp8) for vpp in (1, 2) for fp8 in (False, True)]


def test_tp2_pp2_dp2_equals_one_process():
    results = run_on_ranks(layout_body, 8, PP_TP_DP, timeout_s=TIMEOUT_S)
    for layout in PP_TP_DP:
        errors = compare(results, layout, tp=2)
        if not layout[-1]:
            assert worst(errors) < 1e-5, (layout, errors)  # the same sums in another order
        else:
            # FP8, first step: the same weights, the same scales (amaxes MAX-reduced over tp x dp
            # see exactly the reference's concatenated micro-batch; the dp ranks' gradients are
            # 2x the reference's, a power of two the scale absorbs exactly) and the same values up
            # to tensor-parallel sums in another order. Such a difference can move a value across
            # an FP8 rounding boundary, and one flip in these tiny tensors moves a gradient by
            # ~1e-3; here none happens (measured ~1e-6), and 1e-4 would catch a real mismatch.
            assert errors["per_parameter"][0] < 1e-4, (layout, errors)
            # Later steps start from weights that differ in the last bits (the sums above),
            # which with these tiny models redraws FP8's rounding noise: perturbing the
            # reference's weights by 1e-7 (relative) moves its gradients by 80% of FP8's own
            # error. So gradients are only held to FP8's own error (FP8 against fp32, same
            # steps, all gradients together); the losses stay close (measured ~1e-5).
            own = fp8_own_error("gpt-tiny", dp=2)
            assert all(e < o for e, o in zip(errors["together"][1:], own[1:])), (
                layout,
                errors,
                own,
            )
            assert errors["loss"] < 1e-3, (layout, errors)
        collectives = check_pass_order_within_stages(results, layout)
        if layout[-1]:  # one forward and one backward reduction per micro-batch and chunk
            assert all(
                n == 2 * NUM_MICRO_BATCHES * layout[3] * (STEPS + 1) - NUM_MICRO_BATCHES * layout[3]
                for n in collectives.values()
            ), collectives
        check_p2p_pairing(results, layout)


# -- layouts and arguments (no processes) ----------------------------------------------------------


def test_stage_layers():
    assert stage_layers(8, 2, 0) == [(0, 4)] and stage_layers(8, 2, 1) == [(4, 8)]
    assert stage_layers(8, 2, 0, vpp=2) == [(0, 2), (4, 6)] and stage_layers(8, 2, 1, vpp=2) == [
        (2, 4),
        (6, 8),
    ]
    spans = [stage_layers(10, 4, r, first_stage_layers=1, last_stage_layers=3) for r in range(4)]
    assert spans == [[(0, 1)], [(1, 4)], [(4, 7)], [(7, 10)]]
    assert [stage_layers(7, 2, r, last_stage_layers=3) for r in range(2)] == [[(0, 4)], [(4, 7)]]
    assert stage_layers(5, 1, 0) == [(0, 5)]
    # Virtual stages: the first and last virtual stage (chunk 0 of rank 0, last chunk of the last rank).
    assert stage_layers(8, 2, 0, vpp=2, first_stage_layers=2, last_stage_layers=2) == [
        (0, 2),
        (4, 6),
    ]
    # Half layers: a stage ends after a layer's attention, the next begins at its MLP.
    spans = [
        stage_layers(24, 2, r, 2, first_stage_layers=6.5, last_stage_layers=5.5) for r in (0, 1)
    ]
    assert spans == [[(0, 6.5), (12.5, 18.5)], [(6.5, 12.5), (18.5, 24)]]
    # Every stage's layers given: a middle stage may start at a layer's MLP.
    layout = (3, 3.5, 3.5, 3, 3, 3, 3, 2)
    spans = [stage_layers(24, 2, r, 4, layout=layout) for r in (0, 1)]
    assert spans == [
        [(0, 3), (6.5, 10), (13, 16), (19, 22)],
        [(3, 6.5), (10, 13), (16, 19), (22, 24)],
    ]
    assert layer_parts(6.5, 9) == [(6, ("mlp",)), (7, LAYER_PARTS), (8, LAYER_PARTS)]
    assert layer_parts(0, 1.5) == [(0, LAYER_PARTS), (1, ("attention",))]
    assert layer_parts(2.5, 3) == [(2, ("mlp",))]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (10, 4, 0),
            r"num_layers=10 does not split evenly over pp=4 pipeline stages \(10 % 4 = 2\)",
        ),
        (
            (10, 2, 0, 2),
            r"num_layers=10 does not split evenly over pp=2 x vpp=2 = 4 pipeline stages",
        ),
        ((3, 4, 0), r"num_layers=3 .* fewer layers than stages"),
        (
            (10, 4, 0, 1, 2),
            r"the 8 layers left after first_stage_layers=2 do not split evenly over the other 3",
        ),
        ((4, 2, 0, 1, 0), r"first_stage_layers must be a positive int or half-int"),
        ((4, 2, 0, 1, 1.25), r"first_stage_layers must be a positive int or half-int"),
        (
            (10, 4, 0, 1, 1.5),
            r"the 8.5 layers left after first_stage_layers=1.5 do not split evenly over the other 3",
        ),
        ((4, 2, 2), r"pp_rank must be an int in 0..1"),
        ((4, 2, 0, 1, 1, 1), r"add up to 2 layers, but the model has num_layers=4"),
        (
            (4, 2, 0, 2, None, None, (1, 1, 2)),
            r"layout has 3 stages' layers \(1, 1, 2\), but there are 4",
        ),
        ((4, 2, 0, 1, None, None, (1.5, 3)), r"layout adds up to 4.5 layers \(1.5 \+ 3\)"),
        ((4, 2, 0, 1, None, None, (4, 0)), r"layout\[1\] must be a positive int or half-int"),
        ((4, 2, 0, 1, 2, None, (2, 2)), r"give it or first_stage_layers / last_stage_layers"),
    ],
)
def test_stage_layers_errors(args, message):
    with pytest.raises(ValueError, match=message):
        stage_layers(*args)


def test_balanced_stage_split_evens_out_the_ranks_work():
    from megafp8.parallel import balanced_stage_split

    # GPT-1.3B, pp 2 x vpp 2, the output layer ~1.7 layers' work: 6, 6, 6, 6 left the last rank
    # 13.7 layers against 12; 7, 6, 6, 5 gives 13 and 12.7.
    assert balanced_stage_split(24, 2, vpp=2, output_layer_cost=1.7) == (7, 5)
    assert balanced_stage_split(24, 2, output_layer_cost=1.7) == (13, 11)
    assert balanced_stage_split(24, 4, vpp=2, output_layer_cost=1.7) == (4, 2)
    # A stage ends inside a layer only where that lightens the busiest rank: with the output layer
    # at 1.3 layers, 12.5 and 12.8 layers' work instead of 13 and 12.3; Llama-2-7B's 32 layers at
    # 0.8, 16.5 and 16.3 instead of 16 and 16.8.
    assert balanced_stage_split(24, 2, vpp=2, output_layer_cost=1.3) == (6.5, 5.5)
    assert balanced_stage_split(24, 2, vpp=4, output_layer_cost=1.3) == (3.5, 2.5)
    assert balanced_stage_split(32, 2, vpp=2, output_layer_cost=0.8) == (8.5, 7.5)
    # Where moving any part costs the first rank more than it saves the last, the split stays even.
    assert balanced_stage_split(32, 2, vpp=2, output_layer_cost=0.4) == (None, None)
    assert balanced_stage_split(24, 2, vpp=2) == (None, None)
    assert balanced_stage_split(24, 1) == (None, None)
    # Not divisible evenly: the least uneven split that stage_layers accepts.
    first, last = balanced_stage_split(6, 2, vpp=2)
    spans = [stage_layers(6, 2, rank, 2, first, last) for rank in range(2)]
    assert (
        sorted(span for rank in spans for span in rank)[0][0] == 0
        and max(e for r in spans for _, e in r) == 6
    )
    # 3 layers over 4 stages: 0.5, 1, 1, 0.5; one layer cannot fill four halves
    assert balanced_stage_split(3, 2, vpp=2) == (0.5, 0.5)
    with pytest.raises(ValueError, match="num_layers=1 cannot be split over pp=2 x vpp=2"):
        balanced_stage_split(1, 2, vpp=2)
    with pytest.raises(ValueError, match="output_layer_cost"):
        balanced_stage_split(24, 2, output_layer_cost=-1)


def fake_groups(pp, tp=1):
    return types.SimpleNamespace(pp_size=pp, pp_rank=0, tp_size=tp)


def test_schedule_argument_errors():
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    shape = dict(
        data_iterator=[],
        forward_step=None,
        seq_length=16,
        micro_batch_size=1,
        hidden_size=8,
        dtype=torch.float32,
    )
    with pytest.raises(
        ValueError,
        match=r"num_micro_batches divisible by the pipeline-parallel size: "
        r"num_micro_batches=5 % pp=2 = 1",
    ):
        forward_backward(None, chunks, num_micro_batches=5, groups=fake_groups(2), **shape)
    with pytest.raises(
        ValueError, match="num_micro_batches divisible .* num_micro_batches=6 % pp=4 = 2"
    ):
        forward_backward(
            "interleaved_1f1b", chunks, num_micro_batches=6, groups=fake_groups(4), **shape
        )
    with pytest.raises(ValueError, match="needs pipeline parallelism"):
        forward_backward("interleaved_1f1b", chunks, num_micro_batches=4, groups=None, **shape)
    with pytest.raises(ValueError, match="no_pipelining schedule runs one model chunk"):
        forward_backward(
            "no_pipelining", chunks[0], num_micro_batches=4, groups=fake_groups(2), **shape
        )
    with pytest.raises(ValueError, match="1f1b schedule runs one model chunk per rank"):
        forward_backward("1f1b", chunks, num_micro_batches=4, groups=fake_groups(2), **shape)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'gpipe'"):
        forward_backward("gpipe", chunks, num_micro_batches=4, groups=fake_groups(2), **shape)
    with pytest.raises(ValueError, match="num_micro_batches must be a positive int"):
        forward_backward(None, chunks[0], num_micro_batches=0, groups=None, **shape)
    with pytest.raises(ValueError, match="data_iterator ran out after 1 of num_micro_batches=2"):
        forward_backward(
            None,
            chunks[0],
            num_micro_batches=2,
            groups=None,
            **{
                **shape,
                "data_iterator": [torch.ones(2)],
                "forward_step": lambda c, m, x, b: m(b).sum(),
            },
        )


def test_tensor_shape_and_its_check():
    assert pipeline_tensor_shape(16, 2, 64) == (16, 2, 64)
    assert pipeline_tensor_shape(16, 2, 64, tp_size=4, sequence_parallel=True) == (4, 2, 64)
    assert pipeline_tensor_shape(16, 2, 64, tp_size=4) == (16, 2, 64)
    with pytest.raises(ValueError, match="seq_length=18 does not split over tp_size=4"):
        pipeline_tensor_shape(18, 2, 64, tp_size=4, sequence_parallel=True)
    groups = types.SimpleNamespace(
        pp_group=None, pp_size=1, pp_ranks=(0,), next_stage_rank=0, prev_stage_rank=0
    )
    p2p = P2PCommunicator(groups, (4, 2, 64), torch.float32, "cpu")
    with pytest.raises(
        ValueError, match=r"output activation has shape \(16, 2, 64\) .* exchanges \(4, 2, 64\)"
    ):
        p2p.communicate(send_next=torch.zeros(16, 2, 64))


def check_embeddings_body(rank):
    """check_embeddings_in_sync passes on a fresh model and finds a difference in one copy."""
    groups = ParallelGroups(1, 2)
    config = config_of("gpt-tiny")
    chunk = TransformerLM(config, layers=stage_layers(LAYERS, 2, groups.pp_rank)[0], seed=SEED)
    assert check_embeddings_in_sync(chunk, groups) == 0.0
    if rank == 1:
        with torch.no_grad():
            chunk.embedding.weight[3, 5] += 0.25
    with pytest.raises(RuntimeError, match=r"tied embedding differs .* largest difference 0.25"):
        check_embeddings_in_sync(chunk, groups)
    return True


def test_check_embeddings_in_sync_finds_a_difference(pp2_results):
    assert [r["embedding_check"] for r in pp2_results] == [True, True]


# -- over NCCL (needs CUDA GPUs) --------------------------------------------------------------------

GPU_LAYOUTS = {
    2: [
        (name, 1, 2, vpp, False, fp8)
        for name in ("gpt-tiny", "llama-tiny")
        for vpp in (1, 2)
        for fp8 in (False, True)
    ],
    4: [("gpt-tiny", 1, 4, vpp, False, fp8) for vpp in (1,) for fp8 in (False, True)]
    + [("gpt-tiny", 2, 2, vpp, True, fp8) for vpp in (1, 2) for fp8 in (False, True)],
}


def gpu_body(rank, world_size, layouts):
    out = {"layouts": layout_body(rank, world_size, layouts, device="cuda")}
    if rank == 0:  # the one-GPU references
        out["refs"] = {
            (name, fp8, dp): reference(name, fp8, dp, "cuda")
            for name, fp8, dp in {(x[0], x[-1], world_size // (x[1] * x[2])) for x in layouts}
        }
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_over_nccl_equals_one_gpu(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    layouts = GPU_LAYOUTS[world_size]
    results = run_on_ranks(gpu_body, world_size, layouts, backend="nccl", timeout_s=TIMEOUT_S)
    refs = results[0]["refs"]
    per_rank = [r["layouts"] for r in results]
    for layout in layouts:
        dp = world_size // (layout[1] * layout[2])
        errors = compare(per_rank, layout, tp=layout[1], ref=refs[(layout[0], layout[-1], dp)])
        check_pass_order_within_stages(per_rank, layout)
        check_p2p_pairing(per_rank, layout)
        # The first step: the same operations on the same values (fp32 on the GPU; another
        # summation order with tp, and atomics in the embedding's backward). Later FP8 steps
        # are held to the losses only (see test_tp2_pp2_dp2_equals_one_process).
        assert errors["per_parameter"][0] < 1e-4, (layout, errors)
        assert errors["loss"] < 1e-3, (layout, errors)
        if not layout[-1]:
            assert max(errors["per_parameter"]) < 1e-4, (layout, errors)
