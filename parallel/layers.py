"""Tensor-parallel linear layers on the FP8 core (Megatron's column/row split).

Both are Fp8Linear subclasses holding this rank's shard of the full weight, so FP8, its
scaling state and the weight cache work unchanged; the communication around the local GEMM is
the only thing they add. Weights come from a full master initialised from the global seed and
sliced, so every tensor-parallel size starts from the same model.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from megafp8.collectives import group_size, rank_in
from megafp8.fp8 import Fp8Linear
from megafp8.fp8.fused import GradHandoff, HeadGradsSource
from megafp8.fp8.linear import hand_over_gradient
from megafp8.fp8.scaling import scaling_states

from .communication import (
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
)
from .initialization import InitMethod, master_slice, normal_init
from .sharding import mark_partitioned


class _ShardedLinear(Fp8Linear):
    """An Fp8Linear whose weight is slice `rank` of a full master split along `partition_dim`.

    With `stack` > 1 the output features are that many equal matrices side by side (SwiGLU's
    gate and up); each is split separately, so every rank holds its slice of each."""

    def __init__(
        self,
        in_features,
        out_features,
        partition_dim,
        tp_group,
        bias,
        bias_features,
        init_method,
        dtype,
        device,
        stack=1,
    ):
        tp = group_size(tp_group)
        full = (out_features, in_features)
        if full[partition_dim] % (tp * stack):
            name = ("out_features", "in_features")[partition_dim]
            raise ValueError(
                f"{type(self).__name__}: {name}={full[partition_dim]} does not divide over "
                f"{tp} tensor-parallel ranks"
                + (f" x {stack} stacked matrices" if stack > 1 else "")
            )
        local = list(full)
        local[partition_dim] //= tp
        # Built on the meta device: nn.Linear's own init must not draw from the global RNG,
        # or the master weights would depend on the tensor-parallel size.
        super().__init__(local[1], local[0], bias=False, device="meta", dtype=dtype)
        dtype = dtype or torch.get_default_dtype()
        stacked = (stack, full[0] // stack, full[1])
        weight = master_slice(
            stacked, partition_dim + 1, rank_in(tp_group), tp, init_method, dtype, device
        )
        self.weight = mark_partitioned(nn.Parameter(weight.reshape(local)), partition_dim, stack)
        self.bias = (
            nn.Parameter(torch.zeros(bias_features, dtype=dtype, device=device)) if bias else None
        )
        # a column-parallel bias is split with its outputs
        if self.bias is not None and partition_dim == 0:
            mark_partitioned(self.bias, 0, stack)
        self.fp8_scaling = scaling_states(device)
        self.tp_group = tp_group
        self.tp_size = tp


class ColumnParallelLinear(_ShardedLinear):
    """`Y = X A + b` with A split by columns: each rank computes out_features / tp outputs.

    The input is replicated over the tensor-parallel ranks, or with `sequence_parallel` it
    arrives as this rank's shard of dim 0 (the sequence, Megatron's [s, b, h] layout) and is
    all-gathered, in FP8 when the GEMM is FP8 (with `tp_comm_overlap`, block by block beside the
    GEMM: megafp8.collective_gemm). `gather_output` all-gathers the output's last
    dim (else each rank keeps its slice, for a following RowParallelLinear). `stack` > 1: the
    output is that many matrices side by side (SwiGLU's gate and up, `stack=2`), each split
    over tp: this rank's output is its slice of each, in that order (gather_output must be off).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group=None,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        tp_comm_overlap: bool = False,
        init_method: InitMethod = normal_init(),
        stack: int = 1,
        dtype=None,
        device=None,
    ):
        tp = group_size(tp_group)
        super().__init__(
            in_features,
            out_features,
            0,
            tp_group,
            bias,
            out_features // max(tp, 1),
            init_method,
            dtype,
            device,
            stack,
        )
        self.stack = stack
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and tp > 1
        self.tp_comm_overlap = tp_comm_overlap and self.sequence_parallel

    def forward(
        self,
        x: torch.Tensor,
        *,
        norm: nn.Module | None = None,
        grad_from: GradHandoff | None = None,
    ) -> torch.Tensor:
        """`norm(x) A + b` with a norm module (fused into the FP8 cast where it can be), else
        `x A + b`; `grad_from`: see Fp8Linear.forward."""
        context = self.fp8_context(x, gathered_ranks=self.tp_size if self.sequence_parallel else 1)
        # Without sequence parallelism the norm's input is replicated: a fused norm all-reduces
        # its input gradient before its own backward, as copy_to_tensor_parallel would after it.
        replicated = self.tp_group if self.tp_size > 1 and not self.sequence_parallel else None
        fusion, x = self.fusion(
            context, x, norm=norm, grad_from=grad_from, input_grad_group=replicated
        )
        if fusion.norm is not None and replicated is not None:
            y = self.linear(x, self.bias, context, fusion)
        elif not self.sequence_parallel:
            y = self.linear(copy_to_tensor_parallel(x, self.tp_group), self.bias, context, fusion)
        elif context is not None:
            # gathers in FP8
            y = self.fp8_linear(
                x,
                self.bias,
                context,
                gather_group=self.tp_group,
                fusion=fusion,
                overlap=self.tp_comm_overlap,
            )
        elif self.tp_comm_overlap and not torch.is_autocast_enabled(x.device.type):
            y = self.high_precision_linear(x, self.bias, gather_group=self.tp_group)
        else:
            y = self.high_precision_linear(
                gather_from_sequence_parallel(x, self.tp_group), self.bias
            )
        return gather_from_tensor_parallel(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(_ShardedLinear):
    """`Y = X A + b` with A split by rows: each rank multiplies in_features / tp inputs and the
    partial outputs are summed (all-reduce), or with `sequence_parallel` summed and split along
    dim 0 (reduce-scatter). The bias is added after the sum.

    `input_is_parallel`: the input already holds this rank's slice of the last dim (the
    output of a ColumnParallelLinear); otherwise it is split here. With sequence parallelism
    the bias gradient on each rank covers only its sequence shard: such parameters carry
    `sequence_parallel = True`, and their gradients must be summed over the tensor-parallel
    group before the optimizer step (Megatron does the same). With `tp_comm_overlap` the
    reduce-scatter runs block by block beside the GEMM (megafp8.collective_gemm).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group=None,
        bias: bool = True,
        input_is_parallel: bool = False,
        sequence_parallel: bool = False,
        tp_comm_overlap: bool = False,
        init_method: InitMethod = normal_init(),
        dtype=None,
        device=None,
    ):
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        super().__init__(
            in_features, out_features, 1, tp_group, bias, out_features, init_method, dtype, device
        )
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.tp_comm_overlap = tp_comm_overlap and self.sequence_parallel
        if self.bias is not None:
            self.bias.sequence_parallel = self.sequence_parallel

    def forward(
        self, x: torch.Tensor, *, activation: str | None = None, grad_to: tuple | None = None
    ) -> torch.Tensor:
        """`act(x) A + b` with an activation (fused into the FP8 cast where it can be), else
        `x A + b`; `grad_to`: see Fp8Linear.forward."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.tp_group)
        context = self.fp8_context(x)
        fusion, x = self.fusion(context, x, activation=activation, grad_to=grad_to)
        if self.tp_size == 1:  # nothing to sum: the bias goes into the GEMM's epilogue
            return self.linear(x, self.bias, context, fusion)
        # the reduce-scatter block by block beside the GEMM, the bias in the GEMM of this rank's block
        if self.tp_comm_overlap and context is not None:
            return self.fp8_linear(
                x, self.bias, context, fusion=fusion, scatter_group=self.tp_group, overlap=True
            )
        if self.tp_comm_overlap and not torch.is_autocast_enabled(x.device.type):
            return self.high_precision_linear(x, self.bias, scatter_group=self.tp_group)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(
                self.linear(x, None, context, fusion), self.tp_group
            )
        else:
            y = reduce_from_tensor_parallel(self.linear(x, None, context, fusion), self.tp_group)
        return y if self.bias is None else y + self.bias


class QKVParallelLinear(ColumnParallelLinear):
    """The fused query/key/value projection as one column-parallel GEMM, with grouped-query
    attention: `num_kv_heads` key/value heads, each shared by num_heads / num_kv_heads queries.

    Output features are laid out per key/value group, [q heads of the group, k, v], so a
    contiguous split over tensor-parallel ranks gives each rank whole groups: num_kv_heads / tp
    of them. `split_heads` turns this rank's output into q, k, v of shape [..., heads, head_dim].
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        tp_group=None,
        bias: bool = False,
        sequence_parallel: bool = False,
        tp_comm_overlap: bool = False,
        init_method: InitMethod = normal_init(),
        dtype=None,
        device=None,
    ):
        tp = group_size(tp_group)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"QKVParallelLinear: num_heads={num_heads} is not a multiple of "
                f"num_kv_heads={num_kv_heads}"
            )
        if num_kv_heads % tp:
            raise ValueError(
                f"QKVParallelLinear: num_kv_heads={num_kv_heads} does not divide over {tp} "
                f"tensor-parallel ranks; use a tensor-parallel size that divides it"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        super().__init__(
            hidden_size,
            (num_heads + 2 * num_kv_heads) * head_dim,
            tp_group=tp_group,
            bias=bias,
            sequence_parallel=sequence_parallel,
            tp_comm_overlap=tp_comm_overlap,
            init_method=init_method,
            dtype=dtype,
            device=device,
        )

    def heads(self, x: torch.Tensor, *, norm: nn.Module | None = None):
        """q, k, v (`split_heads`) of `norm(x)` with a norm module, else of `x`. Where this
        layer's FP8 cast takes its neighbours (Fp8Linear's neighbour fusion), backward casts the
        gradients of q, k and v into this layer's FP8 output gradient in one kernel, without
        concatenating them in high precision first."""
        handoff = GradHandoff()
        return self.split_heads(self(x, norm=norm, grad_from=handoff), handoff)

    def split_heads(self, y: torch.Tensor, handoff: GradHandoff | None = None):
        """This rank's output [..., local features] as q [..., local heads, head_dim] and k, v
        [..., local kv heads, head_dim] (views of y); `handoff`: the one this layer's forward
        took as `grad_from`, for the fused gradient cast of `heads`."""
        return _SplitHeads.apply(y, self, handoff)


class _SplitHeads(torch.autograd.Function):
    """QKVParallelLinear.split_heads. Backward concatenates the gradients of q, k and v into the
    gradient of y, or, when the layer takes its output gradient from `handoff` (ready), casts
    them in FP8 for it straight from where attention's backward left them."""

    @staticmethod
    def forward(ctx, y, layer: QKVParallelLinear, handoff: GradHandoff | None):
        ctx.layer, ctx.handoff, ctx.y_shape, ctx.y_dtype = layer, handoff, y.shape, y.dtype
        queries_per_group = layer.num_heads // layer.num_kv_heads
        groups = rearrange(
            y,
            "... (groups heads d) -> ... groups heads d",
            heads=queries_per_group + 2,
            d=layer.head_dim,
        )
        q, k, v = groups.split([queries_per_group, 1, 1], dim=-2)
        return (
            rearrange(q, "... groups heads d -> ... (groups heads) d"),
            k.squeeze(-2),
            v.squeeze(-2),
        )

    @staticmethod
    def backward(ctx, dq, dk, dv):
        layer, handoff = ctx.layer, ctx.handoff
        tokens = ctx.y_shape[:-1].numel()
        grads = []
        for grad, heads in (
            (dq, layer.num_heads),
            (dk, layer.num_kv_heads),
            (dv, layer.num_kv_heads),
        ):
            width = heads // layer.tp_size * layer.head_dim
            grads.append(
                grad.reshape(tokens, width)
                if grad is not None
                else torch.zeros(tokens, width, dtype=ctx.y_dtype, device=layer.weight.device)
            )
        source = HeadGradsSource(*grads, layer.head_dim)
        if handoff is not None and handoff.ready:
            # shape, dtype and device, no memory
            y_like = grads[0].new_zeros(()).expand(ctx.y_shape)
            return hand_over_gradient(source, layer, handoff, like=y_like), None, None
        return source.materialize().view(ctx.y_shape), None, None
