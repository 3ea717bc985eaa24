"""Checkpoints: exact resume, loading under another tp / dp layout, shape errors, and a save
killed half way leaving the previous checkpoint loadable."""

import json

import pytest
import torch
from megafp8.models import preset
from megafp8.models.transformer import TransformerLM
from megafp8.parallel import ParallelGroups
from megafp8.parallel.data_parallel import GradientBuffer

from megafp8.fp8 import DelayedScaling, fp8_autocast
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
        self.buffer = GradientBuffer(
            self.model.parameters(), self.groups.dp_group, bucket_size=5_000, shard=distributed
        )
        self.optimizer = MixedPrecisionAdamW(
            self.model.named_parameters(),
            self.buffer,
            lr=1e-2,
            weight_decay=0.1,
            model_parallel_group=self.groups.model_parallel_group,
            tp_group=self.groups.tp_group,
            dp_group=self.groups.dp_group,
            distributed=distributed,
        )

    def loss(self, tokens):
        with fp8_autocast(
            recipe=DelayedScaling(amax_history_len=4),
            amax_reduction_group=self.groups.amax_reduction_group,
        ):
            return self.model(tokens[:, :-1], tokens[:, 1:]).float().mean()

    def step(self, step):
        self.buffer.zero()
        tokens = batch(step, self.config.vocab_size)
        rank, size = self.groups.dp_rank, self.groups.dp_size
        loss = self.loss(tokens[rank * 2 // size : (rank + 1) * 2 // size])
        loss.backward()
        self.buffer.finish()
        self.optimizer.step()
        return loss.item()

    def save(self, folder, iteration):
        return checkpointing.save_checkpoint(
            folder,
            iteration,
            self.model,
            self.optimizer,
            groups=self.groups,
            train_state={"iteration": iteration},
            args={"model": "gpt-tiny"},
            model_config=self.config,
        )

    def load(self, folder, **kwargs):
        return checkpointing.load_checkpoint(
            folder, self.model, self.optimizer, groups=self.groups, **kwargs
        )


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
    assert json.loads((tmp_path / "iter_0000002" / "megafp8.json").read_text())["args"] == {
        "model": "gpt-tiny"
    }


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


@pytest.mark.parametrize(
    "name,overrides,match",
    [
        ("gpt-tiny", {"ffn_hidden_size": 128}, "shapes differ"),
        ("gpt-tiny", {"num_layers": 3}, "has no 'model/layers.2.*saved from another model"),
        ("llama-tiny", {}, "shapes differ"),
    ],
)
def test_a_different_model_is_a_clear_error(tmp_path, name, overrides, match):
    with pytest.raises(AssertionError, match=match):
        run_on_ranks(mismatch_body, 1, str(tmp_path), name, overrides)


def probe(run):
    return run.loss(batch(9, run.config.vocab_size)).item()


def saved_then_stepped(folder):
    """A run saved at iteration 1 and then trained on: (the run, its probe loss at the checkpoint)."""
    run = Run()
    run.step(0)
    run.save(folder, 1)
    before = probe(run)
    run.step(1)
    return run, before


def reloaded(folder):
    """The probe loss of a fresh run loaded from `folder`."""
    fresh = Run()
    fresh.load(folder)
    return probe(fresh)


def save_killed(run, folder, iteration, owner, name, killer):
    """Save with `owner.name` replaced by `killer(real)`, which raises KeyboardInterrupt."""
    real = getattr(owner, name)
    setattr(owner, name, killer(real))
    try:
        run.save(folder, iteration)
    except KeyboardInterrupt:
        pass
    finally:
        setattr(owner, name, real)


def killed_save_body(rank, world_size, folder):
    def dies_half_way(real_save):
        def save(state, checkpoint_id):
            real_save(
                {k: v for i, (k, v) in enumerate(state.items()) if i % 2},
                checkpoint_id=checkpoint_id,
            )
            raise KeyboardInterrupt("killed during the save")

        return save

    run, before = saved_then_stepped(folder)
    save_killed(run, folder, 2, checkpointing.dcp, "save", dies_half_way)
    return before, reloaded(folder)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    before, after = run_on_ranks(killed_save_body, 1, str(tmp_path))[0]
    assert after == before
    assert (tmp_path / checkpointing.LATEST).read_text() == "1"
    assert (tmp_path / "iter_0000002.tmp").exists() and not (tmp_path / "iter_0000002").exists()


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(checkpointing.CheckpointError, match="no checkpoint"):
        checkpointing.load_checkpoint(tmp_path, None, None, groups=None)


# -- never without a loadable checkpoint, failures reach every rank, nothing on disk unsynced --------


def replaced_save_killed_body(rank, world_size, folder):
    def dies_between_renames(real_replace):  # the old iter_1 is set aside, the new one not yet in
        def replace(src, dst):
            if str(src).endswith("iter_0000001.tmp"):
                raise KeyboardInterrupt("killed during the save")
            real_replace(src, dst)

        return replace

    run, before = saved_then_stepped(folder)
    # The same iteration again, as when a run resumed from an earlier checkpoint reaches it.
    save_killed(run, folder, 1, checkpointing.os, "replace", dies_between_renames)
    restored = reloaded(folder)
    run.save(folder, 1)  # now it goes through
    return before, restored, probe(run), reloaded(folder)


def test_replacing_a_checkpoint_never_leaves_none(tmp_path):
    before, restored, after, reloaded = run_on_ranks(replaced_save_killed_body, 1, str(tmp_path))[0]
    assert restored == before  # the loader fell back to the set-aside copy
    assert reloaded == after != before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000001"
    ]


def durable_save_body(rank, world_size, folder):
    """The order of fsyncs (by path) and renames of one save."""
    import os

    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        real_replace(src, dst)

    checkpointing.os.fsync, checkpointing.os.replace = fsync, replace
    try:
        Run().save(folder, 1)
    finally:
        checkpointing.os.fsync, checkpointing.os.replace = real_fsync, real_replace
    return events


@pytest.mark.skipif(
    not __import__("os").path.exists("/proc/self/fd"), reason="maps descriptors to paths via /proc"
)
def test_the_latest_pointer_and_run_record_are_on_disk_before_they_count(tmp_path):
    events = run_on_ranks(durable_save_body, 1, str(tmp_path))[0]
    for name in ("iter_0000001.tmp/megafp8.json.tmp", "latest_checkpointed_iteration.txt.tmp"):
        path = str(tmp_path / name)
        renamed = events.index(("replace", path))
        assert ("fsync", path) in events[:renamed], (name, events)
        # the rename too
        assert ("fsync", str((tmp_path / name).parent)) in events[renamed:], (
            name,
            events,
        )


def failing_save_body(rank, world_size, folder, where):
    import errno
    import time

    run, before = saved_then_stepped(folder)
    disk_full = OSError(errno.ENOSPC, "No space left on device")
    if where == "writing rank, finishing" and rank == 0:
        checkpointing._write_durably = lambda *args: (_ for _ in ()).throw(disk_full)
    if where == "other rank, writing its shard" and rank == 1:

        def fsync(fd):
            raise disk_full

        checkpointing.os.fsync = fsync
    start = time.monotonic()
    try:
        run.save(folder, 2)
        outcome = None
    except checkpointing.CheckpointError as error:
        outcome = str(error)
    elapsed = time.monotonic() - start
    return outcome, elapsed, before, reloaded(folder)


@pytest.mark.parametrize("where", ["writing rank, finishing", "other rank, writing its shard"])
def test_a_failed_save_on_one_rank_stops_every_rank(tmp_path, where):
    for outcome, elapsed, before, after in run_on_ranks(failing_save_body, 2, str(tmp_path), where):
        assert outcome is not None and "No space left on device" in outcome
        assert elapsed < 60  # at once, not at a collective's timeout
        assert after == before  # iteration 1 is still the latest, and loads
    assert (tmp_path / checkpointing.LATEST).read_text() == "1"


# -- loading runs no code from the checkpoint -------------------------------------------------------


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling this creates the marker file


def test_loading_runs_no_code_from_the_checkpoint(tmp_path):
    import pickle

    marker = tmp_path / "ran"
    folder = checkpointing.write_checkpoint(
        tmp_path / "run",
        1,
        {"model/w": torch.ones(3), "extra": _RunsCode(str(marker))},
        train_state={},
        args={},
        model_config=preset("gpt-tiny"),
    )
    assert not marker.exists()
    with pytest.raises(
        checkpointing.CheckpointError, match="pickled object, not plain data: refused"
    ):
        checkpointing.read_state({"extra": ""}, folder)  # a pickled object among the items
    good = {"model/w": torch.zeros(3), "train": ""}
    checkpointing.read_state(good, folder)  # tensors and strings load
    assert torch.equal(good["model/w"], torch.ones(3)) and good["train"] == "{}"
    metadata = folder / ".metadata"
    tampered = pickle.loads(metadata.read_bytes())
    tampered.storage_meta = _RunsCode(str(marker))
    metadata.write_bytes(pickle.dumps(tampered))
    for load in (
        lambda: checkpointing.read_metadata(folder),
        lambda: checkpointing.load_checkpoint(
            folder, TransformerLM(preset("gpt-tiny")), None, groups=None
        ),
    ):
        with pytest.raises(
            checkpointing.CheckpointError, match=r"asks to load _?io.open, .*refused"
        ):
            load()
    assert not marker.exists()


def test_fp8_state_missing_from_a_checkpoint_is_reported(tmp_path):
    model = TransformerLM(preset("gpt-tiny"), seed=0)
    complete = checkpointing.save_checkpoint(
        tmp_path / "full",
        1,
        model,
        None,
        groups=None,
        train_state={},
        args={},
        model_config=model.config,
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to report
        checkpointing.load_checkpoint(
            complete, TransformerLM(preset("gpt-tiny")), None, groups=None
        )
    # As checkpoints store them: the vocabulary without its padding rows.
    weights_only = {
        f"model/{name}": p.detach()[: getattr(p, "unpadded_rows", None)]
        for name, p in model.named_parameters()
    }
    partial = checkpointing.write_checkpoint(
        tmp_path / "weights", 1, weights_only, train_state={}, args={}, model_config=model.config
    )
    with pytest.warns(
        UserWarning, match=r"no FP8 scaling state for \d+ entries \(e\.g\. layers\.0\."
    ):
        checkpointing.load_checkpoint(partial, TransformerLM(preset("gpt-tiny")), None, groups=None)


# -- the model's config is part of the checkpoint ---------------------------------------------------


def test_the_model_config_is_recorded_and_read_back(tmp_path):
    from megafp8.models.config import RopeScaling

    config = preset("llama-tiny", rope_scaling=RopeScaling(original_max_position_embeddings=64))
    weights = {"model/w": torch.ones(3)}
    path = checkpointing.write_checkpoint(
        tmp_path / "run", 4, weights, train_state={}, args={}, model_config=config
    )
    assert json.loads((path / "megafp8.json").read_text())["model"] == config.to_dict()
    assert checkpointing.saved_model_config(path) == config
    assert checkpointing.latest_model_config(tmp_path / "run") == (path, config)  # a --save folder
    assert checkpointing.latest_model_config(path) == (path, config)  # one iter_N folder
    # Nothing to read: no --load, an empty folder, a missing one.
    (tmp_path / "empty").mkdir()
    for load in (None, tmp_path / "empty", tmp_path / "missing"):
        assert checkpointing.latest_model_config(load) is None


def test_a_record_of_another_format_is_refused_with_what_to_do(tmp_path):
    path = checkpointing.write_checkpoint(
        tmp_path,
        1,
        {"model/w": torch.ones(3)},
        train_state={},
        args={},
        model_config=preset("gpt-tiny"),
    )
    record = path / "megafp8.json"
    info = json.loads(record.read_text())
    assert info["format"] == checkpointing.FORMAT == 1

    def refused(edit, match):
        record.write_text(json.dumps(edit(dict(info))))
        with pytest.raises(checkpointing.CheckpointError, match=match):
            checkpointing.latest_model_config(tmp_path)

    refused(
        lambda i: {k: v for k, v in i.items() if k != "format"},
        r"names no checkpoint format: .* reads format 1 only; convert it to Hugging Face",
    )
    refused(
        lambda i: {**i, "format": 2},
        r"is in checkpoint format 2; this megafp8 reads format 1 only: upgrade",
    )
    refused(
        lambda i: {k: v for k, v in i.items() if k != "model"},
        r"lacks 'model', which checkpoint format 1 records",
    )
    record.unlink()
    with pytest.raises(
        checkpointing.CheckpointError, match="has no megafp8.json, which records the model"
    ):
        checkpointing.saved_model_config(path)


@pytest.mark.parametrize(
    "model,match",
    [
        ({"num_layers": 2}, "lacks hidden_size"),
        ({**preset("gpt-tiny").to_dict(), "num_experts": 8}, "unknown field num_experts"),
        ({**preset("gpt-tiny").to_dict(), "hidden_size": 65}, "hidden_size=65 must be divisible"),
        ("gpt-tiny", "mapping"),
    ],
)
def test_an_invalid_recorded_model_names_the_file_and_the_problem(tmp_path, model, match):
    path = checkpointing.write_checkpoint(
        tmp_path,
        1,
        {"model/w": torch.ones(3)},
        train_state={},
        args={},
        model_config=preset("gpt-tiny"),
    )
    info = json.loads((path / "megafp8.json").read_text())
    (path / "megafp8.json").write_text(json.dumps({**info, "model": model}))
    with pytest.raises(
        checkpointing.CheckpointError,
        match=rf"{path}/megafp8.json: its \"model\" is not a valid "
        rf"model config: .*{match}",
    ):
        checkpointing.latest_model_config(tmp_path)
    (path / "megafp8.json").write_text("{not json")
    with pytest.raises(
        checkpointing.CheckpointError, match=rf"{path}/megafp8.json is not valid JSON"
    ):
        checkpointing.saved_model_config(path)


# -- nothing lost: damaged files, a lost pointer, rotation, one writer -------------------------------


def small_checkpoint(folder, iteration=1, *, size=1000):
    """A one-process checkpoint of fresh random tensors; (its folder, its one shard)."""
    state = {"model/w": torch.randn(size), "model/v": torch.randn(size // 2)}
    path = checkpointing.write_checkpoint(
        folder, iteration, state, train_state={}, args={}, model_config=preset("gpt-tiny")
    )
    return path, next(path.glob("__0_*.distcp"))


@pytest.mark.parametrize(
    "damage,match",
    [
        (
            lambda data: data[:100] + bytes(b ^ 0xFF for b in data[100:164]) + data[164:],
            r"__0_0\.distcp is damaged: bytes 0 to [\d,]+ do not match",
        ),
        (
            lambda data: data[: len(data) // 2],
            r"__0_0\.distcp is [\d,]+ bytes where the save wrote [\d,]+: it was truncated",
        ),
    ],
)
def test_a_damaged_shard_is_named_before_anything_loads(tmp_path, damage, match):
    path, shard = small_checkpoint(tmp_path)
    checkpointing.read_state({"model/w": torch.empty(1000)}, path)  # intact: loads
    shard.write_bytes(damage(shard.read_bytes()))
    with pytest.raises(checkpointing.CheckpointError, match=match):
        checkpointing.read_state({"model/w": torch.empty(1000)}, path)


def test_each_rank_records_the_checksums_of_the_files_it_wrote(tmp_path):
    run_on_ranks(two_rank_save_body, 2, str(tmp_path))
    checkpoint = tmp_path / "iter_0000001"
    records = {
        path.name: json.loads(path.read_text())
        for path in (checkpoint / checkpointing.CHECKSUMS).iterdir()
    }
    assert sorted(records) == ["rank_00000.json", "rank_00001.json"]
    assert sorted(records["rank_00000.json"]["files"]) == [".metadata", "__0_0.distcp"]
    assert sorted(records["rank_00001.json"]["files"]) == ["__1_0.distcp"]
    for record in records.values():
        for name, entry in record["files"].items():
            assert entry["bytes"] == (checkpoint / name).stat().st_size
            assert len(entry["crc32"]) == -(-entry["bytes"] // record["piece_bytes"])


def two_rank_save_body(rank, world_size, folder):
    Run(distributed=True).save(folder, 1)
    checkpointing.wait_for_checksums()


def test_metadata_that_points_outside_its_folder_is_refused(tmp_path):
    import pickle

    path, _ = small_checkpoint(tmp_path)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.bin"
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(
        checkpointing.CheckpointError, match=r"points at '\.\./\.\./secret\.bin', outside"
    ):
        checkpointing.read_metadata(path)


def test_a_pointer_that_is_not_text_names_its_file(tmp_path):
    small_checkpoint(tmp_path)
    (tmp_path / checkpointing.LATEST).write_bytes(b"\xff\xfe7")
    with pytest.raises(
        checkpointing.CheckpointError,
        match=rf"{tmp_path}/{checkpointing.LATEST} should hold an "
        "iteration number, not binary data",
    ):
        checkpointing.latest_checkpoint(tmp_path)


def test_a_lost_pointer_resumes_from_the_checkpoint_saved_last(tmp_path):
    for iteration in (9, 4):  # saved in this order: a run rolled back to an earlier checkpoint
        small_checkpoint(tmp_path, iteration)
    (tmp_path / checkpointing.LATEST).unlink()
    with pytest.warns(
        UserWarning,
        match=r"has no latest_checkpointed_iteration.txt but holds complete checkpoints "
        r"\(iterations 4, 9\): resuming from iteration 4, the one saved last",
    ):
        assert checkpointing.latest_checkpoint(tmp_path) == checkpointing.iteration_dir(tmp_path, 4)


def saved(folder, iteration, when, streak=0):
    """A stand-in checkpoint: complete, saved at `when` after `streak` non-finite steps."""
    path = checkpointing.iteration_dir(folder, iteration)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / "megafp8.json").write_text(
        json.dumps(
            {
                "format": checkpointing.FORMAT,
                "iteration": iteration,
                "saved_at": when,
                "args": {},
                "train": {"skipped_in_a_row": streak},
                "model": {},
            }
        )
    )
    (folder / checkpointing.LATEST).write_text(str(iteration))


def test_rotation_keeps_what_was_saved_last_not_the_highest_iterations(tmp_path):
    # resumed from 5 after reaching 10, saved 7
    for iteration, when in (
        (5, 1.0),
        (10, 2.0),
        (7, 3.0),
    ):
        saved(tmp_path, iteration, when)
    assert checkpointing.keep_last_checkpoints(tmp_path, 1, just_saved=7) == [5, 10]
    assert checkpointing.saved_iterations(tmp_path) == [7]
    assert checkpointing.latest_checkpoint(tmp_path).name == "iter_0000007"


def test_rotation_never_deletes_the_last_checkpoint_from_finite_steps(tmp_path):
    saved(tmp_path, 1, 1.0)
    saved(tmp_path, 2, 2.0)  # the last one from finite steps
    saved(tmp_path, 3, 3.0, streak=1)
    saved(tmp_path, 4, 4.0, streak=2)
    assert checkpointing.keep_last_checkpoints(tmp_path, 1, just_saved=4) == [1, 3]
    assert checkpointing.saved_iterations(tmp_path) == [2, 4]


def test_rotation_keeps_the_checkpoint_the_pointer_names(tmp_path):
    saved(tmp_path, 1, 1.0)
    saved(tmp_path, 2, 2.0)
    (tmp_path / checkpointing.LATEST).write_text("1")  # as a user set it back by hand
    assert checkpointing.keep_last_checkpoints(tmp_path, 1, just_saved=2) == []


def hold_lock(folder, ready, release):
    lock = checkpointing.SaveFolderLock(folder).acquire()
    ready.set()
    release.wait(60)
    lock.release()


def test_a_save_folder_has_one_writer_at_a_time(tmp_path):
    import multiprocessing

    context = multiprocessing.get_context("fork")  # quick: the child only takes a lock
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=hold_lock, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(
            checkpointing.CheckpointError,
            match=rf"--save {tmp_path}: another run is writing to "
            rf"this folder \(host .*, pid {holder.pid}, started",
        ):
            checkpointing.SaveFolderLock(tmp_path).acquire()
    finally:
        release.set()
        holder.join(60)
    with checkpointing.SaveFolderLock(tmp_path):  # released: free again
        pass
    assert not (tmp_path / checkpointing.LOCK).exists()


def test_a_killed_writer_leaves_no_lock_behind(tmp_path):
    import multiprocessing
    import os
    import signal

    context = multiprocessing.get_context("fork")  # quick: the child only takes a lock
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=hold_lock, args=(str(tmp_path), ready, release))
    holder.start()
    assert ready.wait(60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(60)
    # the file stays, its lock went with the process
    assert (tmp_path / checkpointing.LOCK).exists()
    with checkpointing.SaveFolderLock(tmp_path):
        assert str(os.getpid()) in (tmp_path / checkpointing.LOCK).read_text()


def test_a_run_that_fails_before_writing_leaves_no_save_folder(tmp_path):
    folder = tmp_path / "new"
    with pytest.raises(RuntimeError, match="bad flag"):
        with checkpointing.SaveFolderLock(folder):
            raise RuntimeError("bad flag")
    assert not folder.exists()
