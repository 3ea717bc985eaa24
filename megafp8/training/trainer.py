"""The pretraining loop: `pretrain(argv)` is what `python -m megafp8.train` runs under torchrun.

One step = one global batch: `num_micro_batches` forward/backward passes (each its own FP8
pass, reusing the step's weight casts), gradients accumulated in fp32 and reduced over data
parallel while the last backward runs, then one optimizer step unless the gradients are not
finite. Checkpoints, evaluation, metrics and a clean exit on SIGTERM/SIGINT hang off the loop.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import sys
import time
import traceback
import warnings
from contextlib import closing
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megafp8 import symmetric_memory
from megafp8.data import (
    DatasetBuildError,
    MockGPTDataset,
    PretrainingSampler,
    build_datasets,
    build_split_datasets,
    build_tokenizer,
    parse_split,
)
from megafp8.fp8 import Fp8Linear, fp8_autocast, fp8_health
from megafp8.messages import show_warnings_as_messages
from megafp8.models.documents import document_layout
from megafp8.models.transformer import TransformerLM, compile_layers
from megafp8.parallel import (
    ParallelGroups,
    PipelineStage,
    finalize_grads,
    forward_backward,
    stage_layers,
)
from megafp8.parallel.data_parallel import GradientBuffer
from megafp8.training import arguments, checkpointing, metrics
from megafp8.training.fp8_sentinel import Fp8Sentinel
from megafp8.training.lr_schedule import LRSchedule
from megafp8.training.optimizer import STATE_DTYPES, MixedPrecisionAdamW, adamw_kernel
from megafp8.training.profiling import StepProfiler


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had non-finite gradients."""


def _init_single_process(timeout: timedelta):
    """A one-process group for a plain `python -m megafp8.train` (no torchrun environment)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timeout,
    )


def _loader_worker_init(worker_id):
    """A data-loading worker leaves SIGTERM and SIGINT to the main process, which saves and stops at
    the next step boundary: torchrun, SLURM and a terminal signal the whole process group, and a
    worker killed first would fail the run inside a step with nothing saved."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


class _ExitSignal:
    """Remembers a SIGTERM/SIGINT so the loop can checkpoint and leave between steps."""

    def __init__(self):
        self.received = None
        self._previous = {}
        self._vote = None  # the last vote's (host copy, its copy's CUDA event or None)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def any_rank(self, device, timed_out: bool = False) -> bool:
        """Whether any rank wants to stop: has received a signal, or `timed_out`. With several
        ranks every call posts this rank's vote (a MAX all-reduce) and answers the previous
        call's, done by now: reading this call's would make the host wait for the step's update
        queued before it, and the GPU would idle while the host started the next step. So every
        rank stops after the same step, one step after the vote."""
        mine = self.received is not None or timed_out
        if dist.get_world_size() == 1:  # no collective, so no wait on the GPU either
            return mine
        previous, self._vote = self._vote, None
        # Filled on the device: torch.tensor([...], device=...) copies from pageable memory and
        # waits for the stream, that is for the whole step queued before it.
        flag = torch.full((1,), float(mine), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.is_cuda:
            copied = torch.cuda.Event()
            flag = flag.to("cpu", non_blocking=True)
            copied.record()
            self._vote = flag, copied
        else:
            self._vote = flag, None
        if previous is None:
            return False
        host, copied = previous
        if copied is not None:
            copied.synchronize()
        return bool(host.item())

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _lr_schedule(args) -> LRSchedule:
    return LRSchedule(
        lr=args.lr,
        min_lr=args.min_lr,
        warmup_iters=args.lr_warmup_iters,
        decay_iters=args.lr_decay_iters or args.train_iters,
        decay_style=args.lr_decay_style,
        wsd_decay_iters=args.lr_wsd_decay_iters or 0,
        wsd_decay_style=args.lr_wsd_decay_style,
    )


class Trainer:
    def __init__(self, args, groups: ParallelGroups):
        self.args, self.groups = args, groups
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        # on the last stage, which has the loss
        self.is_logger = dist.get_rank() == dist.get_world_size() - 1
        # Before anything is built: a typo in --load, or a --save that would write over another run.
        self.replaced_run = checkpointing.check_run_folders(
            args.save, args.load, finetune=args.finetune, overwrite=args.overwrite_save
        )
        self.tokenizer = self._build_tokenizer()
        self.config = self._model_config()
        self.eod = self.tokenizer.eod if self.tokenizer else self.config.vocab_size - 1
        self.recipe = arguments.fp8_recipe(args)
        self.dtype = torch.bfloat16 if args.bf16 else torch.float32
        self.tp_comm_transport = (
            _tp_comm_transport(args, groups.tp_group) if args.tp_comm_overlap else None
        )
        self.chunks = self._build_chunks()
        self.model = PipelineStage(self.chunks, groups)
        self.captured_graphs = []  # per chunk, what its CUDA graphs held when released (release_cuda_graphs)
        self.buffer, self.optimizer = self._build_optimizer()
        self.schedule = _lr_schedule(args)
        self.iteration = self.consumed_samples = self.skipped_steps = self.skipped_in_a_row = 0
        self.history = []  # (iteration, loss) of every step this process ran
        self.grad_norms = []  # (iteration, gradient norm before clipping) of the same steps
        self.last_checkpoint = None  # the checkpoint loaded or saved last, for the run summary
        self._logger = None  # while training: messages go through it, above its progress bar
        self.train_data, self.valid_data, self.test_data = self._datasets()
        self.fp8_active = self.recipe is not None  # whether this iteration trains in FP8
        self.sentinel = self._build_sentinel()
        self._fp8_check_batches = None
        self.run_dir = Path(args.save or args.tensorboard_dir or "runs/latest")
        self.flops_per_token = metrics.flops_per_token(self.config, args.seq_length)

    # -- what the run is built from --------------------------------------------------------

    def _build_tokenizer(self):
        a = self.args
        if not a.tokenizer_type:
            return None
        return build_tokenizer(
            a.tokenizer_type,
            a.tokenizer_model,
            a.vocab_file,
            a.merge_file,
            a.vocab_size,
            a.eod_token,
        )

    def _model_config(self):
        """The flags' model for the tokenizer's vocabulary; the model --load's checkpoint recorded
        is this run's model (none there yet: the flags describe it)."""
        a = self.args
        vocab_size = self.tokenizer.vocab_size if self.tokenizer else a.vocab_size
        checkpoint, saved = checkpointing.latest_model_config(a.load) or (None, None)
        if saved is not None and saved.vocab_size != vocab_size:
            source = (
                f"the tokenizer ({a.tokenizer_type}) has {vocab_size} tokens"
                if self.tokenizer
                else f"--vocab-size is {vocab_size}"
            )
            raise checkpointing.CheckpointError(
                f"{source}, but the model in {checkpoint} has a vocabulary of {saved.vocab_size}: give the "
                "tokenizer it was trained with (its --save folder keeps a copy in tokenizer/)"
            )
        return arguments.model_config(a, vocab_size, saved)

    def _build_chunks(self) -> list:
        """This rank's model chunks: one per virtual pipeline stage, with its layers."""
        a, groups = self.args, self.groups
        if a.balance_pipeline_split:
            self._balance_pipeline_split()
        chunks = [
            TransformerLM(
                self.config,
                tp_group=groups.tp_group,
                sequence_parallel=a.sequence_parallel,
                tp_comm_overlap=a.tp_comm_overlap,
                layers=span,
                seed=a.seed,
                fp8_output_layer=a.fp8_output_layer,
                first_last_layers_bf16=a.first_last_layers_bf16 if self.recipe else 0,
                recompute=a.recompute_granularity or "none",
                recompute_method=a.recompute_method or "uniform",
                recompute_num_layers=a.recompute_num_layers or 1,
                dtype=self.dtype,
                device=self.device,
            )
            for span in self._stage_spans(groups.pp_rank)
        ]
        if a.torch_compile:
            for chunk in chunks:
                compile_layers(chunk)
        return chunks

    def _build_optimizer(self):
        """(the gradient buffer, the optimizer) of this rank's parameters."""
        a, groups = self.args, self.groups
        # One buffer for all chunks: the schedule turns sync on only for each chunk's last
        # backward, so a bucket mixing chunks starts reducing after the later one's. The tied
        # embedding gets a bucket of its own, so both stages' copies are sliced alike over dp.
        # FP8 primary weights are gathered in FP8 by the distributed optimizer: buckets apart.
        fp8_weight_linears = (
            [linear for chunk in self.chunks for linear in chunk.fp8_linears()]
            if a.fp8_primary_weights
            else []
        )
        buffer = GradientBuffer(
            self.model.parameters(),
            groups.dp_group,
            bucket_size=a.ddp_bucket_size,
            shard=a.use_distributed_optimizer,
            overlap=a.overlap_grad_reduce,
            own_bucket=self.model.own_buckets,
            dtype=STATE_DTYPES[a.main_grads_dtype],
            bucket_apart=[linear.weight for linear in fp8_weight_linears]
            if a.use_distributed_optimizer
            else (),
        )
        lean = [
            f"--{flag.replace('_', '-')} {getattr(a, flag)}"
            for flag in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_grads_dtype")
            if getattr(a, flag) != "fp32"
        ]
        lean += ["--store-param-remainders"] * a.store_param_remainders
        if lean and not adamw_kernel.available(self.device):
            raise arguments.ArgumentsError(
                f"{', '.join(lean)}: lean optimizer states are kept by the fused optimizer pass, "
                f"which runs on a CUDA GPU with triton; leave them out here"
            )
        fp8_linears = [module for module in self.model.modules() if isinstance(module, Fp8Linear)]
        for module in fp8_linears:
            module.fuse_wgrad_accumulation = a.gradient_accumulation_fusion
            module.fuse_neighbours = a.fp8_neighbour_fusion
        optimizer = MixedPrecisionAdamW(
            self.model.named_parameters(),
            buffer,
            lr=a.lr,
            weight_decay=a.weight_decay,
            betas=(a.adam_beta1, a.adam_beta2),
            eps=a.adam_eps,
            clip_grad=a.clip_grad,
            model_parallel_group=groups.model_parallel_group,
            tp_group=groups.tp_group,
            dp_group=groups.dp_group,
            distributed=a.use_distributed_optimizer,
            overlap_param_gather=a.overlap_param_gather,
            fp8_linears=fp8_linears if self.recipe is not None else (),
            exp_avg_dtype=STATE_DTYPES[a.exp_avg_dtype],
            exp_avg_sq_dtype=STATE_DTYPES[a.exp_avg_sq_dtype],
            store_param_remainders=a.store_param_remainders,
        )
        if a.fp8_primary_weights:  # no bf16 copy of the FP8 layers' weights from here on
            optimizer.make_weights_fp8(
                fp8_weight_linears,
                self.recipe.fp8_format.forward_dtype,
                groups.amax_reduction_group if self.recipe.reduce_amax else None,
                self.recipe.margin,
            )
        if a.overlap_param_gather:  # a forward waits for each part's gather as it reaches it
            for chunk in self.chunks:
                chunk.params_needed = optimizer.wait_for_params
        return buffer, optimizer

    def _build_sentinel(self) -> Fp8Sentinel | None:
        """The bf16 sentinel (fp8_sentinel.py): FP8 checked against bf16, with a fallback."""
        a = self.args
        if self.recipe is None or not a.fp8_check_interval:
            return None
        if self.valid_data is None:
            raise arguments.ArgumentsError(
                "--fp8-check-interval evaluates held-out micro-batches: give validation data (a --split with "
                "a validation share, or --valid-data-path)"
            )
        return Fp8Sentinel(
            a.fp8_check_interval, a.fp8_check_tolerance, a.fp8_fallback_iters, a.fp8_max_fallbacks
        )

    # -- data ------------------------------------------------------------------------------

    def _stage_spans(self, pp_rank: int) -> list[tuple[float, float]]:
        """The layers of each model chunk of pipeline rank `pp_rank`, as the flags split them."""
        a = self.args
        return stage_layers(
            self.config.num_layers,
            a.pipeline_model_parallel_size,
            pp_rank,
            a.virtual_pipeline_model_parallel_size or 1,
            a.decoder_first_pipeline_num_layers,
            a.decoder_last_pipeline_num_layers,
            a.pipeline_stage_layers,
        )

    def _balance_pipeline_split(self) -> None:
        """--balance-pipeline-split: choose the first and last virtual stages' layers, and say so."""
        a = self.args
        cost = arguments.balance_pipeline_split(a, self.config)
        if self.is_logger:
            spans = sorted(
                span
                for rank in range(a.pipeline_model_parallel_size)
                for span in self._stage_spans(rank)
            )
            print(
                f"pipeline split: virtual stages of {', '.join(f'{end - start:g}' for start, end in spans)} layers "
                f"(the output layer counts as {cost:.1f} layers on the last)",
                flush=True,
            )

    def _datasets(self):
        a = self.args
        evals = (
            (a.train_iters // a.eval_interval + 1) * a.eval_iters
            if a.eval_interval and a.eval_iters
            else 0
        )
        if a.fp8_check_interval and a.fp8_format:  # the sentinel's held-out batches: the first ones
            evals = max(evals, a.fp8_check_iters)
        counts = (
            a.train_iters * a.global_batch_size,
            evals * a.global_batch_size,
            a.eval_iters * a.global_batch_size,
        )
        if a.mock_data:
            return [
                MockGPTDataset(
                    self.config.vocab_size, a.seq_length, n, a.data_seed + k, eod=self.eod
                )
                if n
                else None
                for k, n in enumerate(counts)
            ]
        # Token ids past the tokenizer's vocabulary would train the embedding's padding rows, or crash.
        vocab_size = self.tokenizer.vocab_size if self.tokenizer else self.config.vocab_size
        if a.train_data_path:  # a path per split
            return build_split_datasets(
                (a.train_data_path, a.valid_data_path, a.test_data_path),
                a.seq_length,
                counts,
                a.data_seed,
                a.data_cache_path,
                vocab_size,
            )
        # A split given no share in --split is not asked for samples.
        counts = [n if share > 0 else 0 for n, share in zip(counts, parse_split(a.split))]
        return build_datasets(
            a.data_path, a.split, a.seq_length, counts, a.data_seed, a.data_cache_path, vocab_size
        )

    def _micro_batches(self, dataset, consumed):
        """Endless-enough iterator of this dp rank's micro-batches, from `consumed` samples on.
        Close it when done: its workers ignore SIGTERM (see _loader_worker_init), so the loader
        must end them itself (at exit, Python's multiprocessing would SIGTERM and wait forever)."""
        sampler = PretrainingSampler(
            len(dataset),
            consumed,
            self.args.micro_batch_size,
            self.groups.dp_rank,
            self.groups.dp_size,
        )
        # Its own generator: starting an iterator draws a worker seed, which must not come from
        # the global CPU generator that dropout uses (a resumed run would be one draw off).
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=self.args.num_workers,
            pin_memory=self.device.type == "cuda",
            worker_init_fn=_loader_worker_init,
            generator=torch.Generator().manual_seed(self.args.data_seed),
        )
        for batch in loader:
            yield batch["tokens"].to(self.device, non_blocking=True)

    def _prepare(self, tokens):
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        mask = torch.ones_like(labels, dtype=torch.float32)
        if self.args.eod_mask_loss:
            mask[labels == self.eod] = 0.0
        extra = {}
        if self.args.reset_attention_mask or self.args.reset_position_ids:
            documents, positions = document_layout(inputs, self.eod)
            if self.args.reset_attention_mask:
                extra["document_ids"] = documents
            if self.args.reset_position_ids:
                extra["position_ids"] = positions
        return inputs, labels, mask, extra

    def _forward_step(self, collect_saturation_on):
        """The schedule's forward_step: one chunk on one micro-batch, in FP8 per the recipe."""
        fp8, n = self.fp8_active, self.args.num_micro_batches

        def forward_step(chunk_index, chunk, input_tensor, tokens):
            inputs, labels, mask, extra = self._prepare(tokens)
            first_micro_batch = self._forwards_seen[chunk_index] == 0
            self._forwards_seen[chunk_index] += 1
            with fp8_autocast(
                enabled=fp8,
                recipe=self.recipe,
                amax_reduction_group=self.groups.amax_reduction_group,
                collect_saturation=fp8 and collect_saturation_on and first_micro_batch,
            ):
                out = chunk(
                    inputs if input_tensor is None else input_tensor,
                    labels if chunk.post_process else None,
                    **extra,
                )
            if not chunk.post_process:
                return out
            loss = (out.float() * mask).sum() / mask.sum().clamp(min=1)
            return loss / n, loss.detach()

        return forward_step

    def _run_schedule(self, micro_batches, forward_only, collect_saturation=False):
        a = self.args
        self._forwards_seen = [0] * len(self.chunks)
        losses = forward_backward(
            None,
            self.chunks,
            data_iterator=iter(micro_batches),
            forward_step=self._forward_step(collect_saturation),
            num_micro_batches=a.num_micro_batches,
            groups=self.groups,
            seq_length=a.seq_length,
            micro_batch_size=a.micro_batch_size,
            hidden_size=self.config.hidden_size,
            dtype=self.dtype,
            sequence_parallel=self.chunks[0].sequence_parallel,
            forward_only=forward_only,
            grad_buffers=None if forward_only else self.buffer,
            overlap_p2p_comm=a.overlap_p2p_communication,
        )
        # The mean loss over micro-batches and data-parallel replicas; NaN off the last stage.
        # Reduced on the device (one host sync per step, not one per micro-batch); in fp64, where
        # a sum of fp32 losses is exact, so the figure is the same as a host-side mean.
        loss = (
            torch.stack(losses).double().mean().float().reshape(1)
            if losses
            else torch.full((1,), float("nan"), device=self.device)
        )
        if losses and self.groups.dp_size > 1:
            dist.all_reduce(loss, group=self.groups.dp_group)
            loss /= self.groups.dp_size
        return loss  # on the device: reading it waits for the GPU

    # -- one step --------------------------------------------------------------------------

    def train_step(self, micro_batches, collect_saturation=False, while_gpu_runs=None):
        """One optimizer step over this rank's micro-batches; (mean loss, applied, grad norm).
        `collect_saturation` counts saturated FP8 values in the first micro-batch of each chunk
        (log steps): it also casts the weights, so all three roles are counted.
        `while_gpu_runs`: host work (the next step's data) done once the forward and backward
        passes are queued, before the step first waits for the GPU (the gradient norm)."""
        for chunk in self.chunks:
            chunk.train()
        self.buffer.zero(lazy=True)  # main_grads are read after finalize_grads only
        self.buffer.set_sync(False)
        loss = self._run_schedule(
            micro_batches, forward_only=False, collect_saturation=collect_saturation
        )
        if while_gpu_runs is not None:
            while_gpu_runs()
        finalize_grads(self.chunks, self.groups, self.buffer)
        self.optimizer.set_lr(self.schedule(self.iteration))
        # Copied before the step, whose wait for the gradient norm then covers the copy: a read
        # of its own would wait for the update too, and the GPU would idle while the host starts
        # the next step (0.3-0.5 ms per eager launch before the first graph replay).
        loss = loss.to("cpu", non_blocking=True)
        applied, grad_norm = self.optimizer.step()  # waits for the backward pass, not the update
        return loss.item(), applied, grad_norm

    @torch.no_grad()
    def evaluate(self, dataset, consumed):
        for chunk in self.chunks:
            chunk.eval()
        losses = []
        with closing(self._micro_batches(dataset, consumed)) as micro:
            for _ in range(self.args.eval_iters):
                batches = [next(micro, None) for _ in range(self.args.num_micro_batches)]
                if any(b is None for b in batches):
                    break
                losses.append(self._run_schedule(batches, forward_only=True).item())
        return sum(losses) / max(len(losses), 1)

    # -- the bf16 sentinel ---------------------------------------------------------------------

    @torch.no_grad()
    def fp8_check(self) -> dict:
        """The sentinel's check: the held-out micro-batches' loss with FP8 on and off from the
        current weights, the last stage's figures on every rank (so all decide alike); the
        sentinel's record for metrics.jsonl."""
        a = self.args
        if self._fp8_check_batches is None:  # the same batches at every check
            with closing(self._micro_batches(self.valid_data, 0)) as micro:
                self._fp8_check_batches = [
                    [next(micro) for _ in range(a.num_micro_batches)]
                    for _ in range(a.fp8_check_iters)
                ]
        for chunk in self.chunks:
            chunk.eval()
        losses = []
        for fp8 in (True, False):
            self.fp8_active = fp8
            losses.append(
                torch.stack(
                    [
                        self._run_schedule(batches, forward_only=True)
                        for batches in self._fp8_check_batches
                    ]
                )
                .double()
                .mean()
                .reshape(1)
            )
        self.fp8_active = True
        figures = torch.cat(losses)
        if dist.get_world_size() > 1:
            dist.broadcast(figures, src=dist.get_world_size() - 1)  # a rank of the last stage
        fp8_loss, bf16_loss = figures.tolist()
        record = self.sentinel.judge(self.iteration, fp8_loss, bf16_loss)
        verdict = record["fp8_check"]
        if verdict == "fallback":
            self._print(
                f"iteration {self.iteration}: FP8's held-out loss {fp8_loss:.4f} is "
                f"{record['fp8_check_gap']:+.2%} off bf16's {bf16_loss:.4f} (tolerance "
                f"{a.fp8_check_tolerance:.2%}): training in bf16 until iteration "
                f"{record['fp8_fallback_until']}"
            )
        elif verdict == "disabled":
            self._print(
                f"iteration {self.iteration}: FP8's held-out loss {fp8_loss:.4f} is "
                f"{record['fp8_check_gap']:+.2%} off bf16's {bf16_loss:.4f} again, {a.fp8_max_fallbacks} "
                "fallbacks in a row: the run stays in bf16 from here on"
            )
        return record

    def return_to_fp8(self) -> None:
        """End a fallback: every FP8 scale starts over, fitted to the first tensors again."""
        for module in self.model.modules():
            if isinstance(module, Fp8Linear):
                module.reseed_fp8_scaling()
        self._print(f"iteration {self.iteration}: back to FP8 after the fallback, scales re-seeded")

    # -- checkpoints -------------------------------------------------------------------------

    def train_state(self):
        state = {
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "skipped_steps": self.skipped_steps,
            "skipped_in_a_row": self.skipped_in_a_row,
        }
        if self.sentinel is not None:
            state["fp8_sentinel"] = self.sentinel.state_dict()
        return state

    def save(self):
        a = self.args
        self.optimizer.finish_param_gather()
        if self.tokenizer is not None:
            checkpointing.save_tokenizer(a.save, a.tokenizer_type, self.tokenizer.files)
        path = checkpointing.save_checkpoint(
            a.save,
            self.iteration,
            self.model,
            self.optimizer,
            groups=self.groups,
            train_state=self.train_state(),
            args=arguments.args_to_dict(a),
            model_config=self.config,
        )
        # --overwrite-save: the earlier run goes once this one has a checkpoint
        if self.replaced_run:
            checkpointing.remove_checkpoints(a.save, self.replaced_run, keep=self.iteration)
            self._print(f"--overwrite-save: removed the earlier run's checkpoints from {a.save}")
            self.replaced_run = []
        self.last_checkpoint = path
        self._print(f"saved checkpoint {path}")
        if self.skipped_in_a_row:
            self._print(
                f"note: {path} was saved after {self.skipped_in_a_row} non-finite steps in a row; the "
                "checkpoints saved from finite steps are kept"
            )
        if a.keep_last_checkpoints:
            deleted = checkpointing.keep_last_checkpoints(
                a.save, a.keep_last_checkpoints, just_saved=self.iteration
            )
            if deleted:
                self._print(
                    f"--keep-last-checkpoints {a.keep_last_checkpoints}: deleted the checkpoints of "
                    f"iterations {', '.join(map(str, deleted))}"
                )

    def load(self):
        a = self.args
        if not a.load:
            return
        # Resolved once: the same checkpoint is loaded and reported even if a run writing to
        # that folder moves its latest pointer meanwhile.
        checkpoint = checkpointing.latest_checkpoint(a.load) if Path(a.load).exists() else None
        if checkpoint is None:
            if a.finetune:  # finetuning from random weights is never what was meant
                raise checkpointing.CheckpointError(f"--finetune: no checkpoint in --load {a.load}")
            self._print(f"no checkpoint in {a.load} yet: starting from scratch")
            return
        state = checkpointing.load_checkpoint(
            checkpoint,
            self.model,
            self.optimizer,
            groups=self.groups,
            load_optimizer=not (a.no_load_optim or a.finetune),
            load_rng=not (a.no_load_rng or a.finetune),
        )
        if not a.finetune:
            self.iteration = state.get("iteration", 0)
            self.consumed_samples = state.get("consumed_samples", 0)
            self.skipped_steps = state.get("skipped_steps", 0)
            self.skipped_in_a_row = state.get("skipped_in_a_row", 0)
            if self.sentinel is not None and "fp8_sentinel" in state:
                self.sentinel.load_state_dict(state["fp8_sentinel"])
        self.last_checkpoint = checkpoint
        self._print(f"loaded {checkpoint} at iteration {self.iteration}")
        if not a.finetune:
            # the checkpoint's run's flags
            saved = checkpointing.checkpoint_info(checkpoint).get("args", {})
            self._note_schedule_change(saved)
            self._note_data_order_change(saved)

    _SCHEDULE_FLAGS = (
        "train_iters",
        "lr",
        "min_lr",
        "lr_warmup_iters",
        "lr_decay_iters",
        "lr_decay_style",
        "lr_wsd_decay_iters",
        "lr_wsd_decay_style",
    )

    def _note_schedule_change(self, saved: dict):
        """Say so when the resumed run's learning-rate schedule is not that of the checkpoint's run
        (whose flags are `saved`)."""
        changed = [
            (name, saved[name], getattr(self.args, name))
            for name in self._SCHEDULE_FLAGS
            if name in saved and saved[name] != getattr(self.args, name)
        ]
        schedule = [(name, old) for name, old, _ in changed if name != "train_iters"]
        if not schedule:  # a longer or shorter run on the same schedule (--lr-decay-iters given)
            return
        before = _lr_schedule(arguments.args_from_dict(saved))(self.iteration)
        now = self.schedule(self.iteration)
        flags = ", ".join(
            f"--{name.replace('_', '-')} {old} -> {new}" for name, old, new in changed
        )
        keep = " ".join(f"--{name.replace('_', '-')} {old}" for name, old in schedule)
        self._print(
            f"note: resuming with another learning-rate schedule than the checkpoint's run ({flags}): "
            f"the next step's learning rate is {now:.3e} where that run's would be {before:.3e}; "
            f"to keep the run's schedule, give {keep}"
        )

    def _note_data_order_change(self, saved: dict):
        """Say so when the resumed run draws its batches in another order than the checkpoint's run
        (whose flags are `saved`)."""
        before = saved.get("data_seed")
        if before is not None and before != self.args.data_seed:
            self._print(
                f"note: resuming with --data-seed {self.args.data_seed} where the checkpoint's run drew its "
                f"batches with {before}: the batches from here on are not that run's; to keep its data "
                f"order, give --data-seed {before}"
            )

    # -- the loop ----------------------------------------------------------------------------

    def release_cuda_graphs(self):
        """Free the layers' CUDA graphs (after train()): graphs that captured NCCL collectives
        (tensor parallelism's) hold the communicator, and destroying the process group would wait
        on them forever."""
        if not any(chunk.cuda_graphs is not None for chunk in self.chunks):
            return
        torch.cuda.synchronize()  # no replay still running on the GPU
        self.captured_graphs = [
            {"graph sets": len(chunk.cuda_graphs.sets), "slots": len(chunk.cuda_graphs.pools)}
            for chunk in self.chunks
            if chunk.cuda_graphs is not None
        ]
        for chunk in self.chunks:
            chunk.disable_cuda_graphs()
        gc.collect()  # graph sets referenced from cycles (autograd contexts) go now, not at exit

    def _print(self, message):
        if self._logger is not None:
            self._logger.write(message)  # above the progress bar, not onto its line
        elif self.is_logger:
            print(message, flush=True)

    # -- the loop's parts ------------------------------------------------------------------

    def _metrics_logger(self, start_iteration: int):
        a = self.args
        return metrics.MetricsLogger(
            self.run_dir,
            tensorboard_dir=a.tensorboard_dir,
            rank_is_logger=self.is_logger,
            total_iterations=a.train_iters,
            start_iteration=start_iteration,
            device=self.device,
            log_throughput=a.log_throughput,
            wandb_project=a.wandb_project,
            wandb_exp_name=a.wandb_exp_name,
            wandb_dir=a.wandb_save_dir,
            wandb_config=arguments.args_to_dict(a),
        )

    def _stop_now(self, exit_signal: _ExitSignal, start_time: float) -> bool:
        """Whether the run stops after this step: a signal, --exit-duration-in-mins (each rank's
        clock decides for itself, so the ranks vote, else one could stop while another went on
        into the next step's collectives), or --exit-interval."""
        a = self.args
        timed_out = bool(a.exit_duration_in_mins) and (
            time.time() - start_time > 60 * a.exit_duration_in_mins
        )
        stop = exit_signal.any_rank(self.device, timed_out=timed_out)
        return stop or bool(a.exit_interval and self.iteration % a.exit_interval == 0)

    def _count_step(self, loss: float, applied: bool, grad_norm: float) -> None:
        """The step's loss and gradient norm into the history; a skipped (non-finite) step
        counted, and too many in a row end the run."""
        self.history.append((self.iteration, loss))
        self.grad_norms.append((self.iteration, grad_norm))
        if applied:
            self.skipped_in_a_row = 0
            return
        self.skipped_steps += 1
        self.skipped_in_a_row += 1
        self._print(f"iteration {self.iteration}: non-finite loss or gradients, step skipped")
        if self.skipped_in_a_row >= self.args.skip_nonfinite_steps_max:
            raise NonFiniteError(
                f"{self.skipped_in_a_row} steps in a row had non-finite gradients (last loss "
                f"{loss}); lower --lr, check the data, or raise --skip-nonfinite-steps-max"
            )

    def _log_record(self, losses: list, grad_norm: float, throughput) -> dict:
        """What a log step records: the mean loss since the last one, the step's figures,
        throughput, memory and FP8 health."""
        world = dist.group.WORLD if dist.get_world_size() > 1 else None
        return {
            "consumed_samples": self.consumed_samples,
            "loss": sum(losses) / len(losses),
            "lr": self.schedule(self.iteration - 1),
            "grad_norm": grad_norm,
            "skipped_steps": self.skipped_steps,
            **throughput.read(),
            **metrics.memory_stats(self.device),
            **fp8_health(self.model, group=world, per_layer=self.args.log_fp8_layers),
        }

    def _evaluate_now(self, logger) -> float:
        """--eval-interval's evaluation, on the next --eval-iters batches of the valid split."""
        a = self.args
        consumed = (self.iteration // a.eval_interval - 1) * a.eval_iters * a.global_batch_size
        valid = self.evaluate(self.valid_data, consumed)
        logger.log(self.iteration, {"valid_loss": valid, "valid_ppl": math.exp(min(valid, 50))})
        return valid

    def _save_if_due(self, stop: bool, postponed: bool) -> tuple[bool, bool]:
        """Save at --save-interval, before stopping and after the last step; (saved, whether a
        save is postponed). One that falls due in a streak of non-finite steps waits for a finite
        step, since the weights may have blown up (a stop or the last step saves regardless)."""
        a = self.args
        due = (
            bool(a.save and a.save_interval and self.iteration % a.save_interval == 0) or postponed
        )
        if due and self.skipped_in_a_row:
            if not postponed:
                self._print(
                    f"iteration {self.iteration}: checkpoint postponed until a step is finite again"
                )
            due, postponed = False, True
        if a.save and (due or stop or self.iteration == a.train_iters):
            self.save()
            return True, False
        return False, postponed

    def _print_summary(self, start_iteration: int, wall_time_s: float, valid_loss, logger) -> None:
        a = self.args
        for line in metrics.run_summary(
            start_iteration=start_iteration,
            end_iteration=self.iteration,
            wall_time_s=wall_time_s,
            tokens=(self.iteration - start_iteration) * a.global_batch_size * a.seq_length,
            first_loss=self.history[0][1] if self.history else None,
            last_loss=self.history[-1][1] if self.history else None,
            valid_loss=valid_loss,
            checkpoint=self.last_checkpoint,
            metrics_path=logger.metrics_path,
        ):
            print(line, flush=True)

    def train(self):
        a = self.args
        self.load()
        if self.iteration >= a.train_iters:
            self._print(
                f"nothing to do: the checkpoint is at iteration {self.iteration} and --train-iters is "
                f"{a.train_iters}; raise --train-iters to train further"
            )
            return self.iteration
        start_iteration = self.iteration
        logger = self._logger = self._metrics_logger(start_iteration)
        throughput = metrics.Throughput(
            self.flops_per_token, world_size=dist.get_world_size(), device=self.device
        )
        exit_signal = _ExitSignal()
        profiler = StepProfiler(a, dist.get_rank(), self.run_dir, self.device)
        start_time = time.time()
        micro = self._micro_batches(self.train_data, self.consumed_samples)
        losses, valid_loss = [], None
        batches, upcoming = None, []
        save_postponed = False  # a save fell due in a streak of non-finite steps

        def prefetch():  # the next step's micro-batches, read while this step's GPU work runs
            if self.iteration + 1 < a.train_iters:
                upcoming.extend(next(micro) for _ in range(a.num_micro_batches))

        try:
            while self.iteration < a.train_iters:
                batches = batches or [next(micro) for _ in range(a.num_micro_batches)]
                if (
                    a.enable_cuda_graph
                    and self.iteration - start_iteration == a.cuda_graph_warmup_steps
                ):
                    for chunk in self.chunks:  # the next forward captures, the later ones replay
                        chunk.enable_cuda_graphs(self.buffer.mark_ready)
                log_step = (
                    self.iteration + 1
                ) % a.log_interval == 0 or self.iteration + 1 == a.train_iters
                if self.sentinel is not None:
                    if self.sentinel.returns_at(self.iteration):
                        self.return_to_fp8()
                        logger.log(self.iteration, {"fp8_check": "return"})
                    self.fp8_active = self.sentinel.fp8_on(self.iteration)
                profiler.before_step(self.iteration)
                loss, applied, grad_norm = self.train_step(
                    batches,
                    collect_saturation=log_step and self.fp8_active,
                    while_gpu_runs=prefetch,
                )
                batches, upcoming = upcoming, []
                self.iteration += 1
                profiler.after_step(self.iteration)
                logger.progress(self.iteration)
                self.consumed_samples += a.global_batch_size
                throughput.add(a.global_batch_size * a.seq_length)
                losses.append(loss)
                self._count_step(loss, applied, grad_norm)
                if log_step:
                    logger.log(self.iteration, self._log_record(losses, grad_norm, throughput))
                    losses = []
                if (
                    a.eval_interval
                    and self.valid_data is not None
                    and self.iteration % a.eval_interval == 0
                ):
                    valid_loss = self._evaluate_now(logger)
                    throughput.restart()
                if self.sentinel is not None and self.sentinel.due(self.iteration):
                    logger.log(self.iteration, self.fp8_check())
                stop = self._stop_now(exit_signal, start_time)
                saved, save_postponed = self._save_if_due(stop, save_postponed)
                if saved:
                    throughput.restart()
                if stop:
                    self._print(
                        f"stopping at iteration {self.iteration}"
                        + (f" on {exit_signal.received}" if exit_signal.received else "")
                    )
                    break
            self.optimizer.finish_param_gather()
        finally:
            micro.close()  # its loader's workers end now, even when an error unwinds the run
            exit_signal.restore()
            profiler.stop(self.iteration)
            logger.close()
            self._logger = None
        if self.is_logger:
            self._print_summary(start_iteration, time.time() - start_time, valid_loss, logger)
        return self.iteration


def prefer_gemms_without_workspace() -> None:
    """cuBLASLt without a workspace (CUBLASLT_WORKSPACE_SIZE=0) unless the user chose a size.

    With one, cuBLASLt runs nearly every FP8 GEMM of these shapes as a kernel whose workspace it
    zeroes first: a memset before each GEMM, ~3 us more of the GPU between kernels inside a
    CUDA graph. Without one it picks the same tiles (their variants that need no workspace) as fast
    (benchmarks/RESULTS.md, "What each switch buys"). torch reads the variable at its first
    cuBLASLt GEMM in the process: before that, or it has no effect."""
    os.environ.setdefault("CUBLASLT_WORKSPACE_SIZE", "0")


def pretrain(argv=None):
    """Parse, set up and train; returns the Trainer. Joins the running process group if there
    is one (tests), else initialises one from torchrun's environment (or a one-process group)."""
    prefer_gemms_without_workspace()
    own_group = not dist.is_initialized()
    torchrun = "WORLD_SIZE" in os.environ
    with warnings.catch_warnings():
        # every rank reads the same flags: said once, by rank 0
        if int(os.environ.get("RANK", "0")) != 0:
            warnings.simplefilter("ignore")
        args = arguments.parse_args(argv)
        arguments.validate_args(
            args,
            int(os.environ["WORLD_SIZE"])
            if own_group and torchrun
            else dist.get_world_size()
            if not own_group
            else 1,
        )
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    if own_group and not torchrun:
        _init_single_process(timeout)
    groups = ParallelGroups.from_torchrun(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size, timeout=timeout
    )
    failed = True
    try:
        # Before anything is written: one run at a time in a --save folder.
        with checkpointing.SaveFolderLock(args.save):
            try:
                torch.manual_seed(args.seed)
                trainer = Trainer(args, groups)
                trainer.train()
                trainer.release_cuda_graphs()
            finally:  # the last save's checksums, recorded while the folder is still ours
                checkpointing.wait_for_checksums()
        failed = False
        return trainer
    finally:
        symmetric_memory.stop_using_copy_engines()  # after the graphs that addressed them
        if own_group:
            _end_process_group(failed)


def _tp_comm_transport(args, tp_group) -> str:
    """How --tp-comm-overlap moves its blocks (--tp-comm-overlap-transport): on copy engines under
    CUDA graphs where the tensor-parallel group can (graphed, they cut the step's exposed
    communication; eager, their extra launches cost more than they hide), else through NCCL."""
    reason = symmetric_memory.unavailable_reason(tp_group)
    if args.tp_comm_overlap_transport == "copy-engine" and reason is not None:
        raise arguments.ArgumentsError(
            f"--tp-comm-overlap-transport copy-engine: {reason}; give nccl or auto"
        )
    if args.tp_comm_overlap_transport == "copy-engine" or (
        args.tp_comm_overlap_transport == "auto" and args.enable_cuda_graph and reason is None
    ):
        symmetric_memory.use_copy_engines(
            tp_group, args.tp_comm_sm_carveout, timeout_s=args.distributed_timeout_minutes * 60
        )
        return "copy-engine"
    return "nccl"


def _end_process_group(failed: bool) -> None:
    """Leave the process group, unless this rank failed on GPUs: its peers may be blocked in
    collectives it will never join, and tearing NCCL communicators down (destroy or abort) can
    then wait on them forever. main() exits such a process at once, and the launcher (torchrun)
    stops the other ranks when one is gone."""
    if failed and dist.get_backend() == "nccl":
        return
    dist.destroy_process_group()


# Errors every rank raises alike (flags, checkpoint folders and saves, which share their
# failures, non-finite steps, which every rank sees, a failed index build on another rank):
# said once, by rank 0. Others (bad input files, a full disk) by the rank that met them.
_SAID_BY_RANK_0 = (
    arguments.ArgumentsError,
    checkpointing.CheckpointError,
    NonFiniteError,
    DatasetBuildError,
)


def main():
    show_warnings_as_messages("megafp8-train")
    try:
        pretrain()
    except (*_SAID_BY_RANK_0, ValueError, OSError) as error:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        if not isinstance(error, _SAID_BY_RANK_0):
            print(
                f"megafp8-train: error{f' on rank {rank}' if world > 1 else ''}: {error}",
                file=sys.stderr,
            )
        else:
            if rank == 0:
                print(f"megafp8-train: error: {error}", file=sys.stderr)
            if world > 1:
                _meet_once_rank_0_said_it(rank)
        _exit_after_error(2)
    except Exception as error:
        traceback.print_exc()
        if "CUDA error" in str(error) and symmetric_memory.used_in_this_process():
            print(_AFTER_A_COPY_ENGINE_BARRIER, file=sys.stderr)
        _exit_after_error(1)


# The launcher stops every rank as soon as one exits, so a rank other than 0 that met an error
# rank 0 says (every rank meets it alike) waits until rank 0 has said it: else a rank 0 still
# importing or parsing is stopped unheard. They meet at torchrun's own store, which lives as long
# as the launcher and needs no process group (flags are refused before one exists). Bounded: a rank
# 0 that never gets there (a different failure) costs its peers this long at most.
_SAID_KEY = "megafp8/error_said_by_rank_0"
_WAIT_FOR_RANK_0_S = 20


def _meet_once_rank_0_said_it(rank: int) -> None:
    """Rank 0 marks the error said in torchrun's store (TORCHELASTIC_USE_AGENT_STORE); the other
    ranks wait for the mark. Nothing under other launchers."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    # one key per attempt: a restarted group shares the store with the attempts before it
    key = f"{_SAID_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=_WAIT_FOR_RANK_0_S),
        )
        if rank == 0:
            store.set(key, "1")
        else:
            store.wait([key])
    except (RuntimeError, OSError, KeyError, ValueError):
        pass  # bounded: rank 0 did not get there in time, or the store is gone; exit anyway


# A barrier kernel that gives up on its peer traps, and the next CUDA call of its process fails
# with whatever error it meets (often a cuBLAS one), far from the cause.
_AFTER_A_COPY_ENGINE_BARRIER = (
    "megafp8-train: this run moved its tensor-parallel blocks on the GPUs' copy engines. Where "
    "a line '[FATAL] CUDASymmetricMemory::barrier: rank R failed to receive signal from rank P' "
    "comes before this error, rank P did not reach that barrier within "
    "--distributed-timeout-minutes and the CUDA error follows from it (docs/parallel.md, "
    "'Checking a multi-GPU machine'). Restart the run, or move the blocks through NCCL: "
    "--tp-comm-overlap-transport nccl"
)


def _exit_after_error(code: int) -> None:
    """Exit after an error; with NCCL communicators left in place (see _end_process_group) at once,
    without the interpreter's teardown, which would wait on them."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
