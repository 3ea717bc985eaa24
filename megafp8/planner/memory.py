"""Memory per rank of a training layout, predicted from the model's shape (the planner's memory
model, tools/plan_parallel.py).

What megafp8 keeps, and so what is counted:
- the parameters, in their dtype (bf16: 2 bytes), of the rank's pipeline stage and tensor shard;
- the gradient buffer (`main_grad`, 4 bytes a parameter element, 2 with --main-grads-dtype
  bf16; with the distributed optimizer each bucket padded to a multiple of dp, not modelled:
  under dp elements a bucket);
- the optimizer: fp32 master, exp_avg and exp_avg_sq of the elements the rank updates (12 bytes;
  each moment 2 in bf16, the first 1 + 1/32 in fp8, the master 2 as a remainder with
  --store-param-remainders; all of its parameters, or a dp-th with the distributed optimizer,
  which also keeps a bf16 slice of each bucket to all-gather from: 2 bytes an owned element, 1
  for an FP8 primary weight's, gathered in FP8);
- under FP8, every FP8 linear's cached weight cast in both layouts (2 bytes a weight element);
- activations saved for backward: per layer and micro-batch what this code saves (below), times
  the micro-batches a pipeline schedule holds in flight, plus the logits on the last stage.

Activations, per token of a micro-batch (h hidden; q, kv, f this rank's query, key/value and MLP
widths; G = 2 for SwiGLU's stacked gate and up, else 1), as `layer_activation_roles` counts them:
norms keep their input (2h) and statistics; a linear keeps its input in bf16 (2 a column), or
under FP8 only the transposed FP8 copy for the weight gradient (1 a column); attention keeps the
packed q, k, v (2(q + 2kv)), RoPE's rotated q and k (2(q + kv)), its output (2q) and log-sum-exp
(4 per head); the MLP keeps its activation's input (2Gf) and, unfused, SwiGLU's silu(gate) (2f).
Under delayed scaling with neighbour fusion the norms and the activation are fused into the FP8
casts, under rowwise and blockwise scaling the activations the recipe lists (`fused_activations`),
so no high-precision norm output or activation output is kept there. Selective recomputation
keeps q, k, v and recomputes the attention core; full recomputation keeps a layer's input only.
With sequence parallelism the norms work on a tp-th of the tokens, the linears on all of them;
QKV and fc1 keep their gathered input in bf16, but under FP8 only their shard's FP8 copy (with
an fp32 scale a column, rowwise, or a block, blockwise; blockwise keeps the gathered input's copy
where a shard's tokens do not split into 128s).
A stage that ends inside a layer holds its attention or its MLP: each counts its own norm,
linears, parameters and activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from megafp8.fp8.recipe import RECIPES_BY_NAME
from megafp8.models.config import TransformerConfig
from megafp8.parallel.stages import LAYER_PARTS, layer_parts, stage_layers

RECOMPUTE = ("none", "selective", "full")
FP8_RECIPES = (None, "delayed", "current", "rowwise", "blockwise")
# An optimizer state's bytes an element, by flag value (fp8: a first moment, with an fp32 scale
# per 128 elements)
STATE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1 + 4 / 128}


@dataclass(frozen=True)
class MemoryLayout:
    """A training layout as the memory model sees it (the trainer's flags of the same names)."""

    seq_length: int
    micro_batch_size: int = 1
    num_micro_batches: int = 1  # per step and data-parallel rank: global batch / (dp x micro-batch)
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    # the first / last virtual stage's own layer count (stage_layers; may end in .5)
    first_stage_layers: float | None = None
    last_stage_layers: float | None = None
    # or every virtual stage's layer count, in order (stage_layers' layout)
    stage_layout: tuple[float, ...] | None = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap_param_gather: bool = False  # no memory of its own: the throughput model's
    overlap_p2p_comm: bool = True  # as overlap_param_gather
    recompute: str = "none"  # none | selective | full (one layer per recomputed unit)
    fp8: str | None = None  # None (bf16) | delayed | current
    # optimizer states (--exp-avg-dtype fp32 | bf16 | fp8, --exp-avg-sq-dtype and
    # --main-grads-dtype fp32 | bf16)
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    main_grads_dtype: str = "fp32"
    store_param_remainders: bool = False
    # --fp8-primary-weights: the FP8 linears' weights held as their casts only (delayed scaling)
    fp8_primary_weights: bool = False
    fp8_neighbour_fusion: bool = True
    fp8_output_layer: bool = False
    first_last_layers_bf16: int = 0
    norm_on_cuda: bool = True  # RMSNorm: CUDA's fused kernel, else torch's fp32 composite (CPU)

    def __post_init__(self):
        if self.stage_layout is not None:  # a list from the flags or a JSON record: kept frozen
            object.__setattr__(self, "stage_layout", tuple(self.stage_layout))
        for name in (
            "seq_length",
            "micro_batch_size",
            "num_micro_batches",
            "tp",
            "pp",
            "dp",
            "vpp",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8 must be one of {FP8_RECIPES}, got {self.fp8!r}")
        for name, allowed in (
            ("exp_avg_dtype", tuple(STATE_BYTES)),
            ("exp_avg_sq_dtype", ("fp32", "bf16")),
            ("main_grads_dtype", ("fp32", "bf16")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.fp8_primary_weights and self.fp8 != "delayed":
            raise ValueError(
                f"fp8_primary_weights needs fp8='delayed' (the weights' delayed scale), got {self.fp8!r}"
            )

    @property
    def lean_states(self) -> bool:
        """Whether any optimizer state is kept lean (the optimizer's fused pass then leaves the
        FP8 weights' casts to the forward)."""
        return self.store_param_remainders or any(
            getattr(self, name) != "fp32"
            for name in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_grads_dtype")
        )

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @classmethod
    def from_args(cls, args, norm_on_cuda: bool = True) -> MemoryLayout:
        """The layout of the trainer's arguments, as `arguments.validate_args` leaves them (and
        `arguments.balance_pipeline_split`, with --balance-pipeline-split)."""
        return cls(
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            num_micro_batches=args.num_micro_batches,
            tp=args.tensor_model_parallel_size,
            pp=args.pipeline_model_parallel_size,
            dp=args.data_parallel_size,
            vpp=args.virtual_pipeline_model_parallel_size or 1,
            first_stage_layers=args.decoder_first_pipeline_num_layers,
            last_stage_layers=args.decoder_last_pipeline_num_layers,
            stage_layout=args.pipeline_stage_layers,
            sequence_parallel=args.sequence_parallel,
            distributed_optimizer=args.use_distributed_optimizer,
            overlap_param_gather=args.overlap_param_gather,
            overlap_p2p_comm=args.overlap_p2p_communication,
            recompute=args.recompute_granularity or "none",
            fp8=args.fp8_recipe if args.fp8_format else None,
            exp_avg_dtype=args.exp_avg_dtype,
            exp_avg_sq_dtype=args.exp_avg_sq_dtype,
            main_grads_dtype=args.main_grads_dtype,
            store_param_remainders=args.store_param_remainders,
            fp8_primary_weights=args.fp8_primary_weights,
            fp8_neighbour_fusion=args.fp8_neighbour_fusion,
            fp8_output_layer=args.fp8_output_layer,
            first_last_layers_bf16=args.first_last_layers_bf16,
            norm_on_cuda=norm_on_cuda,
        )


def stage_layer_parts(
    config: TransformerConfig, layout: MemoryLayout, pp_rank: int
) -> list[tuple[int, tuple[str, ...], bool]]:
    """(global index, the parts of it the rank holds (`stages.layer_parts`), whether it runs in
    FP8) of each layer pipeline rank `pp_rank` holds."""
    spans = stage_layers(
        config.num_layers,
        layout.pp,
        pp_rank,
        layout.vpp,
        layout.first_stage_layers,
        layout.last_stage_layers,
        layout.stage_layout,
    )
    edge = layout.first_last_layers_bf16
    return [
        (i, parts, bool(layout.fp8) and edge <= i < config.num_layers - edge)
        for first, last in spans
        for i, parts in layer_parts(first, last)
    ]


def stage_layer_count(config: TransformerConfig, layout: MemoryLayout, pp_rank: int) -> float:
    """The layers' worth pipeline rank `pp_rank` holds: a layer's attention or MLP counts half."""
    return sum(len(parts) for _, parts, _ in stage_layer_parts(config, layout, pp_rank)) / 2


def _norm_parameters(config: TransformerConfig) -> int:
    return 2 * config.hidden_size if config.normalization == "layernorm" else config.hidden_size


def layer_parameters(config: TransformerConfig, tp: int, parts=LAYER_PARTS) -> dict:
    """Elements of one layer (or of the `parts` of it a stage holds) on a tensor-parallel rank:
    {"fp8_weights": the linears' weights (what FP8 casts), "other": norms and biases}."""
    h, d = config.hidden_size, config.head_dim
    qkv_out = (config.num_attention_heads + 2 * config.kv_heads) * d // tp
    query = config.num_attention_heads * d // tp
    up_out = config.ffn_size * (2 if config.activation == "swiglu" else 1) // tp
    ffn = config.ffn_size // tp
    norm = _norm_parameters(config)
    # row-parallel biases are whole on each rank
    each = {
        "attention": {
            "fp8_weights": h * qkv_out + query * h,
            "other": norm + ((qkv_out + h) if config.bias else 0),
        },
        "mlp": {
            "fp8_weights": h * up_out + ffn * h,
            "other": norm + ((up_out + h) if config.bias else 0),
        },
    }
    return {kind: sum(each[part][kind] for part in parts) for kind in ("fp8_weights", "other")}


def rank_parameters(config: TransformerConfig, layout: MemoryLayout, pp_rank: int) -> dict:
    """Parameter elements of pipeline rank `pp_rank` (any tensor-parallel rank: all hold as many):
    {"layers", "fp8_weights" (of those, cast to FP8), "embedding", "output"}."""
    tp, h = layout.tp, config.hidden_size
    layers = [
        (layer_parameters(config, tp, parts), fp8)
        for _, parts, fp8 in stage_layer_parts(config, layout, pp_rank)
    ]
    vocab = config.padded_vocab_size(tp)
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    embedding = 0
    if first or (last and config.tie_embeddings and layout.pp > 1):
        embedding += vocab // tp * h
    if first and config.position_embedding == "learned":
        embedding += config.max_position_embeddings * h
    output = 0
    if last:
        output = _norm_parameters(config) + (0 if config.tie_embeddings else vocab // tp * h)
    output_fp8 = (
        vocab // tp * h
        if last and layout.fp8 and layout.fp8_output_layer and not config.tie_embeddings
        else 0
    )
    return {
        "layers": sum(counts["fp8_weights"] + counts["other"] for counts, _ in layers),
        "fp8_weights": sum(counts["fp8_weights"] for counts, fp8 in layers if fp8) + output_fp8,
        "embedding": embedding,
        "output": output,
    }


def static_bytes(
    config: TransformerConfig, layout: MemoryLayout, pp_rank: int, param_bytes: int = 2
) -> dict:
    """Bytes of what lives for the whole run on a rank of pipeline stage `pp_rank`: parameters,
    gradient buffer, optimizer states and FP8 weight casts (with FP8 primary weights, the FP8
    linears' only copy)."""
    counts = rank_parameters(config, layout, pp_rank)
    elements = counts["layers"] + counts["embedding"] + counts["output"]
    owned = elements / layout.dp if layout.distributed_optimizer else elements
    states = (
        (2 if layout.store_param_remainders else 4)
        + STATE_BYTES[layout.exp_avg_dtype]
        + STATE_BYTES[layout.exp_avg_sq_dtype]
    )
    fp8_weights = counts["fp8_weights"] if layout.fp8_primary_weights else 0
    gather_input = (
        param_bytes * (elements - fp8_weights) / layout.dp + fp8_weights / layout.dp
        if layout.distributed_optimizer
        else 0
    )
    optimizer = states * owned + gather_input
    held = elements - fp8_weights
    return {
        "parameters": param_bytes * held,
        "gradients": STATE_BYTES[layout.main_grads_dtype] * elements,
        "optimizer": optimizer,
        "fp8_weight_casts": 2 * counts["fp8_weights"],
    }


def layer_activation_roles(
    config: TransformerConfig, layout: MemoryLayout, in_fp8: bool = True, parts=LAYER_PARTS
) -> dict:
    """Bytes one layer (or the `parts` of it a stage holds) saves for backward for one
    micro-batch on a tensor-parallel rank, by what keeps them (see the module's docstring);
    `in_fp8=False` for a layer the layout keeps in bf16."""
    fp8 = layout.fp8 if in_fp8 else None
    tp = layout.tp
    tokens = layout.seq_length * layout.micro_batch_size
    local = tokens / tp if layout.sp else tokens  # the norms' and the residual stream's tokens
    h, heads = config.hidden_size, config.num_attention_heads
    query = heads * config.head_dim / tp
    kv = config.kv_heads * config.head_dim / tp
    ffn = config.ffn_size / tp
    gated = config.activation == "swiglu"
    if layout.recompute == "full":
        return {"layer_input": 2 * local * h}  # everything else is recomputed in backward
    # The norms fuse into delayed scaling's casts, the activation where the recipe says.
    fused = fp8 == "delayed" and layout.fp8_neighbour_fusion
    fused_activation = (
        fp8 is not None
        and layout.fp8_neighbour_fusion
        and config.activation in RECIPES_BY_NAME[fp8].fused_activations
    )
    linear_input = 1 if fp8 else 2  # bytes a column: the FP8 transposed copy, or the bf16 input
    # Under FP8 with sequence parallelism QKV and fc1 keep the FP8 copy of their own token shard
    # (gathered again in backward), in bf16 the gathered input. Fine-grained scaling keeps an fp32
    # scale for each column (rowwise) or each 128 tokens of one (blockwise); blockwise gathers in
    # bf16, keeping the gathered input's FP8 copy, where a shard's tokens do not split into 128s.
    fp8_gather = fp8 in ("delayed", "current", "rowwise") or (
        fp8 == "blockwise" and local % 128 == 0
    )
    gathered = local / tokens if fp8_gather else 1.0
    column_scales = {"rowwise": 4, "blockwise": 4 * tokens * gathered / 128}.get(fp8, 0)
    norm = _norm_bytes(config, layout, fused) * local
    each = {
        "attention": {
            "norms": norm,
            # QKV's input (the norm's output); proj's in FP8 (in bf16 it is the attention output
            # itself, counted below).
            "linear_inputs": (linear_input * h * gathered + (query if fp8 else 0)) * tokens
            + column_scales * (h + query),
            "qkv": 2 * (query + 2 * kv) * tokens,  # the packed q, k, v
            "rotated_qk": 2 * (query + kv) * tokens if config.position_embedding == "rope" else 0,
            "log_sum_exp": 4 * heads / tp * tokens if layout.recompute != "selective" else 0,
            # Kept by proj in bf16 even when the core is recomputed.
            "attention_output": (
                2 * query * tokens if layout.recompute != "selective" or not fp8 else 0
            ),
        },
        "mlp": {
            "norms": norm,
            # fc1's input (the norm's output), fc2's (the activation's output)
            "linear_inputs": linear_input * (h * gathered + ffn) * tokens
            + column_scales * (h + ffn),
            "activation_input": 2 * (2 if gated else 1) * ffn * tokens,
            # silu(gate), kept by the unfused SwiGLU for its product's backward.
            "silu_gate": 2 * ffn * tokens if gated and not fused_activation else 0,
        },
    }
    roles = {}
    for part in parts:
        for role, value in each[part].items():
            roles[role] = roles.get(role, 0) + value
    return roles


def _norm_bytes(config: TransformerConfig, layout: MemoryLayout, fused: bool) -> float:
    """Bytes a token a norm keeps: its input and statistics (fp32 mean and rstd; RMSNorm's rstd
    only), or with torch's RMSNorm composite (off CUDA, unfused) two fp32 copies and the rstd."""
    h, layernorm = config.hidden_size, config.normalization == "layernorm"
    if fused or layernorm or layout.norm_on_cuda:
        return 2 * h + (8 if layernorm else 4)
    return 8 * h + 4


def micro_batches_in_flight(layout: MemoryLayout, pp_rank: int) -> float:
    """The most micro-batches (in layer-chunks' worth of a whole stage) whose activations pipeline
    rank `pp_rank` holds at once (parallel.schedules): 1 without pipelining; 1F1B, pp - rank (at
    most all of them); interleaved, Megatron's warm-up of 2(pp - rank - 1) + (vpp - 1)pp chunk
    forwards plus one, each a vpp-th of the stage (all of them when there are pp micro-batches)."""
    num = layout.num_micro_batches
    if layout.pp == 1:
        return 1
    if layout.vpp == 1:
        return min(layout.pp - pp_rank, num)
    total = num * layout.vpp
    if num == layout.pp:  # the schedule runs every forward first
        return total / layout.vpp
    warmup = min(2 * (layout.pp - pp_rank - 1) + (layout.vpp - 1) * layout.pp, total)
    return min(warmup + 1, total) / layout.vpp


def logits_bytes(config: TransformerConfig, layout: MemoryLayout) -> float:
    """The last stage's output layer and loss: the final norm's input and output, and the
    vocabulary-parallel logits in fp32 (kept by the cross-entropy for its backward)."""
    tokens = layout.seq_length * layout.micro_batch_size
    local = tokens / layout.tp if layout.sp else tokens
    fused = layout.fp8 == "delayed" and layout.fp8_neighbour_fusion and layout.fp8_output_layer
    vocab = config.padded_vocab_size(layout.tp) / layout.tp
    return (
        _norm_bytes(config, layout, fused) * local
        + 2 * config.hidden_size * tokens
        + 4 * vocab * tokens
    )


def estimate(config: TransformerConfig, layout: MemoryLayout, param_bytes: int = 2) -> list[dict]:
    """Per pipeline stage, the bytes of each kind and their total, for a rank of that stage."""
    stages = []
    for pp_rank in range(layout.pp):
        per_micro_batch = sum(
            sum(layer_activation_roles(config, layout, in_fp8=fp8, parts=parts).values())
            for _, parts, fp8 in stage_layer_parts(config, layout, pp_rank)
        )
        activations = per_micro_batch * micro_batches_in_flight(layout, pp_rank)
        if pp_rank == layout.pp - 1:
            activations += logits_bytes(config, layout)
        stage = {
            "pp_rank": pp_rank,
            **static_bytes(config, layout, pp_rank, param_bytes),
            "activations": activations,
        }
        stage["total"] = sum(v for k, v in stage.items() if k != "pp_rank")
        stages.append(stage)
    return stages
