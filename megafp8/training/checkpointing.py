"""Sharded checkpoints with `torch.distributed.checkpoint` that load under any tp / pp / dp layout.

Layout of `--save DIR`:

    DIR/iter_0000100/          a DCP checkpoint (one file per rank + .metadata) and megafp8.json
    DIR/latest_checkpointed_iteration.txt

A checkpoint is written to `iter_N.tmp`, renamed to `iter_N` once every rank has finished, and
only then does the `latest` file (itself written to a temporary name, synced and renamed) point
at it: a run killed at any moment of a save leaves the previous checkpoint as the latest,
loadable. A checkpoint of the same iteration being replaced is first renamed `iter_N.old` and
removed only once the new one is in place; until then the loader falls back to it. A failure on
any rank (disk full, permissions) stops every rank with the message. Each file's CRC-32 (per
64 MiB piece, so many threads hash it) is recorded in checksums/ by the rank that wrote it, on a
thread while training goes on, and checked before a load reads the file. One run at a time
writes a --save folder: it holds a lock there (megafp8.lock).

Loading runs no code from the checkpoint: DCP's `.metadata` is unpickled with only DCP's own
record classes allowed, and its non-tensor items with `torch.load(weights_only=True)`.

What is stored is layout-free, so loading reshards:
- each parameter under its name (layers are named by their global index, so any pipeline split
  finds its own), tensor-parallel ones as DTensors sharded over the tp group (DCP then reads any
  tp size's slice), vocabulary-parallel ones whole and without the padding rows, FP8 primary
  weights (Fp8Linear.make_weight_fp8) as their masters in the weights' dtype, what a run with
  high-precision weights stores;
- the fp32 master weight and Adam moments of each parameter, laid out like the parameter
  (the distributed optimizer's dp shards are assembled per parameter);
- the FP8 scaling state (scales, amax histories, update counts: agreed over tp x dp, so stored
  once), the iteration, consumed samples, LR schedule position and the run's arguments;
- the model's TransformerConfig, in megafp8.json, so a run that loads it (or a converter)
  builds that model without being told its shape;
- each rank's RNG states under its (tp, pp, dp) coordinates, restored when the layout matches.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import random
import shutil
import socket
import threading
import time
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megafp8.collectives import all_gather, group_size, rank_in
from megafp8.fp8 import Fp8Linear
from megafp8.models.config import TransformerConfig

LATEST = "latest_checkpointed_iteration.txt"
LOCK = "megafp8.lock"
CHECKSUMS = "checksums"  # a folder: one record per rank, of the files that rank wrote
OPTIMIZER_KEYS = ("master", "exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model being loaded."""


def _distributed():
    return dist.is_available() and dist.is_initialized()


def _is_writer():
    return not _distributed() or dist.get_rank() == 0


def _on_writer(action, what: str):
    """Run `action` on the writing rank (global rank 0) while the others wait, and share how it
    went: an error there is raised as a CheckpointError on every rank, not only on rank 0 while
    the others sit in a barrier until the collective timeout."""
    error = None
    if _is_writer():
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
            error = f"{what}: {exc}"
    if _distributed():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)


def iteration_dir(save_dir, iteration) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def _replaced(path: Path) -> Path:
    """Where a checkpoint of the same iteration waits while a new one takes its place."""
    return path.with_name(path.name + ".old")


def _complete(path: Path) -> bool:
    return (path / ".metadata").exists()


def latest_checkpoint(load_dir) -> Path | None:
    """The checkpoint `load_dir` designates: itself if it is one, else what its latest file names,
    else (the pointer lost, complete checkpoints there) the one saved last, with a warning."""
    load_dir = Path(load_dir)
    if _complete(load_dir):
        return load_dir
    pointer = load_dir / LATEST
    if not pointer.exists():
        return _without_pointer(load_dir)
    try:
        text = pointer.read_bytes().decode().strip()
        iteration = int(text)
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{pointer} should hold an iteration number, not binary data: restore it, or "
            "give --load the checkpoint to resume from (a DIR/iter_N folder)"
        ) from None
    except ValueError:
        raise CheckpointError(
            f"{pointer} should hold an iteration number, not {text[:40]!r}"
        ) from None
    except OSError as error:
        raise CheckpointError(f"cannot read {pointer}: {error}") from None
    path = iteration_dir(load_dir, iteration)
    if not _complete(path):
        if _complete(_replaced(path)):  # a save replacing this iteration stopped half-way
            return _replaced(path)
        raise CheckpointError(
            f"{pointer} names iteration {iteration}, but {path} is not a complete checkpoint"
        )
    return path


def _without_pointer(load_dir: Path) -> Path | None:
    """The checkpoint saved last in a folder whose latest file is gone (deleted, or lost with a
    disk), so that a resume never starts afresh over complete checkpoints; None if it has none."""
    saved = saved_iterations(load_dir)
    if not saved:
        return None
    last = max(saved, key=lambda i: _saved_at(iteration_dir(load_dir, i)))
    warnings.warn(
        f"{load_dir} has no {LATEST} but holds complete checkpoints ({_describe(saved)}): resuming "
        f"from iteration {last}, the one saved last; to resume from another, give its folder "
        f"as --load ({iteration_dir(load_dir, saved[0])}, ...)",
        stacklevel=3,
    )
    return iteration_dir(load_dir, last)


def saved_iterations(save_dir) -> list[int]:
    """The iterations of the complete checkpoints in `save_dir`, in order."""
    found = set()
    for path in Path(save_dir).glob("iter_*"):
        number = path.name[len("iter_") :].removesuffix(".old")
        if number.isdigit() and _complete(path):
            found.add(int(number))
    return sorted(found)


def _saved_at(checkpoint: Path) -> float:
    """When a checkpoint was saved: as its megafp8.json records it (a copy keeps that), else the
    time its index was written."""
    saved_at = _record(checkpoint).get("saved_at")
    if isinstance(saved_at, (int, float)):
        return float(saved_at)
    try:
        return (checkpoint / ".metadata").stat().st_mtime
    except OSError:
        return 0.0


def _streak(checkpoint: Path) -> int:
    """How many non-finite steps in a row preceded a checkpoint's save (0: a finite step)."""
    train = _record(checkpoint).get("train")
    streak = train.get("skipped_in_a_row", 0) if isinstance(train, dict) else 0
    return streak if isinstance(streak, int) else 0


def _record(checkpoint: Path) -> dict:
    """checkpoint_info, or {} for a record that cannot be read: choosing among checkpoints (which
    to resume, which to keep) must not stop at one damaged megafp8.json."""
    try:
        return checkpoint_info(checkpoint)
    except (CheckpointError, OSError):
        return {}


# megafp8.json's format. A reader refuses any other, so that a checkpoint it would misread is an
# error saying so: raise it when a field changes meaning or a new one is required, and say what
# changed in docs/checkpoints.md.
FORMAT = 1
_RECORDED = ("iteration", "args", "train", "model")  # what format 1 records beside "format"


def checkpoint_info(checkpoint) -> dict:
    """A checkpoint's megafp8.json: {"format", "iteration", "saved_at", "args", "train", "model"}
    ({} if it has none); a record of another format, or one that lacks a field, is a
    CheckpointError."""
    path = Path(checkpoint) / "megafp8.json"
    if not path.exists():
        return {}
    try:
        info = json.loads(path.read_text())
    except ValueError as error:
        raise CheckpointError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{path} should hold a JSON object, not a {type(info).__name__}")
    version = info.get("format")
    if version is None:
        raise CheckpointError(
            f"{path} names no checkpoint format: a megafp8 from before the format was versioned "
            f"wrote it, and this one reads format {FORMAT} only; convert it to Hugging Face with the "
            "megafp8 that wrote it (tools/convert_checkpoint.py to-hf), then back with this one"
        )
    if version != FORMAT:
        newer = isinstance(version, int) and version > FORMAT
        raise CheckpointError(
            f"{path} is in checkpoint format {version!r}; this megafp8 reads format {FORMAT} only"
            + (": upgrade megafp8 to load it" if newer else "")
        )
    missing = [key for key in _RECORDED if key not in info]
    if missing:
        raise CheckpointError(
            f"{path} lacks {', '.join(repr(key) for key in missing)}, which checkpoint format "
            f"{FORMAT} records: it was edited or damaged"
        )
    return info


def saved_model_config(checkpoint) -> TransformerConfig:
    """The model config a checkpoint (an iter_N folder) recorded in its megafp8.json."""
    info = checkpoint_info(checkpoint)
    if not info:
        raise CheckpointError(
            f"{checkpoint} has no megafp8.json, which records the model: not a complete checkpoint"
        )
    try:
        return TransformerConfig.from_dict(info["model"])
    except (ValueError, TypeError) as error:
        raise CheckpointError(
            f'{Path(checkpoint) / "megafp8.json"}: its "model" is not a valid model config: {error}'
        ) from None


def latest_model_config(load) -> tuple[Path, TransformerConfig] | None:
    """(checkpoint, model config) of the checkpoint a --load folder designates (its latest, or
    itself if it is one); None without --load (`load` None) or if the folder has no checkpoint yet."""
    checkpoint = latest_checkpoint(load) if load is not None else None
    if checkpoint is None:
        return None
    return checkpoint, saved_model_config(checkpoint)


def _describe(iterations) -> str:
    if len(iterations) <= 4:
        return f"iteration{'s' if len(iterations) > 1 else ''} {', '.join(map(str, iterations))}"
    return f"{len(iterations)} checkpoints, iterations {iterations[0]} ... {iterations[-1]}"


def check_run_folders(save, load, *, finetune=False, overwrite=False) -> list[int]:
    """Check --save and --load before a run builds anything; returns the iterations of another
    run's checkpoints in `save` that this run will replace (only with `overwrite`).

    A --load folder that does not exist is a typo, unless it is also --save (a job that resumes
    itself on every launch). A --save folder that holds checkpoints belongs to a run that this
    one must be resuming (--load of that folder, or of one of its checkpoints, without
    --finetune); anything else would write over it and is refused unless `overwrite`."""
    if load is not None and not Path(load).exists():
        if save is None or Path(load).resolve() != Path(save).resolve():
            raise CheckpointError(
                f"--load {load}: no such folder. Check the path; a run that starts "
                "from scratch needs no --load"
            )
    if save is None:
        return []
    save_dir = Path(save).resolve()
    previous = saved_iterations(save_dir)
    if not previous:
        return []
    source = Path(load).resolve() if load is not None else None
    if source is not None and not finetune and save_dir in (source, source.parent):
        return []
    if overwrite:
        return previous
    why = (
        "--finetune starts a new run at iteration 0, which would write over them"
        if finetune and source
        else f"this run loads {load}, not them, and would write over them"
        if source
        else "this new run would write over them"
    )
    raise CheckpointError(
        f"--save {save} already holds checkpoints ({_describe(previous)}); {why}. To resume that run, "
        f"add --load {save}; to keep it, give another --save folder; to replace it, add --overwrite-save"
    )


class SaveFolderLock:
    """One run at a time writes a --save folder: the writing rank holds an exclusive lock on
    `megafp8.lock` there for the whole run (an OS lock, released by the kernel when the process
    ends however it ends, so a killed run leaves no stale lock); the file names the holder for
    the message a second run gets. Taken before the run writes anything; collective."""

    def __init__(self, save_dir):
        self.path = Path(save_dir) / LOCK if save_dir is not None else None
        self._handle = None
        self._made_folder = False

    def acquire(self) -> SaveFolderLock:
        if self.path is not None:
            _on_writer(self._take, f"--save {self.path.parent}")
        return self

    def _take(self):
        try:
            import fcntl
        except ImportError:  # Windows: no advisory locks; runs are not guarded there
            return
        folder = self.path.parent
        self._made_folder = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        while True:
            handle = open(self.path, "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                raise CheckpointError(
                    f"another run is writing to this folder ({holder}); two runs on one folder would interleave "
                    "their checkpoints. Give this run another --save folder, or stop that run first"
                ) from None
            except OSError as error:  # a filesystem without locks (some network mounts)
                handle.close()
                warnings.warn(
                    f"cannot lock {self.path} ({error}): nothing stops a second run from writing to "
                    "this --save folder at the same time",
                    stacklevel=4,
                )
                return
            # The file may have been removed by the holder releasing it between our open and lock:
            # then we locked a file no one else can see, and must lock the new one.
            try:
                same = os.stat(self.path).st_ino == os.fstat(handle.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            handle.close()
        handle.seek(0)
        handle.truncate()
        handle.write(
            f"host {socket.gethostname()}, pid {os.getpid()}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        """Give the folder up (writing rank, not collective); an empty folder it made goes too."""
        if self._handle is None:
            return
        try:
            os.unlink(self.path)  # before unlocking, so a waiting run never locks a stale file
        except OSError:
            pass
        self._handle.close()
        self._handle = None
        if self._made_folder:
            try:
                self.path.parent.rmdir()  # only if empty: a run that failed before writing anything
            except OSError:
                pass

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _delete_checkpoints(save_dir, iterations, flag: str, whose: str = "") -> list[int]:
    """Delete the checkpoints of `iterations` in `save_dir` on the writing rank (a failure is a
    warning naming `flag`); the iterations deleted."""
    if not _is_writer():
        return []
    deleted = []
    for iteration in iterations:
        path = iteration_dir(save_dir, iteration)
        try:
            shutil.rmtree(path)
            deleted.append(iteration)
        except OSError as error:
            warnings.warn(f"{flag}: could not delete {path}{whose} ({error})", stacklevel=3)
    return deleted


def remove_checkpoints(save_dir, iterations, keep: int) -> None:
    """Delete the checkpoints of `iterations` in `save_dir` but `keep` (--overwrite-save, once the
    new run's first checkpoint is in place). Writing rank only; a failure is a warning."""
    _delete_checkpoints(
        save_dir, [i for i in iterations if i != keep], "--overwrite-save", " of the earlier run"
    )


def keep_last_checkpoints(save_dir, keep: int, *, just_saved: int) -> list[int]:
    """Delete the complete checkpoints in `save_dir` but the `keep` saved last
    (--keep-last-checkpoints), once `just_saved` is published. Never deleted: `just_saved`, the one
    the latest file names, and the last one saved from finite steps (a run in a streak of
    non-finite steps saves weights that may have blown up). Saving order, not iteration number,
    decides: a run resumed from an older checkpoint (a rollback) keeps what it saves. Writing rank
    only (the others do not list the folder); a failure is a warning. Returns the iterations deleted."""
    if not _is_writer():
        return []
    save_dir = Path(save_dir)
    newest_first = sorted(
        saved_iterations(save_dir),
        key=lambda i: _saved_at(iteration_dir(save_dir, i)),
        reverse=True,
    )
    kept = set(newest_first[:keep]) | {just_saved}
    pointed = latest_checkpoint(save_dir)
    if pointed is not None:
        kept.add(int(pointed.name[len("iter_") :].removesuffix(".old")))
    finite = next((i for i in newest_first if _streak(iteration_dir(save_dir, i)) == 0), None)
    if finite is not None:
        kept.add(finite)
    return _delete_checkpoints(
        save_dir, sorted(i for i in newest_first if i not in kept), "--keep-last-checkpoints"
    )


TOKENIZER_DIR = "tokenizer"
# Each tokenizer type's files, {build_tokenizer argument: file name}, named as Hugging Face
# folders name them (so such a folder loads as one), in the order Tokenizer.files lists them.
TOKENIZER_FILES = {
    "HuggingFaceTokenizer": {"tokenizer_model": "tokenizer.json"},
    "SentencePieceTokenizer": {"tokenizer_model": "tokenizer.model"},
    "GPT2BPETokenizer": {"vocab_file": "vocab.json", "merge_file": "merges.txt"},
}


def save_tokenizer(save_dir, tokenizer_type, files) -> Path | None:
    """Copy the run's tokenizer files into `save_dir/tokenizer` unless they are there already,
    so the checkpoint folder stands on its own (as a Hugging Face folder carries its tokenizer).
    Collective; returns the folder, or None for a tokenizer without files (NullTokenizer)."""
    names = TOKENIZER_FILES.get(tokenizer_type, {}).values()
    if not names or not files:
        return None
    folder = Path(save_dir) / TOKENIZER_DIR

    def copy():
        if folder.exists():
            return
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, source in zip(names, files):
            shutil.copyfile(source, tmp / name)
        os.replace(tmp, folder)

    _on_writer(copy, f"cannot copy the tokenizer into {folder}")
    return folder


# -- layout-free views of the local tensors -------------------------------------------------


class _Layout:
    """Turns this rank's parameter-shaped tensors into what is stored, and back."""

    def __init__(self, tp_group):
        self.tp_group = tp_group
        self.tp = group_size(tp_group)
        self._mesh = None

    def mesh(self, device):
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self.tp_group, device.type)
        return self._mesh

    def stored(self, param, tensor):
        """The tensor as saved: full vocabulary rows, a tp-sharded DTensor, or as is."""
        partition = getattr(param, "partition", None)
        if hasattr(param, "unpadded_rows"):
            full = all_gather(tensor.contiguous(), self.tp_group, dim=0) if self.tp > 1 else tensor
            return full[: param.unpadded_rows]
        if partition is None:
            return tensor
        view = partition.stacked_view(tensor)
        if self.tp == 1:
            return view
        from torch.distributed.tensor import DTensor, Shard

        dim = partition.dim + (1 if partition.stack > 1 else 0)
        return DTensor.from_local(
            view.contiguous(), self.mesh(tensor.device), [Shard(dim)], run_check=False
        )

    def placeholder(self, param, dtype):
        """An empty tensor shaped like `stored(param, ...)`, for DCP to load into."""
        if hasattr(param, "unpadded_rows"):
            return torch.empty(
                (param.unpadded_rows, *param.shape[1:]), dtype=dtype, device=param.device
            )
        return self.stored(param, torch.empty(param.shape, dtype=dtype, device=param.device))

    def local(self, param, stored):
        """This rank's parameter-shaped tensor from a loaded stored tensor."""
        if hasattr(param, "unpadded_rows"):
            rows = param.shape[0]
            start = rank_in(self.tp_group) * rows
            out = torch.zeros(param.shape, dtype=stored.dtype, device=stored.device)
            piece = stored[start : min(start + rows, param.unpadded_rows)]
            out[: len(piece)] = piece
            return out
        if hasattr(stored, "to_local"):
            stored = stored.to_local()
        return stored.reshape(param.shape)


def stored_shape(param) -> tuple:
    """The global shape `param` of a one-process (tp = 1) model is stored with: vocabulary
    tensors without padding rows, stacked matrices (SwiGLU's gate and up) as [stack, ...]."""
    if hasattr(param, "unpadded_rows"):
        return (param.unpadded_rows, *param.shape[1:])
    partition = getattr(param, "partition", None)
    return tuple(partition.stacked_view(param).shape if partition is not None else param.shape)


def _rng_state():
    state = {
        "cpu": torch.get_rng_state(),
        "numpy": torch.tensor(np.frombuffer(json.dumps(_numpy_state()).encode(), dtype=np.uint8)),
        "python": torch.tensor(
            np.frombuffer(json.dumps(random.getstate()).encode(), dtype=np.uint8)
        ),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _numpy_state():
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return [kind, keys.tolist(), pos, has_gauss, gauss]


def _set_rng_state(state):
    torch.set_rng_state(state["cpu"])
    kind, keys, pos, has_gauss, gauss = json.loads(bytes(state["numpy"].numpy()).decode())
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss = json.loads(bytes(state["python"].numpy()).decode())
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# -- save / load -----------------------------------------------------------------------------


def _fp8_weight_linears(model) -> dict:
    """{id(parameter): its Fp8Linear} for the FP8 primary weights of `model` (Fp8Linear.make_weight_fp8):
    stored as a run with high-precision weights stores them (the master in the weights' dtype;
    without an optimizer, the dequantized weight), loaded by casting that with the loaded scale."""
    return {
        id(m.weight): m
        for m in model.modules()
        if isinstance(m, Fp8Linear) and m.fp8_primary_weight
    }


def _fp8_state(model):
    """The model's non-parameter state: FP8 scales, amax histories and (as JSON) update counts;
    what its state_dict holds beside the parameters, gathered without the parameters (an FP8
    primary weight's entry there is a dequantized copy)."""
    state = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                state[prefix + name] = buffer.detach()
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            state[prefix + "_extra_state"] = json.dumps(module.get_extra_state())
    return state


def _coordinates(groups):
    return f"tp{groups.tp_rank}_pp{groups.pp_rank}_dp{groups.dp_rank}" if groups else "tp0_pp0_dp0"


def save_checkpoint(
    save_dir,
    iteration,
    model,
    optimizer,
    *,
    groups,
    train_state: dict,
    args: dict,
    model_config: TransformerConfig,
):
    """Save everything for an exact resume as `save_dir/iter_<iteration>`, then point latest at it.
    `model_config` is the config `model` was built from."""
    layout = _Layout(groups.tp_group if groups else None)
    optimizer_states = optimizer.state_for_checkpoint() if optimizer is not None else {}
    fp8_weights = _fp8_weight_linears(model)
    state = {}
    for name, param in model.named_parameters():
        value = param.detach()
        linear = fp8_weights.get(id(param))
        if linear is not None:  # what a run with high-precision weights stores: the master rounded
            master = optimizer_states.get(name, {}).get("master")
            value = (
                linear.dequantized_weight()
                if master is None
                else master.to(linear.high_precision_dtype)
            )
        state[f"model/{name}"] = layout.stored(param, value)
    for name, entry in optimizer_states.items():
        param = model.get_parameter(name)
        for key in OPTIMIZER_KEYS:
            state[f"optimizer/{name}/{key}"] = layout.stored(param, entry[key])
    if optimizer is not None:
        state["optimizer/step"] = optimizer.step_count()
    for name, value in _fp8_state(model).items():
        state[f"fp8/{name}"] = value
    for key, value in _rng_state().items():
        state[f"rng/{_coordinates(groups)}/{key}"] = value
    return write_checkpoint(
        save_dir, iteration, state, train_state=train_state, args=args, model_config=model_config
    )


def write_checkpoint(
    save_dir,
    iteration,
    state: dict,
    *,
    train_state: dict,
    args: dict,
    model_config: TransformerConfig,
) -> Path:
    """Write `state` (a flat dict, keys as above) as `save_dir/iter_<iteration>` and point latest
    at it, so that no moment of the save leaves a half-written checkpoint as the latest or no
    checkpoint at all; megafp8.json records `args`, `train_state` and `model_config`. Collective
    when torch.distributed is initialised; one process (DCP's no_dist mode) otherwise. A failure
    on any rank raises CheckpointError on every rank."""
    state["train"] = json.dumps(train_state)  # one object: DCP would flatten a dict into keys
    record = json.dumps(
        {
            "format": FORMAT,
            "iteration": iteration,
            "saved_at": time.time(),
            "args": args,
            "train": train_state,
            "model": model_config.to_dict(),
        },
        indent=1,
    )
    final = iteration_dir(save_dir, iteration)
    tmp = final.with_name(final.name + ".tmp")

    def prepare():
        shutil.rmtree(tmp, ignore_errors=True)  # the leftovers of a save that was killed
        tmp.mkdir(parents=True)

    def publish():
        _write_durably(tmp / "megafp8.json", record)
        old = _replaced(final)
        if final.exists():  # the same iteration saved before: set aside until the new one is in
            if old.exists():
                shutil.rmtree(old)  # a copy already superseded by `final`
            os.replace(final, old)
        os.replace(tmp, final)
        _sync_directory(final.parent)
        _write_durably(Path(save_dir) / LATEST, str(iteration))
        shutil.rmtree(old, ignore_errors=True)

    _on_writer(prepare, f"cannot create the checkpoint folder {tmp}")
    try:
        if _distributed():
            # raises on every rank if one rank's write fails
            dcp.save(state, checkpoint_id=str(tmp))
        else:
            # DCP warns that there is no process group: none is meant
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        raise CheckpointError(
            f"writing the checkpoint {tmp} failed: {_failures(error)}; the previous "
            "checkpoint, if any, is still the latest"
        ) from None
    _on_writer(
        publish,
        f"cannot finish the checkpoint {final} (the previous one, if any, is still the latest)",
    )
    _checksum_in_background(final)
    return final


# -- checksums ---------------------------------------------------------------------------------

_PIECE = 64 << 20  # CRC-32 per piece: the pieces of a shard are hashed by several threads at once


def _file_checksum(path: Path, piece: int = _PIECE) -> dict:
    """{"bytes", "crc32": [one per piece]} of a file; zlib releases the GIL while it hashes."""
    size = path.stat().st_size
    with open(path, "rb") as f:

        def crc(offset):
            return zlib.crc32(os.pread(f.fileno(), piece, offset))

        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            pieces = list(pool.map(crc, range(0, size, piece)))
    return {"bytes": size, "crc32": pieces}


_hashing: list = []  # threads hashing the files of checkpoints just saved


def _checksum_in_background(checkpoint: Path) -> None:
    """Record the CRC-32s of the files this rank wrote into `checkpoint` (DCP names them
    __<rank>_<n>.distcp; the writing rank also wrote .metadata) in checksums/rank_<rank>.json,
    on a thread: training goes on meanwhile, so the checksums cost the save no time. Whoever saves
    calls `wait_for_checksums` before its process ends (at interpreter exit the thread could no
    longer start its hashing threads); a checkpoint whose record is missing (killed meanwhile)
    loads unchecked."""
    rank = dist.get_rank() if _distributed() else 0
    names = [path.name for path in sorted(checkpoint.glob(f"__{rank}_*.distcp"))]
    if _is_writer():
        names.append(".metadata")

    def record():
        try:
            files = {name: _file_checksum(checkpoint / name) for name in names}
            (checkpoint / CHECKSUMS).mkdir(exist_ok=True)
            _write_durably(
                checkpoint / CHECKSUMS / f"rank_{rank:05d}.json",
                json.dumps({"algorithm": "crc32", "piece_bytes": _PIECE, "files": files}),
            )
        except OSError:  # the checkpoint was deleted or replaced meanwhile (rotation)
            pass

    thread = threading.Thread(target=record, name=f"checksums of {checkpoint.name}")
    thread.start()
    _hashing.append(thread)


def wait_for_checksums() -> None:
    """Wait until the checksums of the checkpoints this process saved are recorded."""
    while _hashing:
        _hashing.pop().join()


def _own_file_name(name: str) -> bool:
    """Whether a file name a checkpoint's records give stays in the checkpoint's folder."""
    return Path(name).name == name and name not in ("", ".", "..")


def verify_checkpoint(checkpoint) -> None:
    """Check a checkpoint's files against the checksums recorded with it; raise a CheckpointError
    naming the first damaged file. The files are shared out over the ranks (collective when
    torch.distributed is initialised). Files without a record (a process killed before its
    record was written) pass."""
    wait_for_checksums()  # one this process saved may still be hashing
    checkpoint = Path(checkpoint)
    files = {}
    for record_path in sorted((checkpoint / CHECKSUMS).glob("rank_*.json")):
        try:
            record = json.loads(record_path.read_text())
            piece = int(record["piece_bytes"])
            if piece <= 0:
                raise ValueError(f"piece_bytes {piece}")
            for name, entry in dict(record["files"]).items():
                files[name] = (
                    {"bytes": int(entry["bytes"]), "crc32": [int(c) for c in entry["crc32"]]},
                    piece,
                )
        except (ValueError, KeyError, TypeError, OSError) as error:
            raise CheckpointError(
                f"{record_path} is not a readable checksum record ({error}); if the checkpoint "
                f"itself is sound, delete that file to load it unchecked"
            ) from None
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    problem = None
    for name in sorted(files)[rank::world]:
        path = checkpoint / name
        if not _own_file_name(name):
            problem = f"{checkpoint / CHECKSUMS} names {name!r}, which is not a file of the checkpoint's own folder"
            break
        want, piece = files[name]
        try:
            got = _file_checksum(path, piece)
        except OSError as error:
            problem = f"cannot read {path} ({error})"
            break
        if got["bytes"] != want["bytes"]:
            problem = (
                f"{path} is {got['bytes']:,} bytes where the save wrote {want['bytes']:,}: it was truncated "
                "or replaced"
            )
            break
        bad = next((k for k, (a, b) in enumerate(zip(got["crc32"], want["crc32"])) if a != b), None)
        if bad is not None:
            problem = (
                f"{path} is damaged: bytes {bad * piece:,} to {min((bad + 1) * piece, got['bytes']):,} do not "
                "match the checksum written with them (a disk or copy error)"
            )
            break
    problems = [problem]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise CheckpointError(
            f"{first}; load another checkpoint (--load {checkpoint.parent}/iter_N), or restore "
            "this one from a copy"
        )


def _failures(error) -> str:
    """One line per failing rank of a DCP error (its own text is every rank's traceback)."""
    if not isinstance(error, CheckpointException):
        return str(error)

    def line(exc):
        if isinstance(exc, pickle.UnpicklingError):  # weights_only's message is a page long
            return (
                "an item is a pickled object, not plain data: refused (loading it could run code)"
            )
        return f"{type(exc).__name__}: {exc}"

    return "; ".join(
        f"rank {rank}: {line(exc)}" for rank, (exc, _) in sorted(error.failures.items())
    )


def _write_durably(path: Path, text: str) -> None:
    """Replace `path` by `text` atomically, on disk before the rename makes it visible."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_directory(path.parent)


def _sync_directory(path: Path) -> None:
    """Make a rename in `path` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


# -- loading without running code from the checkpoint ----------------------------------------


def _metadata_global(module: str, name: str):
    """The global a DCP .metadata may name, or None: DCP's record classes, torch sizes, dtypes
    and layouts, and paths. Anything else would be a call the file asks us to make."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem
    import torch.distributed.checkpoint.metadata as dcp_metadata

    if module == dcp_metadata.__name__:
        value = getattr(dcp_metadata, name, None)
        return value if isinstance(value, type) and value.__module__ == module else None
    if (module, name) == (dcp_filesystem.__name__, "_StorageInfo"):
        return dcp_filesystem._StorageInfo
    if module == "torch":
        value = getattr(torch, name, None)
        return value if value is torch.Size or isinstance(value, torch.dtype) else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout
    if module == "pathlib" and name in (
        "Path",
        "PosixPath",
        "WindowsPath",
        "PurePosixPath",
        "PureWindowsPath",
    ):
        return getattr(pathlib, name)
    if (module, name) == ("collections", "OrderedDict"):
        import collections

        return collections.OrderedDict
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        value = _metadata_global(module, name)
        if value is None:
            raise CheckpointError(
                f"its .metadata asks to load {module}.{name}, which is not part of a "
                "torch.distributed.checkpoint: refused (loading it could run code)"
            )
        return value


class CheckpointReader(dcp.FileSystemReader):
    """DCP's file reader, but the metadata must pass the restricted unpickler before DCP reads it."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                _MetadataUnpickler(f).load()
        except CheckpointError as error:
            raise CheckpointError(f"{self.path}: {error}") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as error:
            raise CheckpointError(f"{path} is not a readable checkpoint index ({error})") from None
        metadata = super().read_metadata(*args, **kwargs)
        for info in (metadata.storage_data or {}).values():
            name = str(getattr(info, "relative_path", ""))
            if not _own_file_name(name):  # DCP joins it to the folder and reads it
                raise CheckpointError(
                    f"{path} points at {name!r}, outside the checkpoint's folder: refused"
                )
        return metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor items with weights_only=False; megafp8 stores
    only strings and integers there, which weights_only=True loads. The state dict is flat."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def read_metadata(checkpoint):
    """The DCP metadata of `checkpoint`; `.state_dict_metadata` maps each key to its size, dtype, ..."""
    return CheckpointReader(str(checkpoint)).read_metadata()


def read_state(state: dict, checkpoint) -> None:
    """Fill the flat `state` (placeholders for the keys wanted) from `checkpoint` (a path or a
    CheckpointReader), running no code from it. Collective when torch.distributed is initialised."""
    if any(isinstance(value, dict) for value in state.values()):
        raise ValueError("read_state takes a flat state dict (no nested dicts)")
    reader = (
        checkpoint
        if isinstance(checkpoint, CheckpointReader)
        else CheckpointReader(str(checkpoint))
    )
    verify_checkpoint(reader.path)
    try:
        if _distributed():
            dcp.load(state, storage_reader=reader, planner=_WeightsOnlyPlanner())
            return
        with warnings.catch_warnings():  # DCP warns that there is no process group: none is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=_WeightsOnlyPlanner(), no_dist=True)
    except CheckpointException as error:
        raise CheckpointError(f"cannot load {reader.path}: {_failures(error)}") from None


def load_checkpoint(path, model, optimizer, *, groups, load_optimizer=True, load_rng=True):
    """Load `path` (a checkpoint, or a --save folder) into model (and optimizer); returns the
    train state dict ({} when only weights were loaded)."""
    checkpoint = latest_checkpoint(path)
    if checkpoint is None:
        raise CheckpointError(f"no checkpoint in {path} (no {LATEST}, no .metadata)")
    metadata = read_metadata(checkpoint).state_dict_metadata
    layout = _Layout(groups.tp_group if groups else None)
    params = list(model.named_parameters())

    def expect(key, placeholder):
        if key not in metadata:
            raise CheckpointError(
                f"{checkpoint} has no {key!r}: it was saved from another model "
                "(different architecture or layer count)"
            )
        saved = tuple(getattr(metadata[key], "size", ()))
        want = tuple(placeholder.shape)
        if saved != want:
            raise CheckpointError(
                f"{checkpoint}: {key} has shape {list(saved)} there but "
                f"{list(want)} in this model: the model shapes differ"
            )
        return placeholder

    fp8_weights = _fp8_weight_linears(model)
    state = {}
    for name, param in params:
        linear = fp8_weights.get(id(param))
        dtype = linear.high_precision_dtype if linear is not None else param.dtype
        state[f"model/{name}"] = expect(f"model/{name}", layout.placeholder(param, dtype))
    with_optimizer = load_optimizer and optimizer is not None and "optimizer/step" in metadata
    if with_optimizer:
        for name, param in params:
            for key in OPTIMIZER_KEYS:
                state[f"optimizer/{name}/{key}"] = expect(
                    f"optimizer/{name}/{key}", layout.placeholder(param, torch.float32)
                )
        state["optimizer/step"] = 0
    for name, value in _fp8_state(model).items():
        key = f"fp8/{name}"
        if key in metadata:
            state[key] = (
                torch.empty(tuple(metadata[key].size), dtype=value.dtype, device=value.device)
                if torch.is_tensor(value)
                else value
            )
    state["train"] = "{}"
    rng_prefix = f"rng/{_coordinates(groups)}/"
    rng_keys = [k for k in metadata if k.startswith(rng_prefix)] if load_rng else []
    for key in rng_keys:
        state[key] = torch.empty(tuple(metadata[key].size), dtype=torch.uint8)
    read_state(state, checkpoint)

    fp8 = {
        k[len("fp8/") :]: v if torch.is_tensor(v) else json.loads(v)
        for k, v in state.items()
        if k.startswith("fp8/")
    }
    missing = model.load_state_dict(fp8, strict=False).missing_keys
    loaded = {}  # the FP8 primary weights' high-precision values
    with torch.no_grad():  # after the scales: FP8 primary weights are cast with theirs
        for name, param in params:
            value = layout.local(param, state[f"model/{name}"])
            linear = fp8_weights.get(id(param))
            if linear is None:
                param.copy_(value)
            else:
                linear.write_weight(value)
                loaded[param] = value
    param_names = {name for name, _ in params}
    missing = [key for key in missing if key not in param_names]
    if missing:
        warnings.warn(
            f"{checkpoint} has no FP8 scaling state for {len(missing)} entries (e.g. "
            f"{', '.join(missing[:3])}): they start afresh (initial scales, empty amax "
            "history), as in a new run",
            stacklevel=2,
        )
    if optimizer is not None:
        if with_optimizer:
            states = {
                name: {
                    key: layout.local(param, state[f"optimizer/{name}/{key}"])
                    for key in OPTIMIZER_KEYS
                }
                for name, param in params
            }
            optimizer.load_checkpoint_state(states, int(state["optimizer/step"]))
        else:
            optimizer.reset_masters_from_params(loaded)
    if rng_keys:
        _set_rng_state({k[len(rng_prefix) :]: state[k] for k in rng_keys})
    return json.loads(state["train"])
