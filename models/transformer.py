"""One decoder-only transformer, configured into GPT or Llama, built from tensor-parallel FP8
layers. Activations are [sequence, batch, hidden] inside (Megatron's layout, which sequence
parallelism splits along the sequence); the model takes token ids [batch, sequence].

    model = TransformerLM(preset("llama-tiny"), tp_group=groups.tp_group)
    with fp8_autocast(recipe=DelayedScaling(), amax_reduction_group=groups.amax_reduction_group):
        loss = model(tokens, labels=labels).mean()
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from megafp8.parallel import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    normal_init,
    vocab_parallel_cross_entropy,
)
from megafp8.parallel.communication import copy_to_tensor_parallel, gather_from_sequence_parallel
from megafp8.parallel.cuda_graphs import LayerGraphs
from megafp8.parallel.stages import LAYER_PARTS, half_layers, layer_parts
from torch import nn
from torch.utils.checkpoint import checkpoint

from megafp8.collectives import group_size, rank_in
from megafp8.fp8 import Fp8Linear, fp8_autocast, fp8_recompute
from megafp8.fp8.autocast import current_fp8_context
from megafp8.fp8.fused import GradHandoff
from megafp8.messages import check_integer

from .config import TransformerConfig
from .documents import document_attention_mask
from .rope import apply_rotary, rotary_tables


def make_norm(config: TransformerConfig, dtype, device) -> nn.Module:
    if config.normalization == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.norm_epsilon, dtype=dtype, device=device)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon, dtype=dtype, device=device)


RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


class Attention(nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        tp_group,
        sp,
        output_init,
        dtype,
        device,
        recompute_core=False,
        tp_comm_overlap=False,
    ):
        super().__init__()
        self.qkv = QKVParallelLinear(
            config.hidden_size,
            config.num_attention_heads,
            config.kv_heads,
            config.head_dim,
            tp_group=tp_group,
            bias=config.bias,
            sequence_parallel=sp,
            tp_comm_overlap=tp_comm_overlap,
            init_method=normal_init(config.init_method_std),
            dtype=dtype,
            device=device,
        )
        self.proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            tp_group=tp_group,
            bias=config.bias,
            input_is_parallel=True,
            sequence_parallel=sp,
            tp_comm_overlap=tp_comm_overlap,
            init_method=output_init,
            dtype=dtype,
            device=device,
        )
        self.dropout = config.attention_dropout
        self.recompute_core = recompute_core

    def forward(self, x, rotary, mask, norm=None):
        """Attention over `norm(x)` (the norm fused into the QKV GEMM's FP8 cast where it can be)."""
        q, k, v = self.qkv.heads(x, norm=norm)  # [s, b, heads, head_dim]
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if self.recompute_core:
            # Selective recomputation: keep only q, k, v and redo the attention core in backward.
            # The RNG state is kept for the recomputation only when dropout draws from it: reading
            # it is not allowed while a CUDA graph is captured.
            out = checkpoint(
                self._core,
                q,
                k,
                v,
                mask,
                use_reentrant=False,
                preserve_rng_state=self.training and self.dropout > 0,
            )
        else:
            out = self._core(q, k, v, mask)
        return self.proj(out)

    def _core(self, q, k, v, mask):
        """Causal attention; `mask` [b, 1, s, s] (documents) replaces the plain causal mask."""
        q, k, v = (rearrange(t, "s b heads d -> b heads s d") for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=k.shape[1] != q.shape[1],
            dropout_p=self.dropout if self.training else 0.0,
        )
        return rearrange(out, "b heads s d -> s b (heads d)")


class MLP(nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        tp_group,
        sp,
        output_init,
        dtype,
        device,
        tp_comm_overlap=False,
    ):
        super().__init__()
        self.gated = config.activation == "swiglu"
        # SwiGLU's gate and up projections run as one GEMM: two stacked column-parallel matrices.
        self.fc1 = ColumnParallelLinear(
            config.hidden_size,
            config.ffn_size * (2 if self.gated else 1),
            tp_group=tp_group,
            bias=config.bias,
            stack=2 if self.gated else 1,
            sequence_parallel=sp,
            tp_comm_overlap=tp_comm_overlap,
            init_method=normal_init(config.init_method_std),
            dtype=dtype,
            device=device,
        )
        self.fc2 = RowParallelLinear(
            config.ffn_size,
            config.hidden_size,
            tp_group=tp_group,
            bias=config.bias,
            input_is_parallel=True,
            sequence_parallel=sp,
            tp_comm_overlap=tp_comm_overlap,
            init_method=output_init,
            dtype=dtype,
            device=device,
        )
        self.activation = config.activation  # one of megafp8.fp8.activation_kernels.KINDS

    def forward(self, x, norm=None):
        """The MLP of `norm(x)`. Under delayed FP8 scaling the norm is fused into fc1's input cast,
        the activation into fc2's, and in backward the activation's gradient into fc1's output
        gradient cast (handed over, megafp8.fp8.fused): no high-precision copy of either is stored.
        fc1 stacks [gate; up] for SwiGLU (`swiglu(h) = silu(gate) * up`)."""
        handoff = GradHandoff()
        h = self.fc1(x, norm=norm, grad_from=handoff)
        return self.fc2(h, activation=self.activation, grad_to=(self.fc1, handoff))


class TransformerLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x)). A pipeline stage
    that ends inside a layer holds one of the two with its norm (`parts`, a subset of
    megafp8.parallel.stages.LAYER_PARTS); the missing one is None. `seeded(part)`, if given, is a
    context under which a part draws its weights (TransformerLM: each part from its own seed, so a
    stage holding one draws it as the whole layer does). With `high_precision`, its linears stay out
    of FP8 even under fp8_autocast."""

    def __init__(
        self,
        config: TransformerConfig,
        tp_group,
        sp,
        dtype,
        device,
        recompute="none",
        high_precision=False,
        tp_comm_overlap=False,
        parts=LAYER_PARTS,
        seeded=None,
    ):
        super().__init__()
        if not parts or set(parts) - set(LAYER_PARTS):
            raise ValueError(f"parts must be a non-empty subset of {LAYER_PARTS}, got {parts!r}")
        seeded = seeded or (lambda part: contextlib.nullcontext())
        # Megatron's scaled init for the layers that write into the residual stream.
        output_init = normal_init(config.init_method_std / math.sqrt(2 * config.num_layers))
        self.input_norm = self.attention = self.mlp_norm = self.mlp = None
        block = (config, tp_group, sp, output_init, dtype, device)
        if "attention" in parts:
            self.input_norm = make_norm(config, dtype, device)
            with seeded("attention"):
                self.attention = Attention(
                    *block,
                    recompute_core=recompute == "selective",
                    tp_comm_overlap=tp_comm_overlap,
                )
        if "mlp" in parts:
            self.mlp_norm = make_norm(config, dtype, device)
            with seeded("mlp"):
                self.mlp = MLP(*block, tp_comm_overlap=tp_comm_overlap)
        self.dropout = config.hidden_dropout
        self.high_precision = high_precision

    def forward(self, x, rotary, mask=None):
        with fp8_autocast(enabled=False) if self.high_precision else contextlib.nullcontext():
            if self.attention is not None:
                x = x + F.dropout(
                    self.attention(x, rotary, mask, norm=self.input_norm),
                    self.dropout,
                    self.training,
                )
            if self.mlp is not None:
                x = x + F.dropout(self.mlp(x, norm=self.mlp_norm), self.dropout, self.training)
            return x


def run_recomputed(layers, x, rotary, mask):
    """Full recomputation of consecutive `layers`: keep only their input and redo them in
    backward, under the FP8 context of this forward and with the scales its casts used
    (snapshotted right after it, before the end of the pass updates them)."""

    def run(x, rotary, mask):
        for layer in layers:
            x = layer(x, rotary, mask)
        return x

    context, scales = current_fp8_context(), {}
    draws = any(
        layer.training
        and (layer.dropout > 0 or (layer.attention is not None and layer.attention.dropout > 0))
        for layer in layers
    )
    out = checkpoint(
        run,
        x,
        rotary,
        mask,
        use_reentrant=False,
        preserve_rng_state=draws,
        context_fn=lambda: (contextlib.nullcontext(), fp8_recompute(context, scales)),
    )
    if context is not None:
        for linear in (m for layer in layers for m in layer.modules() if isinstance(m, Fp8Linear)):
            scales[id(linear.fp8_scaling["input"])] = linear.fp8_scaling["input"].scale.clone()
    return out


def run_unit(layers, recomputed, x, rotary, mask):
    """One unit of TransformerLM.units: its layers in turn, recomputed in backward if so marked
    (and gradients are on)."""
    if recomputed and torch.is_grad_enabled():
        return run_recomputed(layers, x, rotary, mask)
    for layer in layers:
        x = layer(x, rotary, mask)
    return x


def compile_layers(model: nn.Module) -> None:
    """torch.compile each transformer layer of `model` in place (torchtitan's per-block compile),
    for the glue between the linears: norms, residual adds, dropout, rotary embedding, the
    attention layout and the activation, fused forward and backward. The tensor-parallel FP8
    linears stay eager (a graph break each): their casts, scaling state and collectives are
    host-side bookkeeping that compiled code must not replay. Parameter names are unchanged."""
    for layer in (m for m in model.modules() if isinstance(m, TransformerLayer)):
        for linear in (m for m in layer.modules() if isinstance(m, Fp8Linear)):
            linear.forward = torch.compiler.disable(linear.forward, recursive=True)
        layer.compile()


class TransformerLM(nn.Module):
    """A GPT or Llama language model (by its config) on tensor-parallel FP8 layers.

    Every linear of the transformer layers runs in FP8 under fp8_autocast; embeddings, norms,
    attention and the output layer stay in the parameters' dtype (`fp8_output_layer=True` runs
    the output layer in FP8 too; `first_last_layers_bf16=N` keeps the first and last N layers
    out of FP8, as Megatron's --first-last-layers-bf16). `recompute="selective"` recomputes each
    attention core in backward instead of keeping its activations; `"full"` recomputes whole
    layers from their inputs, with the FP8 scales their forward used: with
    `recompute_method="uniform"` this chunk's layers in groups of `recompute_num_layers` (one
    input kept per group), with `"block"` only its first `recompute_num_layers` layers, one by
    one, the rest keeping their activations (Megatron's --recompute-method). `sequence_parallel` keeps the
    residual stream, norms and dropout on this rank's sequence shard between the tensor-parallel
    regions; the parameters used there carry `param.sequence_parallel = True`, and their
    gradients must be summed over the tensor-parallel group before the optimizer step;
    `tp_comm_overlap` runs its gathers and reduce-scatters block by block beside the layers'
    GEMMs (megafp8.collective_gemm). Weights are drawn from the global seed as full tensors and sliced, so any tensor-parallel size
    builds the same model. `layers=(first, last)` builds a pipeline stage: layers first to
    last - 1, the embedding if first is 0, the output layer and loss if last is num_layers; a bound
    ending in .5 cuts a layer after its attention (megafp8.parallel.stages.layer_parts), and
    each part draws its weights from its own seed, so every layout holds the same weights.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        tp_group=None,
        sequence_parallel: bool = False,
        tp_comm_overlap: bool = False,
        layers: tuple[float, float] | None = None,
        seed: int = 0,
        fp8_output_layer: bool = False,
        first_last_layers_bf16: int = 0,
        recompute: str = "none",
        recompute_method: str = "uniform",
        recompute_num_layers: int = 1,
        dtype=None,
        device=None,
    ):
        super().__init__()
        tp = group_size(tp_group)
        self.sequence_parallel = sp = sequence_parallel and tp > 1
        config.validate_tensor_parallel(tp)
        first, last = layers if layers is not None else (0, config.num_layers)
        if not 0 <= first < last <= config.num_layers or None in map(half_layers, (first, last)):
            raise ValueError(
                f"layers={layers} must be a non-empty range (first, last) within 0..{config.num_layers}, "
                "in whole or half layers (x.5: after a layer's attention)"
            )
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
        if recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(
                f"recompute_method must be one of {RECOMPUTE_METHODS}, got {recompute_method!r}"
            )
        check_integer("recompute_num_layers", recompute_num_layers)
        if not 0 <= first_last_layers_bf16 <= config.num_layers:
            raise ValueError(
                f"first_last_layers_bf16={first_last_layers_bf16} must be between 0 and "
                f"num_layers={config.num_layers}"
            )
        self.config, self.tp_group, self.fp8_output_layer = config, tp_group, fp8_output_layer
        # A pipeline stage: the first owns the embedding, the last the final norm, output and loss.
        self.pre_process, self.post_process = first == 0, last == config.num_layers
        self.vocab_size = config.padded_vocab_size(tp)
        std = config.init_method_std

        on_gpu = device is not None and torch.device(device).type == "cuda"

        @contextlib.contextmanager
        def seeded(index):
            # Each component draws its master weights from its own seed, so a stage holds exactly
            # the full model's weights for its layers, whatever the pipeline layout. They are
            # drawn on `device` (Megatron's default): a 7B model drawn on one CPU core takes a minute.
            with torch.random.fork_rng(devices=[torch.device(device)] if on_gpu else []):
                torch.manual_seed(seed * 1_000_003 + index)
                yield

        if self.pre_process or (self.post_process and config.tie_embeddings):
            # A last stage with tied embeddings holds its own copy, initialised identically
            # (kept in sync with the first stage's through the embedding group).
            with seeded(0):
                self.embedding = VocabParallelEmbedding(
                    self.vocab_size,
                    config.hidden_size,
                    tp_group=tp_group,
                    sequence_parallel=sp,
                    init_method=normal_init(std),
                    dtype=dtype,
                    device=device,
                )
        if self.pre_process and config.position_embedding == "learned":
            with seeded(1):
                master = torch.empty(
                    config.max_position_embeddings, config.hidden_size, device=device
                ).normal_(0, std)
            self.position_embedding = nn.Embedding(
                config.max_position_embeddings, config.hidden_size, dtype=dtype, device="meta"
            )
            self.position_embedding.weight = nn.Parameter(
                master.to(device=device, dtype=dtype or torch.float32)
            )
        if config.position_embedding == "rope":
            cos, sin = rotary_tables(
                config.max_position_embeddings,
                config.head_dim,
                config.rope_theta,
                config.rope_scaling,
            )
            self.register_buffer("rotary_cos", cos.to(device), persistent=False)
            self.register_buffer("rotary_sin", sin.to(device), persistent=False)
        edge = first_last_layers_bf16
        # Keyed by the global layer index: parameter names are the same under any pipeline layout.
        # A range that starts or ends half-way into a layer holds its MLP or its attention only.
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    config,
                    tp_group,
                    sp,
                    dtype,
                    device,
                    recompute,
                    high_precision=i < edge or i >= config.num_layers - edge,
                    tp_comm_overlap=tp_comm_overlap,
                    parts=parts,
                    # the attention from the layer's seed, the MLP from one of its own
                    seeded=lambda part, i=i: seeded(
                        3 + i + (config.num_layers if part == "mlp" else 0)
                    ),
                )
                for i, parts in layer_parts(first, last)
            }
        )
        if self.post_process:
            self.final_norm = make_norm(config, dtype, device)
            self.output_layer = None
            if not config.tie_embeddings:
                with seeded(2):
                    self.output_layer = ColumnParallelLinear(
                        config.hidden_size,
                        self.vocab_size,
                        tp_group=tp_group,
                        bias=False,
                        sequence_parallel=sp,
                        init_method=normal_init(std),
                        dtype=dtype,
                        device=device,
                    )
        self.cuda_graphs = None  # enable_cuda_graphs
        # params_needed(params), if set, is called before the forward reads each group of its
        # parameters (the embedding, each unit's layers, the final norm and output): a distributed
        # optimizer that gathers them beside the forward waits there (--overlap-param-gather).
        self.params_needed = None
        # The units forward runs, each a list of consecutive layers and whether it is recomputed.
        layer_list, n = list(self.layers.values()), recompute_num_layers
        if recompute != "full":
            self.units = [([layer], False) for layer in layer_list]
        elif recompute_method == "uniform":
            self.units = [(layer_list[i : i + n], True) for i in range(0, len(layer_list), n)]
        else:
            self.units = [([layer], i < n) for i, layer in enumerate(layer_list)]
        for module in (getattr(self, "embedding", None), getattr(self, "output_layer", None)):
            if module is not None:  # rows past the vocabulary are padding (dropped in checkpoints)
                module.weight.unpadded_rows = config.vocab_size
        if sp:  # used on the sequence shard: each rank's gradient covers only its shard
            shard_modules = [m for m in self.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm))]
            for param in [p for m in shard_modules for p in m.parameters()] + (
                [self.position_embedding.weight] if hasattr(self, "position_embedding") else []
            ):
                param.sequence_parallel = True

    def forward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The first stage takes token ids [batch, seq]; later stages the previous stage's
        hidden states [seq, batch, hidden] (this rank's sequence shard with sequence
        parallelism). Stages before the last return hidden states; the last returns this
        rank's vocabulary shard of the logits [batch, seq, vocab/tp], or with `labels`
        [batch, seq] the per-token loss [batch, seq] (fp32).

        `document_ids` and `position_ids` [batch, seq] (from `documents.document_layout`, for
        the whole sequence, on every stage) keep attention inside each document and restart
        positions at each one."""
        if self.pre_process:
            self._need(
                [
                    self.embedding.weight,
                    *(
                        [self.position_embedding.weight]
                        if self.config.position_embedding == "learned"
                        else []
                    ),
                ]
            )
        x = self._embed(inputs, position_ids) if self.pre_process else inputs
        rotary = None
        if self.config.position_embedding == "rope":
            rotary = (self.rotary_cos, self.rotary_sin)
            if position_ids is not None:
                rotary = tuple(table[position_ids.t()] for table in rotary)  # [s, b, head_dim]
        mask = None if document_ids is None else document_attention_mask(document_ids)
        graphed = None
        if self.cuda_graphs is not None and self.training:
            graphed = self.cuda_graphs(x, *(rotary or (None, None)), mask)
        x = graphed if graphed is not None else self._run_units(x, rotary, mask)
        if not self.post_process:
            return x
        self._need(
            [
                *self.final_norm.parameters(),
                *(
                    self.output_layer.parameters()
                    if self.output_layer is not None
                    else [self.embedding.weight]
                ),
            ]
        )
        logits = self._logits(self.final_norm(x)).transpose(0, 1)  # [b, s, vocab/tp]
        if labels is None:
            return self._mask_padding(logits)
        # The loss leaves the padded vocabulary out itself, without a masked copy of the logits.
        return vocab_parallel_cross_entropy(
            logits, labels, self.tp_group, vocab_size=self.config.vocab_size
        )

    def fp8_linears(self) -> list[Fp8Linear]:
        """The linears whose GEMMs run in FP8 under fp8_autocast: those of the layers not kept in
        high precision, and the output layer with `fp8_output_layer`."""
        modules = [layer for layer in self.layers.values() if not layer.high_precision]
        if self.fp8_output_layer and getattr(self, "output_layer", None) is not None:
            modules.append(self.output_layer)
        return [m for module in modules for m in module.modules() if isinstance(m, Fp8Linear)]

    def _run_units(self, x, rotary, mask):
        for layers, recomputed in self.units:
            self._need([p for layer in layers for p in layer.parameters()])
            x = run_unit(layers, recomputed, x, rotary, mask)
        return x

    def _need(self, params) -> None:
        if self.params_needed is not None:
            self.params_needed(params)

    def enable_cuda_graphs(self, grads_ready=None) -> None:
        """Run the transformer layers as CUDA graphs in training from the next forward on, which
        captures them (megafp8.parallel.cuda_graphs.LayerGraphs: one forward and one backward graph per
        unit of `units`, a recomputed group being one unit). Parameters need `main_grad` (the
        GradientBuffer), and the layers one eager training step behind them; `grads_ready(params)`
        is told when a unit's gradients are in main_grad (and `params_needed`, if set, before a
        unit's forward reads them). Backwards must come in the order of their forwards (gradient
        accumulation; 1F1B, interleaved or not)."""

        def unit(layers, recomputed):
            def run(x, rotary_cos, rotary_sin, mask):
                rotary = None if rotary_cos is None else (rotary_cos, rotary_sin)
                return run_unit(layers, recomputed, x, rotary, mask)

            return run, nn.ModuleList(layers)

        self.cuda_graphs = LayerGraphs(
            [unit(layers, recomputed) for layers, recomputed in self.units],
            grads_ready,
            self.params_needed,
        )

    def disable_cuda_graphs(self) -> None:
        """Back to eager layers; the graphs and their memory pools are freed. A graph that captured
        a collective holds its NCCL communicator: destroying the process group waits for it, so a
        run drops its graphs first (Trainer.release_cuda_graphs)."""
        self.cuda_graphs = None

    def _embed(self, tokens, position_ids):
        tp = group_size(self.tp_group)
        if self.sequence_parallel and tokens.shape[1] % tp:
            raise ValueError(
                f"sequence length {tokens.shape[1]} does not split over {tp} tensor-parallel "
                f"ranks (sequence parallelism needs it to)"
            )
        x = self.embedding(tokens.t())  # [s, b, h], or this rank's [s / tp, b, h] shard
        if self.config.position_embedding == "learned":
            start = rank_in(self.tp_group) * x.shape[0] if self.sequence_parallel else 0
            if position_ids is None:
                x = x + self.position_embedding.weight[start : start + x.shape[0], None, :]
            else:
                x = x + self.position_embedding.weight[position_ids.t()[start : start + x.shape[0]]]
        return x

    def _logits(self, x):
        with contextlib.nullcontext() if self.fp8_output_layer else fp8_autocast(enabled=False):
            if self.output_layer is not None:
                logits = self.output_layer(x)
            elif self.sequence_parallel:
                logits = F.linear(
                    gather_from_sequence_parallel(x, self.tp_group), self.embedding.weight
                )
            else:
                logits = F.linear(copy_to_tensor_parallel(x, self.tp_group), self.embedding.weight)
        return logits

    def _mask_padding(self, logits):
        """The padded vocabulary entries are no tokens: give them no probability (and no gradient)."""
        start = rank_in(self.tp_group) * logits.shape[-1]
        padding = start + logits.shape[-1] - self.config.vocab_size
        if padding > 0:
            mask = (
                torch.arange(start, start + logits.shape[-1], device=logits.device)
                >= self.config.vocab_size
            )
            logits = logits.masked_fill(mask, float("-inf"))
        return logits
