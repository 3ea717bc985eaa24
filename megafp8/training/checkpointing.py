"""Sharded checkpoints with `torch.distributed.checkpoint` that load under any tp / pp / dp layout.

Layout of `--save DIR`:

    DIR/iter_0000100/          a DCP checkpoint (one file per rank + .metadata) and megafp8.json
    DIR/latest_checkpointed_iteration.txt

A checkpoint is written to `iter_N.tmp`, renamed to `iter_N` once every rank has finished, and
only then does the `latest` file (itself written to a temporary name and renamed) point at it:
a run killed at any moment of a save leaves the previous checkpoint as the latest, loadable.

What is stored is layout-free, so loading reshards:
- each parameter under its name (layers are named by their global index, so any pipeline split
  finds its own), tensor-parallel ones as DTensors sharded over the tp group (DCP then reads any
  tp size's slice), vocabulary-parallel ones whole and without the padding rows;
- the fp32 master weight and Adam moments of each parameter, laid out like the parameter
  (the distributed optimizer's dp shards are assembled per parameter);
- the FP8 scaling state (scales, amax histories, update counts: agreed over tp x dp, so stored
  once), the iteration, consumed samples, LR schedule position and the run's arguments;
- each rank's RNG states under its (tp, pp, dp) coordinates, restored when the layout matches.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megafp8.parallel.communication import all_gather, rank_in, world_size

LATEST = "latest_checkpointed_iteration.txt"
OPTIMIZER_KEYS = ("master", "exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model being loaded."""


def _distributed():
    return dist.is_available() and dist.is_initialized()


def _barrier():
    if _distributed():
        dist.barrier()


def _is_writer():
    return not _distributed() or dist.get_rank() == 0


def iteration_dir(save_dir, iteration) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def latest_checkpoint(load_dir) -> Path | None:
    """The checkpoint `load_dir` designates: itself if it is one, else what its latest file names."""
    load_dir = Path(load_dir)
    if (load_dir / ".metadata").exists():
        return load_dir
    pointer = load_dir / LATEST
    if not pointer.exists():
        return None
    iteration = int(pointer.read_text().strip())
    path = iteration_dir(load_dir, iteration)
    if not (path / ".metadata").exists():
        raise CheckpointError(f"{pointer} names iteration {iteration}, but {path} is not a complete checkpoint")
    return path


# -- layout-free views of the local tensors -------------------------------------------------

class _Layout:
    """Turns this rank's parameter-shaped tensors into what is stored, and back."""

    def __init__(self, tp_group):
        self.tp_group = tp_group
        self.tp = world_size(tp_group)
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
            return full[:param.unpadded_rows]
        if partition is None:
            return tensor
        view = partition.stacked_view(tensor)
        if self.tp == 1:
            return view
        from torch.distributed.tensor import DTensor, Shard
        dim = partition.dim + (1 if partition.stack > 1 else 0)
        return DTensor.from_local(view.contiguous(), self.mesh(tensor.device), [Shard(dim)], run_check=False)

    def placeholder(self, param, dtype):
        """An empty tensor shaped like `stored(param, ...)`, for DCP to load into."""
        if hasattr(param, "unpadded_rows"):
            return torch.empty((param.unpadded_rows, *param.shape[1:]), dtype=dtype, device=param.device)
        return self.stored(param, torch.empty(param.shape, dtype=dtype, device=param.device))

    def local(self, param, stored):
        """This rank's parameter-shaped tensor from a loaded stored tensor."""
        if hasattr(param, "unpadded_rows"):
            rows = param.shape[0]
            start = rank_in(self.tp_group) * rows
            out = torch.zeros(param.shape, dtype=stored.dtype, device=stored.device)
            piece = stored[start:min(start + rows, param.unpadded_rows)]
            out[:len(piece)] = piece
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
    state = {"cpu": torch.get_rng_state(),
             "numpy": torch.tensor(np.frombuffer(json.dumps(_numpy_state()).encode(), dtype=np.uint8)),
             "python": torch.tensor(np.frombuffer(json.dumps(random.getstate()).encode(), dtype=np.uint8))}
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

def _fp8_state(model):
    """The model's non-parameter state: FP8 scales, amax histories and (as JSON) update counts."""
    params = {n for n, _ in model.named_parameters()}
    return {k: v if torch.is_tensor(v) else json.dumps(v)
            for k, v in model.state_dict().items() if k not in params}


def _coordinates(groups):
    return f"tp{groups.tp_rank}_pp{groups.pp_rank}_dp{groups.dp_rank}" if groups else "tp0_pp0_dp0"


def save_checkpoint(save_dir, iteration, model, optimizer, *, groups, train_state: dict, args: dict):
    """Save everything for an exact resume as `save_dir/iter_<iteration>`, then point latest at it."""
    layout = _Layout(groups.tp_group if groups else None)
    state = {}
    for name, param in model.named_parameters():
        state[f"model/{name}"] = layout.stored(param, param.detach())
    if optimizer is not None:
        for name, entry in optimizer.state_for_checkpoint().items():
            param = model.get_parameter(name)
            for key in OPTIMIZER_KEYS:
                state[f"optimizer/{name}/{key}"] = layout.stored(param, entry[key])
        state["optimizer/step"] = optimizer.step_count()
    for name, value in _fp8_state(model).items():
        state[f"fp8/{name}"] = value
    for key, value in _rng_state().items():
        state[f"rng/{_coordinates(groups)}/{key}"] = value
    return write_checkpoint(save_dir, iteration, state, train_state=train_state, args=args)


def write_checkpoint(save_dir, iteration, state: dict, *, train_state: dict, args: dict) -> Path:
    """Write `state` (keys as above) as `save_dir/iter_<iteration>` and point latest at it, so
    that no moment of the save leaves a half-written checkpoint as the latest. Collective when
    torch.distributed is initialised; one process (DCP's no_dist mode) otherwise."""
    state["train"] = json.dumps(train_state)  # one object: DCP would flatten a dict into keys
    final = iteration_dir(save_dir, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if _is_writer():
        shutil.rmtree(tmp, ignore_errors=True)  # the leftovers of a save that was killed
        tmp.mkdir(parents=True)
    _barrier()
    if _distributed():
        dcp.save(state, checkpoint_id=str(tmp))
    else:
        with warnings.catch_warnings():  # DCP warns that there is no process group: none is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    _barrier()
    if _is_writer():
        (tmp / "megafp8.json").write_text(json.dumps({"iteration": iteration, "args": args,
                                                     "train": train_state}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = Path(save_dir) / (LATEST + ".tmp")
        pointer_tmp.write_text(str(iteration))
        os.replace(pointer_tmp, Path(save_dir) / LATEST)
    _barrier()
    return final


def load_checkpoint(path, model, optimizer, *, groups, load_optimizer=True, load_rng=True):
    """Load `path` (a checkpoint, or a --save folder) into model (and optimizer); returns the
    train state dict ({} when only weights were loaded)."""
    checkpoint = latest_checkpoint(path)
    if checkpoint is None:
        raise CheckpointError(f"no checkpoint in {path} (no {LATEST}, no .metadata)")
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    layout = _Layout(groups.tp_group if groups else None)
    params = list(model.named_parameters())

    def expect(key, placeholder):
        if key not in metadata:
            raise CheckpointError(f"{checkpoint} has no {key!r}: it was saved from another model "
                                  "(different architecture or layer count)")
        saved = tuple(getattr(metadata[key], "size", ()))
        want = tuple(placeholder.shape)
        if saved != want:
            raise CheckpointError(f"{checkpoint}: {key} has shape {list(saved)} there but "
                                  f"{list(want)} in this model: the model shapes differ")
        return placeholder

    state = {}
    for name, param in params:
        state[f"model/{name}"] = expect(f"model/{name}", layout.placeholder(param, param.dtype))
    with_optimizer = load_optimizer and optimizer is not None and "optimizer/step" in metadata
    if with_optimizer:
        for name, param in params:
            for key in OPTIMIZER_KEYS:
                state[f"optimizer/{name}/{key}"] = expect(f"optimizer/{name}/{key}",
                                                          layout.placeholder(param, torch.float32))
        state["optimizer/step"] = 0
    for name, value in _fp8_state(model).items():
        key = f"fp8/{name}"
        if key in metadata:
            state[key] = (torch.empty(tuple(metadata[key].size), dtype=value.dtype, device=value.device)
                          if torch.is_tensor(value) else value)
    state["train"] = "{}"
    rng_prefix = f"rng/{_coordinates(groups)}/"
    rng_keys = [k for k in metadata if k.startswith(rng_prefix)] if load_rng else []
    for key in rng_keys:
        state[key] = torch.empty(tuple(metadata[key].size), dtype=torch.uint8)
    dcp.load(state, checkpoint_id=str(checkpoint))

    with torch.no_grad():
        for name, param in params:
            param.copy_(layout.local(param, state[f"model/{name}"]))
    fp8 = {k[len("fp8/"):]: v if torch.is_tensor(v) else json.loads(v)
           for k, v in state.items() if k.startswith("fp8/")}
    model.load_state_dict(fp8, strict=False)
    if optimizer is not None:
        if with_optimizer:
            states = {name: {key: layout.local(param, state[f"optimizer/{name}/{key}"])
                             for key in OPTIMIZER_KEYS} for name, param in params}
            optimizer.load_checkpoint_state(states, int(state["optimizer/step"]))
        else:
            optimizer.reset_masters_from_params()
    if rng_keys:
        _set_rng_state({k[len(rng_prefix):]: state[k] for k in rng_keys})
    return json.loads(state["train"])
