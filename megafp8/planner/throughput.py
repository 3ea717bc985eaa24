"""Step time and tokens/s per GPU of a training layout, predicted from measurements only (the
planner's throughput model, tools/plan_parallel.py).

Inputs, each measured on the GPUs the plan is for:
- layer maps from `benchmarks/bench_layer_grid.py --model PRESET`: one layer's forward +
  backward and forward alone, and the model's output end (embedding, final norm, output layer,
  loss), per sequence length, micro-batch, tensor-parallel size and precision; a tp > 1 point is
  measured on that many GPUs, so its collectives (sequence-parallel gathers and scatters, FP8's
  amax reductions) are in it; and the device's copy bandwidth;
- collective bandwidths from `benchmarks/bench_collectives.py` (all-reduce, all-gather,
  reduce-scatter, point-to-point; per group size and message size).

The model, per rank of the slowest pipeline stage (micro-batch time t = its layers' time, each
layer's forward once more under full recomputation, plus the output end on the last stage, plus
its point-to-point sends where they outlast the pass beside them; a layer's time is the graphed
GPU time where the trainer can use CUDA graphs (no pipeline parallelism: the layout assumes
--enable-cuda-graph); an eager stage, a pipeline's, takes the longer of its layers' GPU time and
the host's (the pass's own host time plus each layer's share, both measured on a stack of layers;
a map without that split: each layer at a one-layer step's host time); the output end's few large kernels are taken
at their GPU time either way):
- the 1F1B schedule: m micro-batches take (m + (pp - 1) / vpp) x t, the bubble Megatron's
  interleaved schedule leaves;
- data parallelism: the gradients' all-reduce (fp32, or bf16 with --main-grads-dtype bf16; with
  the distributed optimizer a reduce-scatter), one per bucket of the trainer's default size, overlapped with the last micro-batch's backward as the trainer's buckets are:
  only what outlasts it counts; the distributed optimizer's all-gather of the bf16 parameters
  (FP8 primary weights in FP8) after its step, exposed, or with --overlap-param-gather (as the
  recipes run it) beside the next step's first forward: only what outlasts the stage's layers'
  forward counts;
- the optimizer: its fused pass reads and writes `optimizer_bytes_per_parameter` per element it
  updates (and `weight_cast_bytes` more per FP8 weight; with the distributed optimizer and FP8
  primary weights, each rank's copies and transposes of the gathered FP8 weights too, at their
  measured cost), at the measured copy bandwidth.
What is not measured is not guessed: a layout whose layer time (its tp, sequence length, a
micro-batch within the measured range) or whose collectives have no measurement is not predicted,
and says what to measure. Where the model stretches a measurement it says so in `extrapolated`:
a micro-batch between two measured ones (time linear in it), a message size or group size
outside the measured ones (the nearest one's bus bandwidth), a group spanning nodes (a node's
NVLink bandwidth, not the network's).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from megafp8.models.config import TransformerConfig
from megafp8.parallel.data_parallel import DEFAULT_BUCKET_SIZE

from . import layer_map
from .memory import STATE_BYTES, MemoryLayout, rank_parameters, stage_layer_count

# The fused AdamW pass per element it updates, with the default states
# (`optimizer_bytes_per_parameter`); under FP8 it also writes each FP8 weight's casts, both
# orientations (2).
OPTIMIZER_BYTES_PER_PARAMETER = 30
OPTIMIZER_BYTES_PER_FP8_WEIGHT = 2
PARAMETER_WRITE_BYTES = 2  # the bf16 parameter the pass writes, part of the 30
# With the distributed optimizer an FP8 primary weight's slice is written as its 1-byte cast, and
# every rank copies the gathered bytes into each weight and makes its transpose (torch's
# transposed byte copy): measured on one H200 at dp 1, 7.1 ms a step more than bf16 weights for
# the 7b shape's 1.61B FP8 weights, what 22 bytes a weight cost at the copy bandwidth, the bf16
# path's modelled cast (2) and the slice's (-1) counted (benchmarks/RESULTS.md, Memory).
FP8_SLICE_WRITE_BYTES = 1
GATHERED_FP8_WEIGHT_BYTES = 22
# With lean states, or a recipe other than delayed scaling (whose scale the pass knows ahead),
# the forward casts the new weight instead: the bf16 weight read, both layouts written.
FORWARD_CAST_BYTES_PER_FP8_WEIGHT = 4


def weight_cast_bytes(layout: MemoryLayout) -> int:
    """Bytes a step spends per FP8 weight element on its new cast: written by the optimizer pass
    under delayed scaling, else (lean states; current, rowwise or blockwise scaling) by the
    forward (megafp8.training.optimizer); an FP8 primary weight's cast is the weight, written by
    the pass in place of the bf16 weight that `optimizer_bytes_per_parameter` counts."""
    if layout.fp8_primary_weights and layout.distributed_optimizer:
        return FP8_SLICE_WRITE_BYTES - PARAMETER_WRITE_BYTES
    if layout.fp8_primary_weights:
        return OPTIMIZER_BYTES_PER_FP8_WEIGHT - PARAMETER_WRITE_BYTES
    forward_casts = layout.lean_states or layout.fp8 not in (None, "delayed")
    return FORWARD_CAST_BYTES_PER_FP8_WEIGHT if forward_casts else OPTIMIZER_BYTES_PER_FP8_WEIGHT


def optimizer_bytes_per_parameter(layout: MemoryLayout) -> float:
    """What the fused AdamW pass reads and writes per element it updates: the master, exp_avg
    and exp_avg_sq read and written, the gradient read, the bf16 parameter written (fp32 states:
    24 + 4 + 2 = OPTIMIZER_BYTES_PER_PARAMETER); with remainders the master is the 2-byte
    remainder, and the parameter, its high half, is read too."""
    moments = STATE_BYTES[layout.exp_avg_dtype] + STATE_BYTES[layout.exp_avg_sq_dtype]
    master = 2 + 2 + 2 if layout.store_param_remainders else 4 + 4
    return 2 * moments + master + STATE_BYTES[layout.main_grads_dtype] + PARAMETER_WRITE_BYTES


# nccl-tests' bus-bandwidth factors: bytes moved per byte of the message, per rank.
BUS_FACTOR = {
    "all_reduce": lambda k: 2 * (k - 1) / k,
    "all_gather": lambda k: (k - 1) / k,
    "reduce_scatter": lambda k: (k - 1) / k,
    "send_recv": lambda k: 1.0,
}


class NotPredicted(Exception):
    """A layout the measurements do not cover; the message says what to measure."""


UNKNOWN_DEVICE = "unknown device"  # a measurement file that does not name its GPU


@dataclass
class Calibration:
    """The measurements the model reads: layer-map points and collective results."""

    points: list = field(default_factory=list)
    collectives: list = field(default_factory=list)
    copy_gbs: float | None = None
    sources: list = field(default_factory=list)
    devices: list = field(default_factory=list)  # the GPU of each file, in `sources`' order

    def mixed_devices(self, *others: str) -> str | None:
        """Why predictions from these measurements (and runs on `others`) would mix machines, or
        None when they all name one GPU: one machine's layers, collectives and host must not be
        read as another's (between an H100 host and an H200 host the jobs differed by 4-10%)."""
        named = sorted({device for device in [*self.devices, *others] if device != UNKNOWN_DEVICE})
        if len(named) < 2:
            return None
        return (
            f"the measurements come from different GPUs ({', '.join(named)}): measure the layer maps, "
            "the collectives and the runs compared with them on one machine"
        )

    @classmethod
    def load(cls, layer_maps=(), collectives=None) -> Calibration:
        calibration = cls()
        for path in layer_maps:
            data = layer_map.read(path)
            calibration.points += data["points"]
            calibration.copy_gbs = data.get("copy_gbs", calibration.copy_gbs)
            calibration.devices.append(data.get("device", UNKNOWN_DEVICE))
            calibration.sources.append(f"{path} ({calibration.devices[-1]})")
        if collectives is not None:
            data = layer_map.read_json(collectives)
            if not data.get("results"):
                raise ValueError(
                    f"{collectives}: no collective results in it "
                    f"(write one with benchmarks/bench_collectives.py)"
                )
            calibration.collectives = data["results"]
            calibration.devices.append(data.get("device", UNKNOWN_DEVICE))
            calibration.sources.append(
                f"{collectives} ({calibration.devices[-1]}, {data.get('gpus', '?')} GPUs)"
            )
        return calibration

    def _points_for(self, config: TransformerConfig, seq: int, tp: int) -> list:
        return sorted(
            (p for p in self.points if layer_map.same_layer(p, config, seq, tp)),
            key=lambda p: p["micro_batch"],
        )

    def layer(
        self,
        config: TransformerConfig,
        seq: int,
        micro_batch: int,
        tp: int,
        recipe: str,
        extrapolated: list,
        model: str = "PRESET",
    ) -> dict:
        """{"step": forward + backward ms, "forward": ms, "selective": the step with selective
        recomputation, "host": an eager step's host ms, "host_layer" and "host_pass": a stack's
        eager host ms per layer and per pass, "head": output-end ms} of one layer at this
        point (None for what the map lacks), between measured micro-batches if need be. The host
        times are the median over every measured micro-batch: the host launches the same kernels
        whatever their size, and one stack's split of ten steps is noisy (GPT-1.3B, 4 x H200:
        per-layer shares of 2.9-4.5 ms across micro-batches for the same launches)."""
        points = [
            p
            for p in self._points_for(config, seq, tp)
            if layer_map.measured(p, recipe) is not None
        ]
        if not points:
            raise NotPredicted(
                f"no measured {recipe} layer of this model at sequence {seq}, tp {tp} "
                f"(measure it: {'torchrun --nproc-per-node ' + str(tp) if tp > 1 else 'python'} "
                f"benchmarks/bench_layer_grid.py --model {model} --seq-lengths {seq} "
                f"--micro-batches {micro_batch}"
                + (f" --recipes bf16 {recipe}" if recipe in ("rowwise", "blockwise") else "")
                + ")"
            )
        below = [p for p in points if p["micro_batch"] <= micro_batch]
        above = [p for p in points if p["micro_batch"] >= micro_batch]
        if not below or not above:
            measured = ", ".join(str(p["micro_batch"]) for p in points)
            raise NotPredicted(
                f"micro-batch {micro_batch} is outside the measured ones ({measured}) of the "
                f"{recipe} layer at sequence {seq}, tp {tp}"
            )
        low, high = below[-1], above[0]
        if tp > 1 and not low.get("tp_comm_overlap"):
            extrapolated.append(
                f"tp {tp}: the layer measured without --tp-comm-overlap, which the recipes run "
                "(slower; measure the map again)"
            )
        share = (
            0.0
            if high is low
            else (micro_batch - low["micro_batch"]) / (high["micro_batch"] - low["micro_batch"])
        )
        if high is not low:
            extrapolated.append(
                f"micro-batch {micro_batch}: between the measured {low['micro_batch']} and "
                f"{high['micro_batch']}"
            )

        def between(kind):
            at_low, at_high = (
                layer_map.measured(low, recipe, kind),
                layer_map.measured(high, recipe, kind),
            )
            if at_low is None or at_high is None:
                return None
            return at_low + share * (at_high - at_low)

        # host work does not grow with the micro-batch: every measured one is a sample
        def pooled(
            kind,
        ):
            values = [
                v for v in (layer_map.measured(p, recipe, kind) for p in points) if v is not None
            ]
            return statistics.median(values) if values else None

        head = between("head")
        vocab = low.get("vocab", config.vocab_size)
        # the output layer and loss scale with it
        if head is not None and vocab != config.vocab_size:
            head *= config.vocab_size / vocab
            extrapolated.append(
                f"output end: measured with a {vocab}-token vocabulary, scaled to {config.vocab_size}"
            )
        return {
            "step": between("ms"),
            "forward": between("fwd_ms"),
            "selective": between("selective_ms"),
            "host": pooled("host_ms"),
            "host_layer": pooled("host_layer_ms"),
            "host_pass": pooled("host_pass_ms"),
            "head": head,
        }

    def collective_ms(
        self, op: str, group_size: int, nbytes: float, spans_nodes: bool, extrapolated: list
    ) -> float:
        """Time of one collective of `nbytes` over `group_size` ranks, from the measured bus
        bandwidth at that group size and the nearest message size (log scale); `spans_nodes`:
        the group's ranks are on more than one node, whose network was not measured."""
        if group_size == 1 or nbytes == 0:
            return 0.0
        results = [r for r in self.collectives if r["op"] == op]
        if not results:
            raise NotPredicted(
                f"no measured {op} (measure the collectives: torchrun --nproc-per-node N "
                f"benchmarks/bench_collectives.py --output collectives.json, then --collectives)"
            )
        sizes = sorted({r["group_size"] for r in results})
        size = group_size if group_size in sizes else max(sizes)
        if size != group_size:
            extrapolated.append(f"{op} over {group_size} ranks: the bandwidth measured over {size}")
        if spans_nodes:
            extrapolated.append(
                f"{op} over {group_size} ranks spans nodes: a node's bandwidth, the network's not measured"
            )
        at_size = [r for r in results if r["group_size"] == size]
        nearest = min(at_size, key=lambda r: abs(math.log(r["bytes"] / nbytes)))
        if not min(r["bytes"] for r in at_size) <= nbytes <= max(r["bytes"] for r in at_size):
            extrapolated.append(
                f"{op} of {nbytes / 2**20:.0f} MiB: the bandwidth measured at "
                f"{nearest['bytes'] / 2**20:.0f} MiB"
            )
        return nbytes * BUS_FACTOR[op](group_size) / (nearest["busbw_gbs"] * 1e6)


def predict(
    config: TransformerConfig,
    layout: MemoryLayout,
    calibration: Calibration,
    global_batch_size: int,
    gpus_per_node: int = 8,
    model: str = "PRESET",
    pipeline_graphs: bool = True,
) -> dict:
    """The predicted step of `layout`: {"step_ms", "tokens_per_s_per_gpu", "breakdown_ms",
    "extrapolated"}; raises NotPredicted where the measurements do not cover it, naming `model`
    (the preset) in the command that would measure what is missing. Layers run graphed, as the
    recipes run them (the trainer's --enable-cuda-graph); a pipeline's stages run eagerly where not
    `pipeline_graphs` (the recipes' CUDA_GRAPH=0)."""
    recipe = layout.fp8 or "bf16"
    extrapolated: list = []
    seq, mbs, tp, pp, dp, vpp = (
        layout.seq_length,
        layout.micro_batch_size,
        layout.tp,
        layout.pp,
        layout.dp,
        layout.vpp,
    )
    layer = calibration.layer(config, seq, mbs, tp, recipe, extrapolated, model)
    if layer["forward"] is None or layer["head"] is None:
        raise NotPredicted(
            f"the layer map at sequence {seq}, tp {tp} lacks the forward or output-end times "
            f"(measure with benchmarks/bench_layer_grid.py --model {model})"
        )
    per_layer = layer["step"] + (layer["forward"] if layout.recompute == "full" else 0.0)
    if layout.recompute == "selective":
        if layer["selective"] is not None:
            per_layer = layer["selective"]
        else:  # a map from before the map timed it
            extrapolated.append(
                "selective recomputation: the attention core's second forward is not in the map"
            )
    host_layer = host_pass = 0.0
    # an eager pipeline: a stage takes the longer of its GPU and host times
    if pp > 1 and not pipeline_graphs:
        if tp > 1 and recipe != "bf16":
            raise NotPredicted(
                "FP8 with tensor and pipeline parallelism, run eagerly, is host-bound: each stage "
                "waits on both ranks' hosts at every collective and send, which the map's layers "
                "timed alone do not show (measured 0.50-0.62x bf16 where the map said faster: "
                "docs/tuning.md); graphed, as the recipes run it, it is predicted"
            )
        if layer["host"] is None:
            raise NotPredicted(
                f"pipeline parallelism runs eagerly and the layer map at sequence {seq}, tp {tp} "
                f"lacks the host's time (measure with benchmarks/bench_layer_grid.py --model {model})"
            )
        host_layer, host_pass = layer["host_layer"], layer["host_pass"]
        if host_layer is None or host_pass is None:  # a map from before the stack's split
            host_layer, host_pass = layer["host"], 0.0
            extrapolated.append(
                "host time: a one-layer step's per layer (its pass's share counted in every layer)"
            )
        host_layer *= per_layer / layer["step"]
        if layout.recompute == "full":
            extrapolated.append(
                "full recomputation's host time: the step's, scaled by the forward's GPU share"
            )
    # Point-to-point: each micro-batch crosses every stage boundary forward and back, once per
    # chunk. With --overlap-p2p-communication (the trainer's default) a transfer runs beside the
    # rank's next pass: only what outlasts the shorter one, a chunk's forward, counts.
    transfer = 0.0
    if pp > 1:
        activation = (seq // tp if layout.sp else seq) * mbs * config.hidden_size * 2
        # Ranks go tp fastest, then dp, then pp: a stage's neighbour is tp x dp ranks away.
        transfer = calibration.collective_ms(
            "send_recv", 2, activation, tp * dp * pp > gpus_per_node, extrapolated
        )
    stage_ms, stage_p2p = [], []
    for pp_rank in range(pp):
        layers = stage_layer_count(config, layout, pp_rank)
        exposed = transfer
        if layout.overlap_p2p_comm:
            exposed = max(0.0, transfer - layers / vpp * layer["forward"])
        stage_p2p.append(2 * vpp * exposed)
        # a pass per chunk
        layer_ms = max(layers * per_layer, vpp * host_pass + layers * host_layer)
        stage_ms.append(layer_ms + (layer["head"] if pp_rank == pp - 1 else 0.0) + stage_p2p[-1])
    slowest = max(range(pp), key=lambda r: stage_ms[r])
    micro_batch_ms, p2p = stage_ms[slowest], stage_p2p[slowest]
    slowest_layers = stage_layer_count(config, layout, slowest)
    m = layout.num_micro_batches
    pipeline = (m + (pp - 1) / vpp) * micro_batch_ms
    bubble = (pp - 1) / vpp * micro_batch_ms

    counts = rank_parameters(config, layout, slowest)
    parameters = counts["layers"] + counts["embedding"] + counts["output"]
    gradient_sync = parameter_gather = 0.0
    if dp > 1:

        def per_bucket(op, bytes_per_element):
            full, rest = divmod(parameters, DEFAULT_BUCKET_SIZE)
            return sum(
                count
                * calibration.collective_ms(
                    op, dp, size * bytes_per_element, tp * dp > gpus_per_node, extrapolated
                )
                for count, size in ((full, DEFAULT_BUCKET_SIZE), (1, rest))
                if count and size
            )

        gradient_sync = per_bucket(
            "reduce_scatter" if layout.distributed_optimizer else "all_reduce",
            STATE_BYTES[layout.main_grads_dtype],
        )
        if layout.distributed_optimizer:  # bf16, FP8 primary weights in FP8
            fp8_share = counts["fp8_weights"] / parameters if layout.fp8_primary_weights else 0.0
            parameter_gather = per_bucket("all_gather", 2 - fp8_share)
    # The buckets' reductions start as the last micro-batch's backward produces their gradients;
    # with --overlap-param-gather the parameters' gathers run beside the next step's first forward.
    if layout.overlap_param_gather:
        parameter_gather = max(0.0, parameter_gather - slowest_layers * layer["forward"])
    exposed_sync = (
        max(0.0, gradient_sync - slowest_layers * (layer["step"] - layer["forward"]))
        + parameter_gather
    )
    if calibration.copy_gbs is None:
        raise NotPredicted(
            "no measured copy bandwidth for the optimizer (a layer map from bench_layer_grid.py --model)"
        )
    share = 1 / dp if layout.distributed_optimizer else 1
    gathered_fp8 = layout.distributed_optimizer and layout.fp8_primary_weights
    optimizer = (
        share
        * (
            parameters * optimizer_bytes_per_parameter(layout)
            + counts["fp8_weights"] * weight_cast_bytes(layout)
        )
        + (counts["fp8_weights"] * GATHERED_FP8_WEIGHT_BYTES if gathered_fp8 else 0)
    ) / (calibration.copy_gbs * 1e6)
    step = pipeline + exposed_sync + optimizer
    gpus = tp * pp * dp
    return {
        "step_ms": step,
        "tokens_per_s_per_gpu": global_batch_size * seq / (step / 1e3) / gpus,
        "breakdown_ms": {
            "compute": m * (micro_batch_ms - p2p),
            "pipeline_bubble": bubble,
            "point_to_point": m * p2p,
            "gradient_sync_exposed": exposed_sync,
            "optimizer": optimizer,
        },
        "extrapolated": list(dict.fromkeys(extrapolated)),
    }
