"""What CUDA-graph replays rely on in the FP8 core, checked on the CPU (the graphs themselves,
graphed training equal to eager bit for bit, are GPU tests in tests/training/test_cuda_graphs.py):
recording a pass's amaxes flushes nothing, and recording them again reproduces the pass; a
graphed layer's weight cast is refreshed in place; micro-batches in flight take slots."""

import torch
from megafp8.parallel.cuda_graphs import MicroBatchSlots

from megafp8 import DelayedScaling, Fp8Linear, fp8_autocast, quantize
from megafp8.fp8.autocast import (
    current_fp8_context,
    record_amaxes,
    replay_backward_amaxes,
    replay_forward_amaxes,
)

RECIPE = DelayedScaling(amax_history_len=4)


def layer_and_batches():
    torch.manual_seed(3)
    layer = Fp8Linear(32, 48)
    g = torch.Generator().manual_seed(4)
    batches = [
        (torch.randn(16, 32, generator=g) * (i + 1), torch.randn(16, 48, generator=g))
        for i in range(3)
    ]
    return layer, batches


def state_of(layer):
    return [
        (t.clone(), s.update_count)
        for s in layer.fp8_scaling.values()
        for t in (s.scale, s.amax_history)
    ]


class _ReplayBackwardAmaxes(torch.autograd.Function):
    """Identity whose backward records what a recorded backward observed, as a graph replay does."""

    @staticmethod
    def forward(ctx, y, observations):
        ctx.observations = observations
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        replay_backward_amaxes(ctx.observations)
        return grad, None


def test_recorded_amaxes_replayed_into_the_passes_equal_the_eager_passes():
    eager, batches = layer_and_batches()
    recorded, _ = layer_and_batches()
    for layer in (eager, recorded):  # a capture follows an eager pass: the histories are not empty
        with fp8_autocast(recipe=RECIPE):
            y = layer(batches[0][0])
        y.backward(batches[0][1])
    for x, dy in batches[1:]:
        with fp8_autocast(recipe=RECIPE):
            y_eager = eager(x)
        y_eager.backward(dy)

        with fp8_autocast(recipe=RECIPE):
            before = state_of(recorded)
            with record_amaxes(current_fp8_context()) as recording:
                h = x.clone().requires_grad_(True)
                y = recorded(h)
                # a captured backward
                torch.autograd.grad(y, (h, recorded.weight, recorded.bias), dy)
            forward, backward = recording.take()
            for (a, n), (b, m) in zip(before, state_of(recorded)):
                assert torch.equal(a, b) and n == m, "recording flushed something"
            assert {id(o.state) for o in forward} == {
                id(recorded.fp8_scaling[r]) for r in ("input", "weight")
            }
            assert [id(o.state) for _, obs in backward for o in obs] == [
                id(recorded.fp8_scaling["grad_output"])
            ]
            replay_forward_amaxes(current_fp8_context(), forward)
            out = _ReplayBackwardAmaxes.apply(y.detach().requires_grad_(True), backward)
        out.backward(dy)
        assert torch.equal(y, y_eager)
        for (a, n), (b, m) in zip(state_of(eager), state_of(recorded)):
            assert torch.equal(a, b) and n == m


def test_quantize_into_an_earlier_cast_overwrites_it_in_place():
    g = torch.Generator().manual_seed(5)
    first = quantize(torch.randn(24, 40, generator=g), torch.float8_e4m3fn, columnwise=True)
    x = torch.randn(24, 40, generator=g) * 9
    again = quantize(x, torch.float8_e4m3fn, columnwise=True, out=first)
    fresh = quantize(x, torch.float8_e4m3fn, columnwise=True)
    for name in ("data", "data_t", "scale_inv"):
        assert getattr(again, name).data_ptr() == getattr(first, name).data_ptr()
        assert torch.equal(
            getattr(again, name).view(torch.uint8) if name != "scale_inv" else again.scale_inv,
            getattr(fresh, name).view(torch.uint8) if name != "scale_inv" else fresh.scale_inv,
        )


def test_a_graphed_layer_refreshes_its_weight_cast_in_place_and_an_eager_one_in_new_buffers():
    for graphed in (True, False):
        layer, batches = layer_and_batches()
        layer.keep_weight_cast_addresses = graphed
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        addresses = []
        for x, dy in batches:
            with fp8_autocast(recipe=RECIPE):
                # nothing cached before the first pass
                layer.refresh_weight_cast(current_fp8_context())
                layer(x).backward(dy)
            optimizer.step()
            with fp8_autocast(recipe=RECIPE):
                scale = layer.fp8_scaling["weight"].scale.clone()  # the pass's end updates it
                layer.refresh_weight_cast(current_fp8_context())  # the step's new weights, cast now
                cast = layer._weight_fp8[1]
            expected = quantize(layer.weight.detach(), torch.float8_e4m3fn, scale, columnwise=True)
            assert torch.equal(cast.data.view(torch.uint8), expected.data.view(torch.uint8))
            addresses.append(cast.data_t.data_ptr())
        assert (len(set(addresses)) == 1) == graphed


def slots_of(order):
    """Run a schedule's order ("F" forward, "B" backward of the oldest in flight) through
    MicroBatchSlots: (slot, follows another) of each forward."""
    slots, in_flight, taken = MicroBatchSlots(), [], []
    for op in order:
        if op == "F":
            taken.append(slots.take())
            in_flight.append(taken[-1][0])
        else:
            slots.release(in_flight.pop(0))
    return taken, len(slots.busy)


def test_micro_batches_in_flight_take_slots_and_only_the_first_backward_overwrites():
    # Gradient accumulation: one micro-batch at a time, one slot, every forward's own emptiness.
    assert slots_of("FBFBFB") == ([(0, False)] * 3, 1)
    # 1F1B on the first of two stages: one warm-up forward, then one forward, one backward.
    assert slots_of("FFBFBFBB") == ([(0, False), (1, True), (0, True), (1, True)], 2)
    # The first of four stages: three warm-up forwards, four slots; once all are done, the next
    # forward finds none in flight and is keyed on the emptiness it sees.
    taken, count = slots_of("FFFFBFBBBB" + "FB")
    assert count == 4 and taken[:5] == [(0, False), (1, True), (2, True), (3, True), (0, True)]
    assert taken[5] == (0, False)
