"""Convert models between megafp8 checkpoints and Hugging Face `transformers` folders.

    # megafp8 -> HF: a checkpoint of any tp / pp / dp layout and FP8 recipe (FP8 state dropped)
    python tools/convert_checkpoint.py --direction to-hf --load ckpt --output hf_model [--dtype bf16]

    # HF -> megafp8: a local GPT-2 or Llama folder, to continue with --load ... --finetune
    python tools/convert_checkpoint.py --direction from-hf --hf-dir hf_model --save ckpt_ft \\
        --tensor-model-parallel-size 2

GPT models (LayerNorm, learned positions, GELU, biases) become GPT2LMHeadModel, Llama models
(RMSNorm, RoPE, SwiGLU) LlamaForCausalLM. megafp8 stores its tensors layout-free (full shapes,
vocabulary without padding rows), so both directions read and write whole tensors, one layer at
a time: memory stays about one copy of the weights. The model's config travels in megafp8.json
("model"); the config and weight mappings are models/hf_mapping.py;
docs/checkpoints.md has the details. Needs `transformers` and `safetensors`.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import shlex
import shutil
import sys
import warnings
from pathlib import Path

import torch
from megafp8.data.tokenizers import build_tokenizer
from megafp8.models.config import TransformerConfig
from megafp8.models.hf_mapping import (
    HF_BUFFERS,
    HF_EMBEDDING,
    HF_LAYER,
    SUPPORTED,
    HFMappingError,
    config_from_hf,
    from_hf_gpt2,
    from_hf_llama,
    hf_architecture,
    hf_config,
    to_hf_gpt2,
    to_hf_llama,
)
from megafp8.models.transformer import TransformerLM
from tqdm import tqdm

from megafp8.messages import show_warnings_as_messages
from megafp8.training import arguments, checkpointing

TO_HF = {"gpt2": to_hf_gpt2, "llama": to_hf_llama}
FROM_HF = {"gpt2": from_hf_gpt2, "llama": from_hf_llama}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TRAIN_STATE = {"iteration": 0, "consumed_samples": 0, "skipped_steps": 0}


class ConversionError(RuntimeError):
    """The input cannot be converted; the message says what is wrong and where."""


def _transformers():
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        raise ConversionError(
            f"conversion needs transformers and safetensors ({error}): "
            "pip install transformers safetensors"
        ) from None
    return transformers


def _one_line(error) -> str:
    """Another library's error message on one line (ours are one line each)."""
    return " ".join(str(error).split())


def _listed(names, count=5) -> str:
    return ", ".join(names[:count]) + (
        f" and {len(names) - count} more" if len(names) > count else ""
    )


def _json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConversionError(f"{path}: not a readable JSON file ({_one_line(error)})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: holds JSON but not an object of settings")
    return data


def parse_size(text) -> int:
    """'5GB' (10^9), '500MiB' (2^20), '10KB' or a plain number of bytes, as Hugging Face reads them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise ConversionError(
            f"--max-shard-size {text!r}: give bytes or a size such as 5GB, 500MB, 2GiB"
        )
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    if unit == "B":
        return int(number)
    power = "KMGT".index(unit[0]) + 1
    return int(number * ((1024 if "I" in unit else 1000) ** power))


# ---- the stored layout of a model ----------------------------------------------------------------


def stored_layout(config: TransformerConfig) -> dict:
    """name -> (parameter, stored shape) for every parameter, as checkpointing stores them at any
    layout: vocabulary tensors without padding rows, stacked matrices (SwiGLU) as [stack, ...]."""
    model = TransformerLM(config, device="meta")
    return {
        name: (param, checkpointing.stored_shape(param)) for name, param in model.named_parameters()
    }


def parts(layout: dict) -> list:
    """The parameter names grouped as the converters go: the ends, then layer by layer."""
    groups = {}
    for name in layout:
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name.split(".")[0]
        groups.setdefault(key, []).append(name)
    return list(groups.values())


# ---- megafp8 -> Hugging Face ---------------------------------------------------------------------


def _find_checkpoint(load) -> Path:
    load = Path(load)
    if not load.exists():
        raise ConversionError(f"--load {load}: no such folder")
    try:
        path = checkpointing.latest_checkpoint(load)
    except checkpointing.CheckpointError as error:
        raise ConversionError(f"incomplete megafp8 checkpoint: {error}") from None
    if path is None:
        leftovers = sorted(p.name for p in load.glob("iter_*.tmp"))
        raise ConversionError(
            f"{load} is no megafp8 checkpoint: it has no {checkpointing.LATEST} and no .metadata"
            + (f" (only {', '.join(leftovers)}: saves that never finished)" if leftovers else "")
        )
    return path


def _check_files(path: Path, metadata, keys) -> None:
    """Every data file the metadata names for `keys` must be there (one per saving rank)."""
    needed = {
        info.relative_path for index, info in metadata.storage_data.items() if index.fqn in keys
    }
    missing = sorted(name for name in needed if not (path / name).is_file())
    if missing:
        raise ConversionError(
            f"incomplete megafp8 checkpoint {path}: its .metadata names "
            f"{', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} missing"
        )


def _tokenizer_in(folder) -> tuple | None:
    """(tokenizer type, {build_tokenizer argument: path}) of the tokenizer files in `folder`, or None."""
    for kind, names in checkpointing.TOKENIZER_FILES.items():
        paths = {key: Path(folder) / name for key, name in names.items()}
        if all(path.is_file() for path in paths.values()):
            return kind, paths
    return None


def _tokenizer_source(args, tokenizer_dir, checkpoint: Path) -> tuple:
    """The tokenizer to put into the Hugging Face folder: --tokenizer-dir's, else the copy the run
    keeps in its --save folder, else the files the run recorded. ConversionError if none is there."""
    if tokenizer_dir is not None:
        found = _tokenizer_in(tokenizer_dir)
        if found is None:
            raise ConversionError(
                f"--tokenizer-dir {tokenizer_dir}: no tokenizer.json, tokenizer.model or "
                "vocab.json + merges.txt there"
            )
        return found
    copy = checkpoint.parent / checkpointing.TOKENIZER_DIR
    found = _tokenizer_in(copy)
    if found is not None:
        return found
    kind = getattr(args, "tokenizer_type", None)
    recorded = {
        key: getattr(args, key, None) for key in checkpointing.TOKENIZER_FILES.get(kind, {})
    }
    paths = {key: Path(value) if value else None for key, value in recorded.items()}
    if (
        kind == "HuggingFaceTokenizer"
        and paths["tokenizer_model"]
        and paths["tokenizer_model"].is_dir()
    ):
        paths["tokenizer_model"] = paths["tokenizer_model"] / "tokenizer.json"  # the folder form
    missing = [
        f"{value or key}" for key, value in paths.items() if value is None or not value.is_file()
    ]
    if recorded and not missing:
        return kind, paths
    why = (
        f"the run used {'no tokenizer' if kind is None else kind}"
        if not recorded
        else f"{copy} holds no copy (saved before megafp8 kept one) and the run's {kind} files are gone "
        f"({', '.join(missing)})"
    )
    raise ConversionError(
        f"no tokenizer for the Hugging Face folder: {why}. Give --tokenizer-dir DIR (a folder "
        "with tokenizer.json, tokenizer.model, or vocab.json + merges.txt), or --no-tokenizer "
        "to write the model without one"
    )


def export_tokenizer(kind, paths: dict, output: Path, config: TransformerConfig, eod_token=None):
    """Write the tokenizer (`_tokenizer_source`'s) into `output` so AutoTokenizer loads it;
    returns (bos id, eos id)."""
    transformers = _transformers()
    ours = build_tokenizer(kind, **paths, eod_token=eod_token)
    if ours.vocab_size != config.vocab_size:
        warnings.warn(
            f"the tokenizer has {ours.vocab_size} tokens but the model {config.vocab_size}",
            stacklevel=2,
        )
    if kind == "SentencePieceTokenizer":
        sp = ours.backend
        named = {
            role: sp.id_to_piece(i)
            for role, i in (("bos_token", sp.bos_id()), ("unk_token", sp.unk_id()))
            if i >= 0
        }
        hf = transformers.SentencePieceBackend(
            vocab_file=str(paths["tokenizer_model"]), eos_token=sp.id_to_piece(ours.eod), **named
        )
        bos = sp.bos_id() if sp.bos_id() >= 0 else ours.eod
    else:
        raw = ours.backend
        eos = raw.id_to_token(ours.eod)
        bos_token = next(
            (t for t in ("<|begin_of_text|>", "<s>", "<bos>") if raw.token_to_id(t) is not None),
            eos,
        )
        hf = transformers.PreTrainedTokenizerFast(
            tokenizer_object=raw, eos_token=eos, bos_token=bos_token
        )
        bos = raw.token_to_id(bos_token)
    hf.model_max_length = config.max_position_embeddings
    hf.save_pretrained(str(output))
    # The run's own files, byte for byte (save_pretrained re-serialises tokenizer.json).
    for key, name in checkpointing.TOKENIZER_FILES[kind].items():
        shutil.copyfile(paths[key], output / name)
    return bos, ours.eod


def _plan_shards(groups, layout, arch, config, dtype, max_bytes):
    """(hf name, bytes) per group, converted on the meta device, and the shard of every name."""
    planned, shard_of, current, sizes = [], {}, 0, [0]
    for names in groups:
        meta = {
            n: torch.empty(
                layout[n][1] if hasattr(layout[n][0], "unpadded_rows") else layout[n][0].shape,
                dtype=dtype,
                device="meta",
            )
            for n in names
        }
        entries = [
            (name, t.numel() * t.element_size()) for name, t in TO_HF[arch](meta, config).items()
        ]
        planned.append(entries)
        for name, size in entries:
            if sizes[current] and sizes[current] + size > max_bytes:
                current += 1
                sizes.append(0)
            sizes[current] += size
            shard_of[name] = current
    return planned, shard_of, len(sizes), sum(sizes)


def to_hf(
    load,
    output,
    dtype: str | None = None,
    tokenizer_dir=None,
    max_shard_size="5GB",
    progress: bool = True,
    no_tokenizer: bool = False,
) -> Path:
    """Write the megafp8 checkpoint `load` (a --save folder or one iter_N folder) as a Hugging
    Face model folder `output`, with the run's tokenizer (or `tokenizer_dir`'s; none only with
    `no_tokenizer`); returns `output`."""
    transformers = _transformers()
    from safetensors.torch import save_file

    max_bytes = parse_size(max_shard_size)
    path = _find_checkpoint(load)
    if not (path / "megafp8.json").is_file():
        raise ConversionError(
            f"incomplete megafp8 checkpoint {path}: no megafp8.json (it records the model "
            "and the run's tokenizer)"
        )
    try:
        info = checkpointing.checkpoint_info(path)
        config = checkpointing.saved_model_config(path)
    except checkpointing.CheckpointError as error:
        raise ConversionError(str(error)) from None
    args = arguments.args_from_dict(info.get("args") or {})
    reader = checkpointing.CheckpointReader(str(path))
    metadata = reader.read_metadata()
    stored = metadata.state_dict_metadata
    if "model/embedding.weight" not in stored:
        raise ConversionError(f"incomplete megafp8 checkpoint {path}: no model/embedding.weight")
    try:
        arch = hf_architecture(config)
    except HFMappingError as error:
        raise ConversionError(str(error)) from None
    layout = stored_layout(config)
    for name, (_, shape) in layout.items():
        key = f"model/{name}"
        if key not in stored:
            raise ConversionError(
                f"megafp8 checkpoint {path} has no {key}, which megafp8.json's model "
                f"({config.num_layers} layers) has: incomplete, or saved from another model"
            )
        if tuple(stored[key].size) != shape:
            raise ConversionError(
                f"{key} is {list(stored[key].size)} in {path} but megafp8.json's model "
                f"needs {list(shape)}: the recorded model and the weights disagree"
            )
    params_dtype = stored["model/final_norm.weight"].properties.dtype
    out_dtype = DTYPES[dtype] if dtype else params_dtype
    if out_dtype not in DTYPES.values():
        raise ConversionError(
            f"the checkpoint's weights are {params_dtype}; give --dtype bf16 or fp32"
        )
    # A bf16 run keeps fp32 masters of its weights: an fp32 export takes those, not the rounded params.
    masters = (
        out_dtype == torch.float32
        and params_dtype != torch.float32
        and all(f"optimizer/{n}/master" in stored for n in layout)
    )
    source = {n: f"optimizer/{n}/master" if masters else f"model/{n}" for n in layout}
    _check_files(path, metadata, set(source.values()))

    output = Path(output)
    if output.exists() and (any(output.glob("*.safetensors")) or (output / "config.json").exists()):
        raise ConversionError(
            f"--output {output} already holds a model; give a new or empty folder"
        )
    # before any writing
    tokenizer = None if no_tokenizer else _tokenizer_source(args, tokenizer_dir, path)
    output.mkdir(parents=True, exist_ok=True)
    bos, eos = (
        export_tokenizer(*tokenizer, output, config, getattr(args, "eod_token", None))
        if tokenizer
        else (None, None)
    )
    hf = hf_config(config, arch, out_dtype, bos=bos, eos=eos)
    hf.save_pretrained(str(output))
    transformers.GenerationConfig.from_model_config(hf).save_pretrained(str(output))

    groups = parts(layout)
    planned, shard_of, n_shards, total = _plan_shards(
        groups, layout, arch, config, out_dtype, max_bytes
    )
    names = (
        ["model.safetensors"]
        if n_shards == 1
        else [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    )
    pending, remaining = {}, [0] * n_shards
    for entries in planned:
        for name, _ in entries:
            remaining[shard_of[name]] += 1
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"to {SUPPORTED[arch]}",
        file=sys.stderr,
        disable=not progress,
    ) as bar:
        for group in groups:
            state = {
                n: torch.empty(
                    tuple(stored[source[n]].size), dtype=stored[source[n]].properties.dtype
                )
                for n in group
            }
            checkpointing.read_state({source[n]: t for n, t in state.items()}, reader)
            ours = {
                n: t if hasattr(layout[n][0], "unpadded_rows") else t.reshape(layout[n][0].shape)
                for n, t in state.items()
            }
            del state
            for name, tensor in TO_HF[arch](ours, config).items():
                shard = shard_of[name]
                pending.setdefault(shard, {})[name] = tensor.to(out_dtype).contiguous()
                remaining[shard] -= 1
                bar.update(tensor.numel() * out_dtype.itemsize)
                if remaining[shard] == 0:
                    save_file(
                        pending.pop(shard), str(output / names[shard]), metadata={"format": "pt"}
                    )
            del ours
    if n_shards > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: names[shard] for name, shard in sorted(shard_of.items())},
        }
        (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return output


def load_hint(output: Path, tokenizer: bool = True) -> str:
    """What to-hf says when done: where the model is and how transformers loads it."""
    folder = json.dumps(str(output))
    lines = [
        f"wrote {output}",
        "load it with transformers:",
        "  from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"  model = AutoModelForCausalLM.from_pretrained({folder})",
    ]
    lines.append(
        f"  tokenizer = AutoTokenizer.from_pretrained({folder})"
        if tokenizer
        else "  (no tokenizer in it: use the one the run trained with)"
    )
    return "\n".join(lines)


# ---- Hugging Face -> megafp8 ---------------------------------------------------------------------


class HFWeights:
    """A Hugging Face folder's weights by name, read one tensor at a time (safetensors or
    pytorch_model.bin, whole or sharded with an index)."""

    def __init__(self, folder: Path):
        self.folder = folder
        for index_name, single in (
            ("model.safetensors.index.json", "model.safetensors"),
            ("pytorch_model.bin.index.json", "pytorch_model.bin"),
        ):
            if (folder / index_name).is_file():
                weight_map = _json_object(folder / index_name).get("weight_map")
                if not isinstance(weight_map, dict) or not all(
                    isinstance(f, str) for f in weight_map.values()
                ):
                    raise ConversionError(
                        f'{folder / index_name}: no "weight_map" of tensor names to file names'
                    )
                # Checked on the names, not the resolved paths: the hub's cache links its files to ../../blobs.
                outside = sorted(
                    {
                        f
                        for f in weight_map.values()
                        if Path(f).is_absolute() or ".." in Path(f).parts
                    }
                )
                if outside:
                    raise ConversionError(
                        f"{folder / index_name} names {', '.join(outside)}, outside {folder}: "
                        "an index may only name files in its own folder"
                    )
                missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
                if missing:
                    raise ConversionError(
                        f"{folder / index_name} lists {', '.join(missing)}, "
                        f"which {'is' if len(missing) == 1 else 'are'} not in {folder}: "
                        "the download is incomplete"
                    )
                break
            if (folder / single).is_file():
                weight_map = None
                break
        else:
            raise ConversionError(
                f"{folder} has no weights (model.safetensors, pytorch_model.bin, or their "
                ".index.json)"
            )
        self.safetensors = index_name.startswith("model.safetensors")
        files = sorted(set(weight_map.values())) if weight_map else [single]
        self._open, self.file_of, self.shapes, self.dtypes = {}, {}, {}, {}
        for file in files:
            handle = self._handle(file)
            for name in handle.keys() if self.safetensors else handle:
                if weight_map is None or weight_map.get(name) == file:
                    self.file_of[name] = file
                    if self.safetensors:
                        piece = handle.get_slice(name)
                        self.shapes[name], self.dtypes[name] = (
                            tuple(piece.get_shape()),
                            piece.get_dtype(),
                        )
                    else:
                        self.shapes[name], self.dtypes[name] = (
                            tuple(handle[name].shape),
                            str(handle[name].dtype),
                        )
        # Old GPT-2 files name the base model's weights without the "transformer." prefix.
        self.stored_name = {n: n for n in self.file_of}
        if "wte.weight" in self.file_of and "transformer.wte.weight" not in self.file_of:
            self.stored_name = {
                (n if n.startswith("lm_head.") else f"transformer.{n}"): n for n in self.file_of
            }
        self.shapes = {name: self.shapes[stored] for name, stored in self.stored_name.items()}

    def _handle(self, file):
        if file not in self._open:
            path = str(self.folder / file)
            if self.safetensors:
                from safetensors import SafetensorError, safe_open

                try:
                    self._open[file] = safe_open(path, framework="pt")
                except (SafetensorError, OSError) as error:
                    raise ConversionError(
                        f"{path}: not a valid safetensors file, truncated or corrupt "
                        f"({_one_line(error)})"
                    ) from None
            else:
                try:
                    self._open[file] = torch.load(
                        path, map_location="cpu", mmap=True, weights_only=True
                    )
                except (RuntimeError, pickle.UnpicklingError, EOFError, OSError) as error:
                    raise ConversionError(
                        f"{path}: not a loadable PyTorch weights file ({_one_line(error)})"
                    ) from None
        return self._open[file]

    def __getitem__(self, name):
        stored = self.stored_name.get(name)
        if stored is None:
            raise ConversionError(f"the weights in {self.folder} have no {name}")
        handle = self._handle(self.file_of[stored])
        return handle.get_tensor(stored) if self.safetensors else handle[stored]

    def dtype(self):
        """The floating dtype most of the weights have."""
        kinds = [d for d in self.dtypes.values()]
        common = max(set(kinds), key=kinds.count)
        return {
            "BF16": torch.bfloat16,
            "F16": torch.float16,
            "F32": torch.float32,
            "torch.bfloat16": torch.bfloat16,
            "torch.float16": torch.float16,
            "torch.float32": torch.float32,
        }.get(common, torch.float32)


def _hf_tokenizer_args(folder: Path) -> dict:
    """Tokenizer flags for the HF folder's tokenizer files (absolute paths), or {} without any."""
    found = _tokenizer_in(folder)
    if found is None:
        return {}
    kind, paths = found
    return {"tokenizer_type": kind, **{key: str(path.resolve()) for key, path in paths.items()}}


def _check_hf_names(
    folder: Path, weights: HFWeights, expected: dict, model_type: str, config
) -> None:
    """The weights must be those of the model config.json describes (`expected`: HF name -> meta
    tensor), no fewer and no more: a tensor the conversion does not take would be lost."""
    for name, tensor in expected.items():
        if name in weights.shapes and weights.shapes[name] != tuple(tensor.shape):
            raise ConversionError(
                f"{folder}: config.json does not match the weights: {name} is "
                f"{list(weights.shapes[name])} in the weights, config.json implies "
                f"{list(tensor.shape)}"
            )
    cls, layers = SUPPORTED[model_type], config.num_layers
    described = f"config.json describes {layers} layer{'s' if layers != 1 else ''}"
    held = {int(m.group(1)) for n in weights.shapes if (m := HF_LAYER[model_type].fullmatch(n))}
    missing = [n for n in expected if n not in weights.shapes]
    if missing:
        gone = [str(i) for i in range(layers) if i not in held]
        what = (
            f"{described}, the weights lack layer(s) {', '.join(gone)}"
            if gone
            else f"the weights lack {len(missing)} tensor(s) of the {cls} config.json describes"
        )
        raise ConversionError(f"{folder}: {what}: {_listed(missing)}")
    # A tied output layer is the embedding; some exports store it anyway: a copy is not lost.
    tied_copy = config.tie_embeddings and "lm_head.weight" in weights.shapes
    if tied_copy and not torch.equal(weights["lm_head.weight"], weights[HF_EMBEDDING[model_type]]):
        raise ConversionError(
            f"{folder}: config.json ties the output layer to the embedding (tie_word_embeddings), "
            f"but the weights' lm_head.weight differs from {HF_EMBEDDING[model_type]}: "
            "converting would lose it"
        )
    extra = sorted(
        n
        for n in weights.shapes
        if n not in expected
        and not HF_BUFFERS[model_type].fullmatch(n)
        and not (tied_copy and n == "lm_head.weight")
    )
    if extra:
        beyond = sorted(i for i in held if i >= layers)
        what = (
            f"{described}, the weights hold layer(s) {', '.join(map(str, beyond))} too"
            if beyond
            else f"the weights are not a {cls} of config.json's shape: they hold {len(extra)} tensor(s) it has not"
        )
        raise ConversionError(f"{folder}: {what} ({_listed(extra)}): converting would lose them")


def from_hf(
    hf_dir,
    save,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    dtype: str | None = None,
    progress: bool = True,
) -> Path:
    """Write the Hugging Face GPT-2 / Llama folder `hf_dir` as a megafp8 checkpoint in `save`
    (iteration 0, weights only: --load it with --finetune); returns the iteration folder."""
    transformers = _transformers()
    folder, save = Path(hf_dir), Path(save)
    if not (folder / "config.json").is_file():
        raise ConversionError(f"--hf-dir {folder}: no config.json there")
    model_type = _json_object(folder / "config.json").get("model_type")
    if model_type not in SUPPORTED:
        raise ConversionError(
            f"{folder / 'config.json'}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())}"
        )
    config_class = transformers.GPT2Config if model_type == "gpt2" else transformers.LlamaConfig
    try:
        hf = config_class.from_pretrained(str(folder))
    # transformers' checks raise ValueError, KeyError, huggingface_hub's errors, ...
    except Exception as error:
        raise ConversionError(
            f"{folder / 'config.json'}: not a valid {config_class.__name__} ({_one_line(error)})"
        ) from None
    try:
        config = config_from_hf(hf)
    except HFMappingError as error:
        raise ConversionError(str(error)) from None
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    try:
        config.validate_tensor_parallel(tp)
    except ValueError as error:
        raise ConversionError(f"--tensor-model-parallel-size: {error}") from None
    if pp < 1 or config.num_layers % pp:
        raise ConversionError(
            f"--pipeline-model-parallel-size {pp} does not divide the {config.num_layers} layers"
        )
    if (save / checkpointing.LATEST).exists():
        raise ConversionError(
            f"--save {save} already holds a megafp8 checkpoint; give a new folder"
        )

    weights = HFWeights(folder)
    layout = stored_layout(config)
    # The shapes the config implies, named as the HF weights are: mapped from meta tensors.
    expected = TO_HF[model_type](
        {n: torch.empty(p.shape, device="meta") for n, (p, _) in layout.items()}, config
    )
    _check_hf_names(folder, weights, expected, model_type, config)
    source_dtype = weights.dtype()
    store_dtype = (
        DTYPES[dtype]
        if dtype
        else (torch.bfloat16 if source_dtype == torch.bfloat16 else torch.float32)
    )

    # The ends (embeddings, final norm, output layer), then layer by layer: the HF tensors of one
    # part at a time are in memory next to the converted ones (which DCP saves in one go).
    state = {}
    steps = [([], True)] + [([i], False) for i in range(config.num_layers)]
    for layers, ends in tqdm(
        steps,
        unit="part",
        desc=f"from {SUPPORTED[model_type]}",
        file=sys.stderr,
        disable=not progress,
    ):
        for name, tensor in FROM_HF[model_type](weights, config, layers=layers, ends=ends).items():
            param, shape = layout[name]
            tensor = (
                tensor[: param.unpadded_rows]
                if hasattr(param, "unpadded_rows")
                else tensor.reshape(shape)
            )
            # a copy: no view of a padded one
            state[f"model/{name}"] = tensor.to(store_dtype, copy=True)
    missing = [n for n in layout if f"model/{n}" not in state]
    if missing:  # a gap in models/hf_mapping.py, not in the user's folder
        raise ConversionError(
            f"megafp8 cannot convert this {SUPPORTED[model_type]} yet: its weight mapping "
            f"gives no {', '.join(missing[:3])}; please report it"
        )

    tokenizer = _hf_tokenizer_args(folder)
    if not tokenizer:
        warnings.warn(
            f"{folder} has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json + "
            "merges.txt): give the trainer your own --tokenizer-type and files",
            stacklevel=2,
        )
    else:
        vocab = build_tokenizer(
            tokenizer["tokenizer_type"],
            tokenizer.get("tokenizer_model"),
            tokenizer.get("vocab_file"),
            tokenizer.get("merge_file"),
        ).vocab_size
        if vocab != config.vocab_size:
            warnings.warn(
                f"{folder}'s tokenizer has {vocab} tokens but the model {config.vocab_size}: the trainer "
                "refuses to train a checkpoint with a tokenizer of another vocabulary size; give it one "
                f"of {config.vocab_size} tokens",
                stacklevel=2,
            )
    if tokenizer:  # the checkpoint folder carries its tokenizer, as a training run's does
        kind = tokenizer["tokenizer_type"]
        checkpointing.save_tokenizer(
            save, kind, [tokenizer[key] for key in checkpointing.TOKENIZER_FILES[kind]]
        )
    # megafp8.json records the model itself; the run's arguments only what a run needs beside it.
    bf16 = store_dtype == torch.bfloat16
    args = {
        **tokenizer,
        "bf16": bf16,
        "params_dtype": "bfloat16" if bf16 else "float32",
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
    }
    final = checkpointing.write_checkpoint(
        save, 0, state, train_state=TRAIN_STATE, args=args, model_config=config
    )
    checkpointing.wait_for_checksums()  # recorded before the tool exits (or its caller copies the folder)
    flags = ["--load", str(save), "--finetune"]
    for key, value in (tokenizer or {"tokenizer_type": "..."}).items():
        flags += ["--" + key.replace("_", "-"), value]
    flags += (
        (["--bf16"] if bf16 else [])
        + (["--tensor-model-parallel-size", str(tp)] if tp > 1 else [])
        + (["--pipeline-model-parallel-size", str(pp)] if pp > 1 else [])
    )
    print(
        f"wrote {final}\ncontinue training with:\n  megafp8-train {shlex.join(flags)} "
        "(and your data, batch and learning-rate flags)",
        file=sys.stderr,
    )
    return final


# ---- command line ---------------------------------------------------------------------------------


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--direction", required=True, choices=("to-hf", "from-hf"))
    g = p.add_argument_group("to-hf")
    g.add_argument(
        "--load", help="a megafp8 --save folder (its latest checkpoint) or one iter_N folder"
    )
    g.add_argument("--output", help="the Hugging Face folder to write")
    g.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        help="weights' dtype (to-hf default: the checkpoint's; "
        "fp32 from a --bf16 run takes the fp32 master weights. from-hf default: bf16 weights stay "
        "bf16, others become fp32)",
    )
    g.add_argument(
        "--tokenizer-dir",
        help="take the tokenizer from this folder instead of the run's (which "
        "its --save folder keeps a copy of)",
    )
    g.add_argument(
        "--no-tokenizer", action="store_true", help="write the model without a tokenizer"
    )
    g.add_argument(
        "--max-shard-size", default="5GB", help="larger models are split into shards with an index"
    )
    g = p.add_argument_group("from-hf")
    g.add_argument(
        "--hf-dir", help="a local GPT-2 or Llama folder (config.json + safetensors or .bin)"
    )
    g.add_argument("--save", help="the megafp8 checkpoint folder to write (a new one)")
    g.add_argument(
        "--tensor-model-parallel-size", type=int, default=1, help="checked and recorded; any loads"
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="checked and recorded; any loads",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None):
    show_warnings_as_messages("convert_checkpoint")
    parser = build_parser()
    args = parser.parse_args(argv)
    needed = ("load", "output") if args.direction == "to-hf" else ("hf_dir", "save")
    missing = [f"--{n.replace('_', '-')}" for n in needed if getattr(args, n) is None]
    if missing:
        parser.error(f"--direction {args.direction} needs {' and '.join(missing)}")
    try:
        if args.direction == "to-hf":
            if args.no_tokenizer and args.tokenizer_dir:
                parser.error("--no-tokenizer and --tokenizer-dir contradict each other; give one")
            out = to_hf(
                args.load,
                args.output,
                args.dtype,
                args.tokenizer_dir,
                args.max_shard_size,
                progress=not args.no_progress,
                no_tokenizer=args.no_tokenizer,
            )
            print(load_hint(out, tokenizer=not args.no_tokenizer), file=sys.stderr)
        else:
            from_hf(
                args.hf_dir,
                args.save,
                args.tensor_model_parallel_size,
                args.pipeline_model_parallel_size,
                args.dtype,
                progress=not args.no_progress,
            )
    except ConversionError as error:
        print(f"convert_checkpoint: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
