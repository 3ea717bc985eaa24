"""Mixed-precision AdamW: bf16 (or fp32) model parameters, fp32 master weights and Adam states,
fp32 gradients from the data-parallel gradient buffer; global gradient-norm clipping over every
model-parallel rank; the distributed optimizer (ZeRO-1) as a sharding of the same thing.

Each rank keeps a master copy of the parameter elements it owns: all of them, or with
`distributed=True` its 1/dp slice of every gradient bucket (`GradientBuffer(shard=True)`), so
master weights and Adam states are spread over the data-parallel ranks. After the step the
owners' updated elements are all-gathered into every replica's parameters: at once, or with
`overlap_param_gather` (Megatron's --overlap-param-gather) bucket by bucket beside the next
forward, which calls `wait_for_params` before it reads a bucket's parameters; anything else
that reads them first calls `finish_param_gather`.

On CUDA the step is one fused pass (`adamw_kernel`): AdamW over every master, the clipping
factor applied as gradients are read, and the new weights written in the model's dtype (into
the parameters, or into the all-gather's input), bit for bit what torch's fused AdamW and a copy
give; and, for the FP8 linears it is given whose weights it updates whole, the FP8 cast of the
new weight that their next forward would otherwise make (delayed scaling: the scale is known).
On the CPU, or with `fused=False`, torch.optim.AdamW steps and a multi-tensor copy follows.

FP8 primary weights (`make_weights_fp8`): FP8 linears whose weights are their FP8 casts only;
each step casts the fp32 masters into them (the fused pass in place of the bf16 copy, or
Fp8Linear.write_weight after torch's step). With the distributed optimizer (Megatron's
--fp8-param-gather) each rank casts its slices with the weights' scales into FP8 all-gather
inputs: their buckets (`GradientBuffer(bucket_apart=...)`) travel as one byte an element, the
weights' amaxes are agreed over the data-parallel ranks (by the forward's amax reduction, or
here), and each rank makes the transposes from the gathered bytes.

Lean states (each an option; Megatron's precision-aware optimizer): Adam's moments in bf16 (the
first also in FP8 with a scale per block, `quantize_moment`), the gradients from a bf16 buffer
(`GradientBuffer(dtype=torch.bfloat16)`), and with `store_param_remainders` no fp32 master
beside the bf16 parameter: the parameter is the master's high half and an int16 its low half,
so the master stays exact in 2 more bytes instead of 4.
They need the fused pass. Checkpoints hold fp32 whatever the options (`state_for_checkpoint`):
a run may resume with other options, and lean states come back bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megafp8.collectives import all_gather_into, group_size, max_over, rank_in
from megafp8.fp8.quantize import quantize_torch
from megafp8.parallel.data_parallel import GradientBuffer

from . import adamw_kernel

# What Adam's moments and the gradient buffer may be kept in, by the trainer flags' names
# (--exp-avg-dtype, --exp-avg-sq-dtype, --main-grads-dtype); fp8 for the first moment only
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
LEAN_DTYPES = {
    "exp_avg": tuple(STATE_DTYPES.values()),
    # E4M3 spans 2^17 within a block, a second moment's squares far more: the small ones would
    # flush to zero and their updates blow up (MS-AMP keeps it in 16 bits too)
    "exp_avg_sq": (torch.float32, torch.bfloat16),
}


def no_weight_decay(name: str, param) -> bool:
    """Biases and norm weights (every 1-D parameter) are not decayed, as in Megatron-LM."""
    return name.endswith(".bias") or param.ndim == 1


def counts_towards_norm(param, tp_rank: int) -> bool:
    """Whether this rank's copy of `param` enters the global gradient norm: a parameter every
    tensor-parallel rank holds whole is counted on tp rank 0 only, and the last pipeline stage's
    copy of a tied embedding (`shared_embedding_copy`) not at all: the first stage counts it."""
    if getattr(param, "shared_embedding_copy", False):
        return False
    return hasattr(param, "partition") or tp_rank == 0


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 high half, int16 remainder) of fp32 `master`, as the fused pass stores it with
    `store_param_remainders`: the high half is the master rounded half away from zero on its bits
    (so that the remainder fits 16 signed bits), and `join_master` gives the master back exactly."""
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = (bits + 0x8000) >> 16
    low = bits - (high << 16)
    high = torch.where(high >= 0x8000, high - 0x10000, high)
    return high.to(torch.int16).view(torch.bfloat16), low.to(torch.int16)


def join_master(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 master whose `split_master` is (`high`, `low`)."""
    bits = ((high.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF) << 16) + low.to(
        torch.int64
    )
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def quantize_moment(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 bytes, fp32 inverse scale of each block of MOMENT_BLOCK elements) of the flat fp32
    `moment`, as the fused pass keeps an FP8 first moment: each block scaled by the power of two
    that puts its largest magnitude in (224, 448] (an all-zero block by 2^126), rounded to nearest.
    The values of a moment quantized this way come back exactly from its dequantized values (the
    bytes too, but for a block whose largest byte rounded down to 224: it comes back at twice
    the scale, every byte doubled), which makes a resumed run's moment the saved one."""
    block = adamw_kernel.MOMENT_BLOCK
    padded = torch.nn.functional.pad(moment.float(), (0, -moment.numel() % block)).view(-1, block)
    amax = padded.abs().amax(dim=1)
    ratio = torch.clamp(torch.full_like(amax, 448.0) / amax, max=2.0**126)
    scale = ((ratio.view(torch.int32) >> 23) << 23).view(torch.float32)
    q = (padded * scale[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(-1)[: moment.numel()].clone(), 1.0 / scale


def dequantize_moment(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The fp32 values of an FP8 first moment (`quantize_moment`'s bytes and inverse scales)."""
    per_element = scale_inv.repeat_interleave(adamw_kernel.MOMENT_BLOCK)[: q.numel()]
    return q.float() * per_element


def _norm_of(squared: float) -> float:
    return math.sqrt(squared) if math.isfinite(squared) else float("nan")


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """||t||^2 in fp32, accurately. CUDA's norm kernel reduces as a tree; the CPU's adds in
    sequence (1e-5 off at 10^5 elements, 1e-2 at 10^7), its sum() in cascade (1e-7 at any size)."""
    if t.is_cuda:
        return torch.linalg.vector_norm(t, dtype=torch.float32) ** 2
    return t.float().square().sum()


def squared_norms(tensors) -> torch.Tensor:
    """||t||^2 of each tensor in fp32 (accurately, as `squared_norm`), as one vector."""
    if tensors[0].is_cuda:
        # A few launches for all of them (per chunk of 65536 elements, then per tensor), not one
        # per tensor: 290 tensors took 3.0 ms per step of GPT-1.3B, most of it launch-bound.
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square()
    return torch.stack([squared_norm(t) for t in tensors])


class MixedPrecisionAdamW:
    """AdamW over fp32 masters of the parameter elements this rank owns.

    `step()` returns (applied, grad_norm): a step whose gradients hold inf/NaN anywhere in the
    model is skipped on every rank alike and leaves parameters and states untouched.

    `fused`: step with the fused pass of `adamw_kernel` (None: on CUDA when triton is there, and
    with lean states wherever it runs; True also runs in Triton's interpreter, for tests). Its
    state is torch.optim.AdamW's, in `self.optimizer.state`, so checkpoints do not depend on it.

    `fp8_linears`: FP8 linears (megafp8.fp8.Fp8Linear) of these parameters; the fused pass
    writes their weights' FP8 casts too, where `Fp8Linear.weight_cast_target` allows (not with
    the distributed optimizer, whose ranks update slices, nor with lean states; but an FP8
    primary weight's, or its slices', always). Their cast buffers are then kept from step to
    step (`keep_weight_cast_addresses`).

    Lean states (the module's docstring, fused pass only): `exp_avg_dtype` (fp32, bf16 or
    float8_e4m3fn) and `exp_avg_sq_dtype` (fp32 or bf16), `store_param_remainders` (bf16
    parameters); the gradients' dtype is the buffer's. Their state is then the pass's own
    (`self.state`), not torch.optim's (`self.optimizer` is None).
    """

    def __init__(
        self,
        named_params,
        buffer: GradientBuffer,
        *,
        lr,
        weight_decay=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
        clip_grad=1.0,
        model_parallel_group=None,
        tp_group=None,
        dp_group=None,
        distributed=False,
        overlap_param_gather=False,
        fused=None,
        fp8_linears=(),
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        store_param_remainders=False,
    ):
        named_params = [(n, p) for n, p in named_params if p.requires_grad]
        for what, dtype in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
            if dtype not in LEAN_DTYPES[what]:
                raise ValueError(f"{what} in {dtype}: it is kept in one of {LEAN_DTYPES[what]}")
        if store_param_remainders and any(p.dtype != torch.bfloat16 for _, p in named_params):
            odd = sorted({str(p.dtype) for _, p in named_params} - {"torch.bfloat16"})
            raise ValueError(
                f"store_param_remainders keeps the fp32 master as the bf16 parameter and 16 more bits: "
                f"it needs bf16 parameters, these are {', '.join(odd)}"
            )
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.store_param_remainders = store_param_remainders
        lean = [
            what
            for what, on in (
                (f"exp_avg in {exp_avg_dtype}", exp_avg_dtype != torch.float32),
                (f"exp_avg_sq in {exp_avg_sq_dtype}", exp_avg_sq_dtype != torch.float32),
                (f"gradients in {buffer.data.dtype}", buffer.data.dtype != torch.float32),
                ("store_param_remainders", store_param_remainders),
            )
            if on
        ]
        self.names = {p: n for n, p in named_params}
        self.buffer, self.distributed, self.clip_grad = buffer, distributed, clip_grad
        self.model_parallel_group, self.dp_group = model_parallel_group, dp_group
        if distributed and not buffer.shard:
            raise ValueError(
                "the distributed optimizer needs a GradientBuffer built with shard=True"
            )
        if overlap_param_gather and not distributed:
            raise ValueError(
                "overlap_param_gather overlaps the distributed optimizer's parameter all-gather: "
                "it needs distributed=True"
            )
        self.overlap_param_gather = overlap_param_gather
        self._pending_gathers = {}  # bucket -> (all-gather handle, gathered elements): not copied yet
        tp_rank = rank_in(tp_group)
        # (param, start, end, master): the flattened element range of param this rank updates,
        # and its fp32 master (with store_param_remainders, the int16 remainder; see split_master).
        self.shards, self._grads = [], []
        ranges = (
            buffer.owned_ranges() if distributed else [(p, 0, p.numel()) for _, p in named_params]
        )
        groups = {True: [], False: []}
        for param, start, end in ranges:
            grad = param.main_grad.view(-1)[start:end]
            if store_param_remainders:  # the parameter is the master's rounding: nothing remains
                master = torch.zeros(end - start, dtype=torch.int16, device=param.device)
            else:
                master = param.detach().reshape(-1)[start:end].float().clone()
                if grad.dtype == torch.float32:  # torch.optim's step reads it there
                    master.grad = grad
            self.shards.append((param, start, end, master))
            self._grads.append(grad)
            groups[no_weight_decay(self.names[param], param)].append(master)
        # Per master, for the fused pass: torch skips the decay where the group's is 0.
        self._decayed = [
            weight_decay != 0 and not no_weight_decay(self.names[p], p) for p, *_ in self.shards
        ]
        self.norm_mask = [counts_towards_norm(p, tp_rank) for p, *_ in self.shards]
        param_groups = [
            {"params": groups[False], "weight_decay": weight_decay},
            {"params": groups[True], "weight_decay": 0.0},
        ]
        param_groups = [g for g in param_groups if g["params"]]
        device = named_params[0][1].device
        torch_kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
        # torch.optim.AdamW steps the fp32 states of the unfused path, and holds the fused pass's
        # (torch could go on from them); lean states are the pass's alone.
        self.optimizer = (
            None
            if lean
            else torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, **torch_kind)
        )
        self.state = {} if lean else self.optimizer.state  # per master: step, exp_avg, exp_avg_sq
        self.lr = lr
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay
        self.steps = 0
        # Where each master's new value goes (copies or the fused pass): the parameter itself,
        # or with the distributed optimizer this rank's slice of its bucket's all-gather input.
        if distributed:
            self._gather_inputs = {}
            for bucket in buffer.buckets:
                mine = buffer.owned_slice(bucket)
                self._gather_inputs[bucket] = torch.zeros(
                    mine.stop - mine.start, dtype=bucket.params[0].dtype, device=device
                )
            self._outs = [
                self._gather_input_of(param, start, end) for param, start, end, _ in self.shards
            ]
            self._out_sources = [master for *_, master in self.shards]
            # the masters' rounding, which the remainders complete
            torch._foreach_copy_(
                self._outs,
                [param.detach().reshape(-1)[start:end] for param, start, end, _ in self.shards],
            )
        else:
            self._outs = [param for param, *_ in self.shards]
            self._out_sources = [master.view_as(param) for param, _, _, master in self.shards]
        fusable = adamw_kernel.available(device) and all(p.is_contiguous() for _, p in named_params)
        if fused and not fusable:
            raise ValueError(
                "fused=True needs triton and contiguous parameters on CUDA "
                "(or Triton's interpreter, TRITON_INTERPRET=1)"
            )
        self.fused = (fusable and (device.type == "cuda" or bool(lean))) if fused is None else fused
        if lean and not self.fused:
            raise ValueError(
                f"{', '.join(lean)}: lean optimizer states need the fused optimizer pass (CUDA with "
                f"triton, or Triton's interpreter, TRITON_INTERPRET=1); torch.optim.AdamW, the other "
                f"path, keeps fp32 masters, gradients and moments"
            )
        self._fused_pass = None  # built at the first fused step, again after the state is replaced
        # Per shard, the FP8 linear whose weight it is (or a slice of), if any: it may hold its
        # weight in FP8 only (`make_weights_fp8`), and the fused pass casts a whole bf16 weight
        # too. Not with lean states, unless the weight is FP8 alone: the casting kernel's tiles
        # of 2- and 4-byte states ran at 1.4 TB/s on an H200, the 7B shape's step 3.5% slower
        # than the plain pass and the forwards' own casts (benchmarks/RESULTS.md).
        fp8_linears = list(fp8_linears)
        self._fp8_linears = {id(linear) for linear in fp8_linears}
        linear_of = {id(linear.weight): linear for linear in fp8_linears}
        self._linears = [linear_of.get(id(param)) for param, *_ in self.shards]
        self._pass_casts = self.fused and not lean and not distributed
        # FP8 primary weights (make_weights_fp8); with the distributed optimizer, the buckets
        # gathered in FP8 with their linears, and whether the weights' amaxes need agreeing here
        self._fp8_weight_linears, self._fp8_buckets, self._agree_amaxes = [], {}, False
        for linear in filter(None, self._linears if self._pass_casts else ()):
            linear.keep_weight_cast_addresses = True
        self._fused_casts = None  # the addresses of the casts the fused pass was built with

    def _gather_input_of(self, param, start, end):
        """The elements [start, end) of flattened `param` in its bucket's all-gather input."""
        bucket = self.buffer.bucket_of[param]
        offset = param.main_grad_offset - bucket.start - self.buffer.owned_slice(bucket).start
        return self._gather_inputs[bucket][offset + start : offset + end]

    def set_lr(self, lr):
        self.lr = lr
        for group in self.optimizer.param_groups if self.optimizer is not None else ():
            group["lr"] = lr

    def grad_norm(self) -> float:
        """The L2 norm of the whole model's gradient (inf/NaN if any element is). Each rank's
        pieces are summed in fp64, so the norm does not depend on how dp and pp slice them."""
        return _norm_of(self._squared_grad_norm().item())

    def _squared_grad_norm(self) -> torch.Tensor:
        """The model's squared gradient norm, fp64 [1] on the device; nothing waited for."""
        grads = [grad for grad, counted in zip(self._grads, self.norm_mask) if counted]
        device = self.buffer.data.device
        local = (
            squared_norms(grads).double().sum()
            if grads
            else torch.zeros((), dtype=torch.float64, device=device)
        )
        local = local.reshape(1)
        # Owners of disjoint pieces: sum over the model-parallel ranks, and over dp when sharded.
        for group in (self.model_parallel_group, self.dp_group if self.distributed else None):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(local, group=group)
        return local

    def step(self):
        """Clip and update, unless a gradient is not finite; (applied, the gradient norm).

        The fused pass is queued before the norm reaches the host: the clipping factor and the
        skip are decided on the device, and the host waits for the norm only, not for the update
        (which it would otherwise wait for, then leave the GPU idle while it launched it). Host
        copies queued before this call (`tensor.to("cpu", non_blocking=True)`) are complete
        when it returns."""
        if self.fused:
            return self._fused_step()
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return False, norm
        if self.clip_grad and norm > self.clip_grad:
            torch._foreach_mul_(self._grads, self.clip_grad / (norm + 1e-6))
        self.optimizer.step()
        self._copy_masters_to_params()
        self.steps += 1
        return True, norm

    def _pass_cast(self, i: int):
        """The WeightCast the fused pass writes beside shard i's new value, if any: its whole
        weight's cast, or for an FP8 primary weight's slice (the distributed optimizer's) the
        slice's bytes in its all-gather input, cast with the weight's scale."""
        linear = self._linears[i]
        if linear is None or not (self._pass_casts or linear.fp8_primary_weight):
            return None
        cast = linear.weight_cast_target()
        if cast is not None and self.distributed:
            cast = cast._replace(data=self._outs[i].view(-1), data_t=None)
        return cast

    @torch.no_grad()
    def _fused_step(self):
        # The norm first: the GPU may have run out of work (a pipeline's last stage waits for its
        # peer), and would otherwise idle while the host gathers the casts below.
        squared = self._squared_grad_norm()
        norm = squared.sqrt()
        # The unfused path's factor, in its fp64 arithmetic (not `clip / tensor`, a reciprocal
        # times clip), rounded to fp32 as its scalar multiply rounds it: the same bits (GPU test).
        coefficient = norm.new_ones(1)
        if self.clip_grad:
            coefficient = torch.where(
                norm > self.clip_grad,
                torch.full_like(norm, self.clip_grad) / (norm + 1e-6),
                coefficient,
            )
        control = torch.cat([coefficient, torch.isfinite(norm).double()]).float()
        squared_on_host = squared.to("cpu", non_blocking=True)
        ready = torch.cuda.Event() if squared.is_cuda else None
        if ready is not None:
            ready.record()
        casts = [self._pass_cast(i) for i in range(len(self.shards))]
        addresses = [
            None if cast is None else [t.data_ptr() for t in cast if t is not None]
            for cast in casts
        ]
        # a layer's cast came or went
        if self._fused_pass is None or addresses != self._fused_casts:
            self._fused_pass, self._fused_casts = self._build_fused_pass(casts), addresses
        if self._fp8_buckets:  # a rank may own no slice of a weight: its amax starts at 0 here
            self._zero_weight_amaxes()
        self._fused_pass.step(self.lr, control)
        written = [linear for linear, cast in zip(self._linears, casts) if cast is not None]
        for linear in self._fp8_weight_linears if self._fp8_buckets else written:
            linear.weight_cast_written()
        self._agree_on_weight_amaxes()
        self._gather_params()
        if ready is not None:
            ready.synchronize()  # the norm's copy (and all before it), not the update queued after
        norm = _norm_of(squared_on_host.item())
        applied = math.isfinite(norm)
        self.steps += applied
        return applied, norm

    def _build_fused_pass(self, casts):
        # torch.optim.AdamW's state, created as its fused step would; the step counts become
        # elements of one tensor, so that one launch advances them all.
        masters = [master for *_, master in self.shards]
        steps = torch.zeros(len(masters), dtype=torch.float32, device=masters[0].device)
        for i, master in enumerate(masters):
            state = self.state.setdefault(master, {})
            if "step" in state:
                steps[i] = state["step"]
            else:
                for key, dtype in (
                    ("exp_avg", self.exp_avg_dtype),
                    ("exp_avg_sq", self.exp_avg_sq_dtype),
                ):
                    state[key] = torch.zeros(master.numel(), dtype=dtype, device=master.device)
                if self.exp_avg_dtype == torch.float8_e4m3fn:
                    blocks = -(-master.numel() // adamw_kernel.MOMENT_BLOCK)
                    state["exp_avg_scale_inv"] = torch.ones(blocks, device=master.device)
            state["step"] = steps[i]
        states = [self.state[m] for m in masters]
        fp8_moments = self.exp_avg_dtype == torch.float8_e4m3fn
        return adamw_kernel.MultiTensorAdamW(
            masters,
            self._grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            steps,
            [out.detach().view(-1) for out in self._outs],
            self._decayed,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            casts=casts,
            exp_avg_scales=[s["exp_avg_scale_inv"] for s in states] if fp8_moments else None,
        )

    @torch.no_grad()
    def make_weights_fp8(
        self, linears, fp8_dtype=torch.float8_e4m3fn, amax_reduction_group=None, margin=0
    ) -> None:
        """Hold the weights of `linears` (FP8 linears given as `fp8_linears`) only in FP8 from
        here on (Fp8Linear.make_weight_fp8, with `amax_reduction_group` and `margin`), cast from
        their fp32 masters; each step writes them from the masters directly. The optimizer must
        keep fp32 masters of its own (not `store_param_remainders`, whose master is the bf16
        weight), and the fused pass must be able to cast (no FP8 first moment). With the
        distributed optimizer, the gradient buffer must hold these weights in buckets of their
        own (`bucket_apart`), which are all-gathered as FP8 bytes."""
        reasons = [
            why
            for why, on in (
                (
                    "store_param_remainders keeps the master in the bf16 weight",
                    self.store_param_remainders,
                ),
                (
                    "an FP8 first moment steps in the pass that casts no weights",
                    self.exp_avg_dtype == torch.float8_e4m3fn,
                ),
            )
            if on
        ]
        if reasons:
            raise ValueError(f"FP8 primary weights cannot be used here: {'; '.join(reasons)}")
        linears = list(linears)
        for linear in linears:
            if id(linear) not in self._fp8_linears:
                raise ValueError(f"{linear}: not among this optimizer's fp8_linears")
        self._fp8_weight_linears = linears
        if self.distributed:
            self._make_gathered_weights_fp8(linears, fp8_dtype, amax_reduction_group, margin)
        else:
            index = {id(linear): i for i, linear in enumerate(self._linears) if linear is not None}
            for linear in linears:
                master = self.shards[index[id(linear)]][3].view_as(linear.weight)
                linear.make_weight_fp8(fp8_dtype, master, amax_reduction_group, margin)
        self._fused_pass = None  # its outputs changed dtype

    def _make_gathered_weights_fp8(self, linears, fp8_dtype, amax_reduction_group, margin):
        """make_weights_fp8 with the distributed optimizer: the weights' buckets gathered in FP8."""
        weights = {id(linear.weight): linear for linear in linears}
        for bucket in self.buffer.buckets:
            fp8 = [p for p in bucket.params if id(p) in weights]
            if fp8 and len(fp8) != len(bucket.params):
                raise ValueError(
                    "a gradient bucket holds FP8 primary weights beside other parameters: the "
                    "distributed optimizer all-gathers a bucket in one dtype; build the "
                    "GradientBuffer with bucket_apart=<those weights>"
                )
            if fp8:
                self._fp8_buckets[bucket] = [weights[id(p)] for p in fp8]
                self._gather_inputs[bucket] = torch.zeros_like(
                    self._gather_inputs[bucket], dtype=fp8_dtype
                )
        # The masters came from the weights: the first scales are fitted to those.
        for linear in linears:
            linear.make_weight_fp8(fp8_dtype, None, amax_reduction_group, margin)
        self._outs = [
            self._gather_input_of(param, start, end) for param, start, end, _ in self.shards
        ]
        # The forward's amax reduction agrees the weights' amaxes only over a group holding
        # every data-parallel rank.
        self._agree_amaxes = group_size(self.dp_group) > 1 and not (
            amax_reduction_group is not None
            and set(dist.get_process_group_ranks(self.dp_group))
            <= set(dist.get_process_group_ranks(amax_reduction_group))
        )
        self._copy_masters_to_params()
        self.finish_param_gather()

    def _zero_weight_amaxes(self) -> None:
        """Every FP8 primary weight's amax and cast counts at 0: what its slices' casts max
        and add into."""
        targets = [linear.weight_cast_target() for linear in self._fp8_weight_linears]
        torch._foreach_zero_([t.amax for t in targets] + [t.counts for t in targets])

    def _agree_on_weight_amaxes(self) -> None:
        """The distributed optimizer's ranks cast slices: each weight's amax is the largest of
        its slices', over the data-parallel ranks (when the forward's reduction does not)."""
        if not self._agree_amaxes:
            return
        amaxes = [linear.weight_cast_target().amax for linear in self._fp8_weight_linears]
        torch._foreach_copy_(amaxes, list(max_over(torch.stack(amaxes), self.dp_group).unbind(0)))

    @torch.no_grad()
    def _copy_masters_to_params(self):
        copies = []
        if self._fp8_buckets:
            self._zero_weight_amaxes()
        for i, (out, source, linear) in enumerate(
            zip(self._outs, self._out_sources, self._linears)
        ):
            if linear is None or not linear.fp8_primary_weight:
                copies.append((out, source))
            elif self.distributed:  # the slice, cast with the weight's scale into the gather input
                # (in torch: a flat slice as one row of up to 10^8 columns is beyond the Triton
                # cast's grid)
                cast = self._pass_cast(i)
                q = quantize_torch(
                    source.view(1, -1),
                    out.dtype,
                    cast.scale,
                    0,
                    True,
                    False,
                    amax_out=cast.amax,
                    saturation_out=cast.counts,
                )
                out.copy_(q.data.view(-1))
            else:
                linear.write_weight(source)  # cast with its scale
        for linear in self._fp8_weight_linears if self._fp8_buckets else ():
            linear.weight_cast_written()
        # with remainders the outputs are the masters' high halves already
        if copies and not self.store_param_remainders:
            torch._foreach_copy_(*map(list, zip(*copies)))
        self._agree_on_weight_amaxes()
        self._gather_params()

    def _master(self, i: int) -> torch.Tensor:
        """Shard i's fp32 master, flat (with remainders, joined from the parameter's bits)."""
        master = self.shards[i][3]
        if self.store_param_remainders:
            return join_master(self._outs[i].detach().view(-1), master)
        return master

    def _moment(self, i: int, key: str) -> torch.Tensor:
        """Shard i's `key` moment in fp32, flat (zeros before the first step)."""
        master = self.shards[i][3]
        state = self.state.get(master, {})
        moment = state.get(key)
        if moment is None:
            return torch.zeros(master.numel(), dtype=torch.float32, device=master.device)
        if moment.dtype == torch.float8_e4m3fn:
            return dequantize_moment(moment, state[f"{key}_scale_inv"])
        return moment.float()

    @torch.no_grad()
    def _gather_params(self):
        """Distributed optimizer: each rank's slice of every bucket (its masters' new values) is
        all-gathered, and the whole bucket copied into the parameters; with overlap_param_gather
        the gathers are launched in the order the forward reads the buckets (the reverse of the
        gradient buffer's) and each is copied when `wait_for_params` asks for it."""
        if not self.distributed:
            return
        self.finish_param_gather()  # a bucket no forward asked for since the last step
        for bucket in reversed(self.buffer.buckets):
            mine = self._gather_inputs[bucket]
            gathered = torch.empty(bucket.end - bucket.start, dtype=mine.dtype, device=mine.device)
            handle = all_gather_into(
                gathered, mine, self.dp_group, async_op=self.overlap_param_gather
            )
            self._pending_gathers[bucket] = (handle, gathered)
            if not self.overlap_param_gather:
                self._copy_gathered(bucket)

    @torch.no_grad()
    def wait_for_params(self, params) -> None:
        """With overlap_param_gather: the step's new values are in `params` from here on (their
        buckets' all-gathers waited for and copied); nothing to do for the others."""
        if self._pending_gathers:
            for bucket in {self.buffer.bucket_of[p] for p in params if p in self.buffer.bucket_of}:
                if bucket in self._pending_gathers:
                    self._copy_gathered(bucket)

    def finish_param_gather(self) -> None:
        """Every parameter holds the step's new values (overlap_param_gather: before a save, an
        evaluation, or the end of training)."""
        for bucket in list(self._pending_gathers):
            self._copy_gathered(bucket)

    @torch.no_grad()
    def _copy_gathered(self, bucket) -> None:
        handle, gathered = self._pending_gathers.pop(bucket)
        if handle is not None:
            handle.wait()
        linears = self._fp8_buckets.get(bucket, ())
        params = [p.view(torch.uint8) if linears else p for p in bucket.params]  # FP8 as bytes
        if linears:
            gathered = gathered.view(torch.uint8)
        pieces = [
            gathered[p.main_grad_offset - bucket.start :][: p.numel()].view_as(p)
            for p in bucket.params
        ]
        torch._foreach_copy_(params, pieces)
        for linear in linears:
            linear.weight_bytes_written()

    # -- checkpoints: per-parameter, layout-free state ----------------------------------------

    def state_for_checkpoint(self):
        """{name: {"master", "exp_avg", "exp_avg_sq"}} as full (local tp shard) fp32 tensors of
        every parameter of this rank (gathered over dp when sharded), plus the step count."""
        if not self.distributed:  # each master is a whole parameter already: fp32 ones not copied
            return {
                self.names[param]: {
                    "master": self._master(i).view_as(param),
                    **{
                        key: self._moment(i, key).view_as(param)
                        for key in ("exp_avg", "exp_avg_sq")
                    },
                }
                for i, (param, *_) in enumerate(self.shards)
            }
        device = self.buffer.data.device
        # Every parameter, in one order on every rank (the dp all-reduce below is collective).
        states = {
            name: {
                key: torch.zeros(param.numel(), dtype=torch.float32, device=device)
                for key in ("master", "exp_avg", "exp_avg_sq")
            }
            for param, name in self.names.items()
        }
        for i, (param, start, end, _) in enumerate(self.shards):
            entry = states[self.names[param]]
            entry["master"][start:end] = self._master(i)
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key][start:end] = self._moment(i, key)
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            for entry in states.values():  # disjoint owners: a sum assembles the whole
                for tensor in entry.values():
                    dist.all_reduce(tensor, group=self.dp_group)
        shapes = {self.names[p]: p.shape for p in self.names}
        return {
            name: {k: v.view(shapes[name]) for k, v in entry.items()}
            for name, entry in states.items()
        }

    def step_count(self) -> int:
        """Optimizer steps applied so far (skipped ones excluded), as Adam's bias correction counts."""
        return self.steps

    @torch.no_grad()
    def reset_masters_from_params(self, values=None):
        """Start over from the current parameters (loaded weights without optimizer state); an
        FP8 primary weight from its high-precision values in `values` ({parameter: values}, what
        a checkpoint held), else from its dequantized bytes."""
        self.state.clear()
        self._fused_pass = None
        values = values or {}
        for i, (param, start, end, master) in enumerate(self.shards):
            linear = self._linears[i]
            if linear is not None and linear.fp8_primary_weight:
                value = values.get(param)
                value = linear.dequantized_weight() if value is None else value
                master.copy_(value.reshape(-1)[start:end])
                if not self.distributed:  # else cast and gathered below
                    linear.write_weight(master.view_as(param))
            elif self.store_param_remainders:
                master.zero_()
                self._outs[i].view(-1).copy_(param.detach().reshape(-1)[start:end])
            else:
                master.copy_(param.detach().reshape(-1)[start:end])
        if self._fp8_buckets:  # the FP8 weights cast from their masters, slice by slice
            self._copy_masters_to_params()
            self.finish_param_gather()

    @torch.no_grad()
    def load_checkpoint_state(self, states, step):
        """Inverse of `state_for_checkpoint`: take this rank's elements of the full tensors."""
        self.steps = step
        self._fused_pass = None  # its state tensors are replaced below
        dtypes = {"exp_avg": self.exp_avg_dtype, "exp_avg_sq": self.exp_avg_sq_dtype}
        for i, (param, start, end, master) in enumerate(self.shards):
            entry = states[self.names[param]]
            saved = (
                entry["master"].reshape(-1)[start:end].to(device=master.device, dtype=torch.float32)
            )
            if self.store_param_remainders:
                high, low = split_master(saved)
                self._outs[i].view(-1).copy_(high)
                master.copy_(low)
            else:
                master.copy_(saved)
            if step:
                state = self.state.setdefault(master, {})
                state["step"] = torch.tensor(
                    float(step),
                    dtype=torch.float32,
                    device=master.device if master.is_cuda else "cpu",
                )
                for key, dtype in dtypes.items():
                    saved = entry[key].reshape(-1)[start:end].to(master.device, torch.float32)
                    if dtype == torch.float8_e4m3fn:
                        state[key], state[f"{key}_scale_inv"] = quantize_moment(saved)
                    else:
                        state[key] = saved.to(dtype).clone()
        self._copy_masters_to_params()
