"""Checkpoints: exact resume, loading under another tp / dp layout, shape errors, and a save
killed half way leaving the previous checkpoint loadable."""
import json

import pytest
import torch

from megafp8.fp8 import DelayedScaling, fp8_autocast
from megafp8.models import preset
from megafp8.models.transformer import TransformerLM
from megafp8.parallel import ParallelGroups
from megafp8.parallel.data_parallel import GradientBuffer
from megafp8.training import checkpointing
from megafp8.training.optimizer import MixedPrecisionAdamW

from ..multiprocess import run_on_ranks

SEQ = 32


def batch(step, vocab, size=2):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, (size, SEQ + 1), generator=g)


class Run:
    """A tiny FP8 model with its optimizer on the current process group's layout."""

    def __init__(self, tp=1, name="gpt-tiny", distributed=False, **overrides):
        self.groups = ParallelGroups(tp)
        self.config = preset(name, **overrides)
        self.model = TransformerLM(self.config, tp_group=self.groups.tp_group, seed=0)
        self.buffer = GradientBuffer(self.model.parameters(), self.groups.dp_group, bucket_size=5_000,
                                     shard=distributed)
        self.optimizer = MixedPrecisionAdamW(
            self.model.named_parameters(), self.buffer, lr=1e-2, weight_decay=0.1,
            model_parallel_group=self.groups.model_parallel_group, tp_group=self.groups.tp_group,
            dp_group=self.groups.dp_group, distributed=distributed)

    def loss(self, tokens):
        with fp8_autocast(recipe=DelayedScaling(amax_history_len=4),
                          amax_reduction_group=self.groups.amax_reduction_group):
            return self.model(tokens[:, :-1], tokens[:, 1:]).float().mean()

    def step(self, step):
        self.buffer.zero()
        tokens = batch(step, self.config.vocab_size)
        rank, size = self.groups.dp_rank, self.groups.dp_size
        loss = self.loss(tokens[rank * 2 // size:(rank + 1) * 2 // size])
        loss.backward()
        self.buffer.finish()
        self.optimizer.step()
        return loss.item()

    def save(self, folder, iteration):
        return checkpointing.save_checkpoint(folder, iteration, self.model, self.optimizer, groups=self.groups,
                                             train_state={"iteration": iteration}, args={"model": "gpt-tiny"})

    def load(self, folder, **kwargs):
        return checkpointing.load_checkpoint(folder, self.model, self.optimizer, groups=self.groups, **kwargs)


def resume_body(rank, world_size, folder):
    # With dropout: the resumed steps equal the straight ones only if the RNG state is restored.
    dropout = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
    straight = Run(**dropout)
    losses = [straight.step(s) for s in range(2)]
    straight.save(folder, 2)
    losses += [straight.step(s) for s in range(2, 4)]
    resumed = Run(**dropout)
    state = resumed.load(folder)
    return losses, [resumed.step(s) for s in range(2, 4)], state


def test_resume_is_bitwise_exact(tmp_path):
    losses, resumed, state = run_on_ranks(resume_body, 1, str(tmp_path))[0]
    assert resumed == losses[2:]  # exact, FP8 scaling state and Adam moments included
    assert state == {"iteration": 2}
    assert (tmp_path / checkpointing.LATEST).read_text() == "2"
    assert json.loads((tmp_path / "iter_0000002" / "megafp8.json").read_text())["args"] == {"model": "gpt-tiny"}


def save_tp2_body(rank, world_size, folder, name, distributed):
    tp = 2 if not distributed else 1
    run = Run(tp=tp, name=name, distributed=distributed)
    run.step(0)
    run.save(folder, 1)
    return run.loss(batch(9, run.config.vocab_size)).item(), run.optimizer.state_for_checkpoint()


def load_body(rank, world_size, folder, name, tp):
    run = Run(tp=tp, name=name)
    run.load(folder)
    return run.loss(batch(9, run.config.vocab_size)).item(), run.optimizer.state_for_checkpoint()


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_tp2_checkpoint_loads_into_one_process_and_back(tmp_path, name):
    saved_loss, _ = run_on_ranks(save_tp2_body, 2, str(tmp_path / "a"), name, False)[0]
    one_loss, one_states = run_on_ranks(load_body, 1, str(tmp_path / "a"), name, 1)[0]
    assert one_loss == pytest.approx(saved_loss, rel=1e-5)
    # ...and from one process into tp = 2 again.
    run_on_ranks(lambda_save_one, 1, str(tmp_path / "b"), name, str(tmp_path / "a"))
    for loss, _ in run_on_ranks(load_body, 2, str(tmp_path / "b"), name, 2):
        assert loss == pytest.approx(saved_loss, rel=1e-5)


def lambda_save_one(rank, world_size, folder, name, source):
    run = Run(name=name)
    run.load(source)
    run.save(folder, 1)


def test_distributed_optimizer_checkpoint_loads_without_it(tmp_path):
    saved_loss, saved_states = run_on_ranks(save_tp2_body, 2, str(tmp_path), "gpt-tiny", True)[0]
    loss, states = run_on_ranks(load_body, 1, str(tmp_path), "gpt-tiny", 1)[0]
    assert loss == pytest.approx(saved_loss, rel=1e-6)
    vocab = preset("gpt-tiny").vocab_size
    for name, entry in saved_states.items():
        rows = vocab if name == "embedding.weight" else None  # padding rows are not stored
        for key, tensor in entry.items():
            torch.testing.assert_close(states[name][key][:rows], tensor[:rows], rtol=0, atol=0)


def mismatch_body(rank, world_size, folder, name, overrides):
    Run().save(folder, 1)
    Run(name=name, **overrides).load(folder)


@pytest.mark.parametrize("name,overrides,match", [
    ("gpt-tiny", {"ffn_hidden_size": 128}, "shapes differ"),
    ("gpt-tiny", {"num_layers": 3}, "has no 'model/layers.2.*saved from another model"),
    ("llama-tiny", {}, "shapes differ"),
])
def test_a_different_model_is_a_clear_error(tmp_path, name, overrides, match):
    with pytest.raises(AssertionError, match=match):
        run_on_ranks(mismatch_body, 1, str(tmp_path), name, overrides)


def killed_save_body(rank, world_size, folder):
    run = Run()
    run.step(0)
    run.save(folder, 1)
    before = run.loss(batch(9, run.config.vocab_size)).item()
    run.step(1)
    real_save = checkpointing.dcp.save

    def dies_half_way(state, checkpoint_id):
        real_save({k: v for i, (k, v) in enumerate(state.items()) if i % 2}, checkpoint_id=checkpoint_id)
        raise KeyboardInterrupt("killed during the save")

    checkpointing.dcp.save = dies_half_way
    try:
        run.save(folder, 2)
    except KeyboardInterrupt:
        pass
    finally:
        checkpointing.dcp.save = real_save
    fresh = Run()
    fresh.load(folder)
    return before, fresh.loss(batch(9, run.config.vocab_size)).item()


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    before, after = run_on_ranks(killed_save_body, 1, str(tmp_path))[0]
    assert after == before
    assert (tmp_path / checkpointing.LATEST).read_text() == "1"
    assert (tmp_path / "iter_0000002.tmp").exists() and not (tmp_path / "iter_0000002").exists()


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(checkpointing.CheckpointError, match="no checkpoint"):
        checkpointing.load_checkpoint(tmp_path, None, None, groups=None)
