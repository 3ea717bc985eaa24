"""The pipeline schedules' transfers, checked without processes for many more layouts than the
gloo tests run: each rank's schedule runs against a recording stand-in for its step, then the
ranks' transfers are paired as NCCL pairs them (in posting order between two ranks, whatever
their kind) and played out as NCCL runs them (one in-order stream per rank's communicator; a
send completes only once its receive is posted). Every pass must get the tensor its neighbouring
virtual stage made for the same micro-batch, and every step must finish, waiting per exchange
(`communicate`) and posted (`overlap_p2p_comm`), also the step that captures the CUDA graphs,
where each capture first synchronizes the device (waits for every transfer posted)."""

import itertools

import pytest
from megafp8.parallel import schedules
from megafp8.parallel.cuda_graphs import MicroBatchSlots


class Receive:
    """A posted receive; `value` is what the matching send carried, once paired."""

    def __init__(self):
        self.value = None


EVERY_KIND = ("activations", "gradients", "both")


class RecordingStep:
    """What a schedule calls on its step, recorded: each pass with the tensor it was given, and
    each exchange as `_Step` posts and waits for them (posted: activations, then gradients, a
    forward waiting for every activation exchange posted before it and a backward for every
    gradient exchange; waiting: one exchange, waited for at once)."""

    def __init__(self, pp: int, rank: int, chunks: int, num: int, overlap: bool):
        self.pp, self.pp_rank, self.forward_only = pp, rank, False
        self.chunks, self.num_micro_batches, self.overlap_p2p_comm = [None] * chunks, num, overlap
        self.passes, self.events = [], []  # events: ("post", kind, ops) and ("wait", kinds)

    def before_forward(self, chunk) -> None:
        """What runs on the host before a forward's pass (the capturing step's captures)."""

    def is_first(self, chunk):
        return self.pp_rank == 0 and chunk == 0

    def is_last(self, chunk):
        return self.pp_rank == self.pp - 1 and chunk == len(self.chunks) - 1

    def stage(self, chunk):
        return chunk * self.pp + self.pp_rank

    def forward(self, chunk, index, input_tensor):
        self.before_forward(chunk)
        self.events.append(("wait", ("activations", "both")))
        self.passes.append(("F", self.stage(chunk), index, input_tensor))
        return ("activation", self.stage(chunk), index)

    def backward(self, chunk, index, input_tensor, output, output_grad):
        self.events.append(("wait", ("gradients", "both")))
        self.passes.append(("B", self.stage(chunk), index, output_grad))
        return ("gradient", self.stage(chunk), index)

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False, **_):
        following, preceding = (self.pp_rank + 1) % self.pp, (self.pp_rank - 1) % self.pp
        activation = Receive() if recv_prev else None
        gradient = Receive() if recv_next else None
        activations = [("send", following, send_next)] if send_next is not None else []
        activations += [("recv", preceding, activation)] if recv_prev else []
        gradients = [("send", preceding, send_prev)] if send_prev is not None else []
        gradients += [("recv", following, gradient)] if recv_next else []
        if self.overlap_p2p_comm:
            self.events += [("post", "activations", activations), ("post", "gradients", gradients)]
        else:
            self.events += [("post", "both", activations + gradients), ("wait", ("both",))]
        return activation, gradient

    def finish(self):
        self.events.append(("wait", EVERY_KIND))
        return []


class CapturingStep(RecordingStep):
    """The step that captures the layers' CUDA graphs: a forward with a graph signature not seen
    before (its chunk's micro-batch slot and whether another micro-batch is in flight, as
    megafp8.parallel.cuda_graphs.LayerGraphs keys them) captures first, and torch.cuda.graph
    synchronizes the device before a capture: the host waits for every transfer posted so far,
    sends whose peer has not posted the receive included."""

    def __init__(self, *args):
        super().__init__(*args)
        self.slots = [MicroBatchSlots() for _ in self.chunks]
        self.in_flight = [[] for _ in self.chunks]  # each chunk's slots, oldest first
        self.captured = set()  # the graph signatures captured

    def before_forward(self, chunk):
        slot, follows_another = self.slots[chunk].take()
        self.in_flight[chunk].append(slot)
        if (chunk, slot, follows_another) not in self.captured:
            self.captured.add((chunk, slot, follows_another))
            self.events.append(("wait", EVERY_KIND))

    def backward(self, chunk, index, *args):
        self.slots[chunk].release(self.in_flight[chunk].pop(0))
        return super().backward(chunk, index, *args)


def record(schedule, pp: int, chunks: int, num: int, overlap: bool, kind=RecordingStep) -> list:
    steps = [kind(pp, rank, chunks, num, overlap) for rank in range(pp)]
    for step in steps:
        schedule(step)
    return steps


def check_pairing_and_inputs(steps) -> None:
    """Pair sends and receives in order between each two ranks; every pass's input is the output
    of the neighbouring stage for the same micro-batch."""
    pp = len(steps)
    for a, b in itertools.product(range(pp), repeat=2):
        sent = [
            op[2] for s in steps[a].events if s[0] == "post" for op in s[2] if op[:2] == ("send", b)
        ]
        received = [
            op[2] for s in steps[b].events if s[0] == "post" for op in s[2] if op[:2] == ("recv", a)
        ]
        assert len(sent) == len(received), (a, b, len(sent), len(received))
        for tensor, receive in zip(sent, received):
            receive.value = tensor
    last_stage = pp * len(steps[0].chunks) - 1
    for step in steps:
        for kind, stage, index, given in step.passes:
            if kind == "F":
                wanted = None if stage == 0 else ("activation", stage - 1, index)
            else:
                wanted = None if stage == last_stage else ("gradient", stage + 1, index)
            got = given.value if isinstance(given, Receive) else given
            assert got == wanted, (step.pp_rank, kind, stage, index, got, wanted)


def finishes(steps) -> bool:
    """Play the exchanges out as NCCL runs them; False where every rank waits on another."""
    pp = len(steps)
    posted: dict = {}  # (sender, receiver) -> {"send": n, "recv": n} posted so far
    queues = [[] for _ in range(pp)]  # each rank's exchanges: (kind, [(pair, op, index)])
    completed, position = [0] * pp, [0] * pp

    def paired(ops) -> bool:
        other = {"send": "recv", "recv": "send"}
        return all(posted[pair][other[op]] > index for pair, op, index in ops)

    while True:
        progress = False
        for rank, step in enumerate(steps):
            queue = queues[rank]
            while completed[rank] < len(queue) and paired(queue[completed[rank]][1]):
                completed[rank] += 1  # in order: one stream per communicator
                progress = True
            while position[rank] < len(step.events):
                event = step.events[position[rank]]
                if event[0] == "post":
                    ops = []
                    for op, peer, _ in event[2]:
                        pair = (rank, peer) if op == "send" else (peer, rank)
                        counts = posted.setdefault(pair, {"send": 0, "recv": 0})
                        ops.append((pair, op, counts[op]))
                        counts[op] += 1
                    queue.append((event[1], ops))
                else:
                    waited = [i for i, (kind, _) in enumerate(queue) if kind in event[1]]
                    if waited and completed[rank] <= waited[-1]:
                        break
                position[rank] += 1
                progress = True
        if all(position[rank] == len(step.events) for rank, step in enumerate(steps)):
            return True
        if not progress:
            return False


LAYOUTS = [
    (schedules.interleaved_one_f_one_b, pp, chunks, pp * multiple)
    for pp in (2, 3, 4)
    for chunks in (2, 3, 4)
    for multiple in (1, 2, 3)
] + [(schedules.one_f_one_b, pp, 1, num) for pp in (2, 3, 4) for num in (1, 2, 3, 5, 8)]


@pytest.mark.parametrize("step", [RecordingStep, CapturingStep], ids=["eager", "capturing"])
@pytest.mark.parametrize("overlap", [False, True], ids=["waiting", "posted"])
@pytest.mark.parametrize(
    "schedule, pp, chunks, num",
    LAYOUTS,
    ids=[f"{s.__name__}-pp{pp}-vpp{c}-m{n}" for s, pp, c, n in LAYOUTS],
)
def test_every_pass_gets_its_input_and_the_step_finishes(schedule, pp, chunks, num, overlap, step):
    """Also the step that captures the CUDA graphs: a schedule that keeps more sends ahead of its
    peer's receives than the captures let it would hang there on the GPU though eager steps run."""
    steps = record(schedule, pp, chunks, num, overlap, step)
    check_pairing_and_inputs(steps)
    if step is CapturingStep:
        # every chunk captures; the first rank keeps several micro-batches in flight, a slot each
        assert all(len(s.captured) >= chunks for s in steps)
        assert len(steps[0].captured) > chunks or num == 1
    assert finishes(steps)


def test_the_check_finds_a_deadlock():
    """The play-out is not vacuous: two ranks that each wait for their own receive before
    posting the send the other waits for never finish."""
    steps = [RecordingStep(2, rank, 1, 1, overlap=False) for rank in range(2)]
    for rank, step in enumerate(steps):
        step.events = [
            ("post", "both", [("recv", 1 - rank, Receive())]),
            ("wait", ("both",)),
            ("post", "both", [("send", 1 - rank, ("activation", rank, 0))]),
            ("wait", ("both",)),
        ]
    assert not finishes(steps)
