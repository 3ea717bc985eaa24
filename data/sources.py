"""Streaming document readers: jsonl, SlimPajama's .jsonl.zst, parquet, folders, globs, HF datasets.

    stats = SourceStats(("text",))
    for doc in iter_documents(["corpus/chunk1", "extra.parquet"], ("text",), stats=stats):
        doc.texts["text"]      # the text, or None when missing or empty (counted in stats)
        doc.subset             # meta.redpajama_set_name, or None
        doc.where              # "file:line" (or "file row N", "dataset row N") for error messages

An input is, in order of precedence: an existing file, an existing folder (every supported file
under it, recursively, sorted), a glob (matches sorted), a folder written by `datasets`'
`save_to_disk`, or else a Hugging Face dataset name or local path for `datasets.load_dataset`
(`hf:` in front forces this for a path that exists). Files are read as streams — a `.zst` chunk
is never decompressed whole into memory, a parquet file goes batch by batch — so corpora larger
than memory work. The order is deterministic: inputs as given, files sorted within each.
A file named twice (say by a folder and a glob) is read once.

Missing keys and empty or whitespace-only texts are counted per key in `SourceStats` and come out
as None, never silently dropped; a malformed JSON line is a `SourceError` naming file and line.
"""

import glob
import io
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

JSON_EXTENSIONS = (".jsonl", ".json")
ZST_EXTENSIONS = (".jsonl.zst", ".json.zst")
PARQUET_EXTENSIONS = (".parquet",)
SUPPORTED_EXTENSIONS = JSON_EXTENSIONS + ZST_EXTENSIONS + PARQUET_EXTENSIONS
HF_PREFIX = "hf:"
_PARQUET_BATCH_ROWS = 1024  # bounds memory per read while keeping pyarrow's per-batch cost small


class SourceError(ValueError):
    """An input that cannot be read: nothing matched, a malformed line, an unloadable dataset."""


class Document(NamedTuple):
    texts: dict  # json key -> text, or None when the key is missing or its text is empty
    subset: object  # str or None: SlimPajama's meta.redpajama_set_name
    where: str


@dataclass
class SourceStats:
    """Counts kept while reading: documents, and per key the missing and empty texts."""

    json_keys: tuple
    documents: int = 0
    missing: Counter = field(default_factory=Counter)
    empty: Counter = field(default_factory=Counter)
    sources: list = field(default_factory=list)  # the files / datasets read, in order


@dataclass(frozen=True)
class Source:
    """One resolved input: a file of a supported kind, or a Hugging Face dataset."""

    kind: str  # "json", "zst", "parquet", "hf_disk" (save_to_disk folder) or "hf"
    path: str

    def __str__(self):
        return self.path


def _file_kind(path):
    name = path.lower()
    if name.endswith(ZST_EXTENSIONS):
        return "zst"
    if name.endswith(JSON_EXTENSIONS):
        return "json"
    if name.endswith(PARQUET_EXTENSIONS):
        return "parquet"
    return None


def _is_saved_hf_dataset(path):
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def _folder_files(folder):
    """Every supported file under `folder`, recursively, sorted by relative path."""
    files = [p for p in folder.rglob("*") if p.is_file() and _file_kind(p.name)]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _resolve_one(spec):
    if spec.startswith(HF_PREFIX):
        return [Source("hf", spec[len(HF_PREFIX) :])]
    path = Path(spec)
    if path.is_file():
        if not _file_kind(path.name):
            raise SourceError(
                f"{spec}: unsupported file type; expected one of {list(SUPPORTED_EXTENSIONS)}"
            )
        return [Source(_file_kind(path.name), str(path))]
    if path.is_dir():
        if _is_saved_hf_dataset(path):
            return [Source("hf_disk", str(path))]
        files = _folder_files(path)
        if not files:
            raise SourceError(f"{spec}: folder holds no {'/'.join(SUPPORTED_EXTENSIONS)} files")
        return [Source(_file_kind(p.name), str(p)) for p in files]
    if glob.has_magic(spec):
        sources = []
        for match in sorted(glob.glob(spec, recursive=True)):
            match_path = Path(match)
            if match_path.is_dir():
                sources += [Source(_file_kind(p.name), str(p)) for p in _folder_files(match_path)]
            elif _file_kind(match):
                sources.append(Source(_file_kind(match), match))
        if not sources:
            raise SourceError(
                f"{spec}: no {'/'.join(SUPPORTED_EXTENSIONS)} files matched the pattern"
            )
        return sources
    if _file_kind(spec) or spec.startswith((".", "/", "~")):
        # Looks like a path, not a dataset name: say so rather than ask the Hub for it.
        raise SourceError(f"{spec}: no such file or folder")
    return [Source("hf", spec)]


def resolve_inputs(inputs):
    """The sources behind `inputs` (paths, folders, globs, dataset names), in reading order.

    Raises SourceError for an input that matches nothing, so a tool can fail before it starts.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    inputs = [str(spec) for spec in inputs]
    if not inputs:
        raise SourceError("no inputs given")
    sources, seen = [], set()
    for spec in inputs:
        for source in _resolve_one(spec):
            key = (
                source.kind,
                os.path.realpath(source.path) if source.kind != "hf" else source.path,
            )
            if key not in seen:
                seen.add(key)
                sources.append(source)
    return sources


def subset_name(record):
    """SlimPajama's `meta.redpajama_set_name`; meta may be a dict or a JSON string. None if absent."""
    meta = record.get("meta")
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError:
            return None
    if isinstance(meta, dict):
        name = meta.get("redpajama_set_name")
        return None if name is None else str(name)
    return None


def _json_lines(lines, path):
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise SourceError(
                f"{path}:{lineno}: malformed JSON ({error}); expected one JSON object per line"
            ) from None
        if not isinstance(record, dict):
            raise SourceError(
                f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}"
            )
        yield record, f"{path}:{lineno}"


def _read_json(path):
    with open(path, encoding="utf-8") as f:
        try:
            yield from _json_lines(f, path)
        except UnicodeDecodeError as error:
            raise SourceError(f"{path}: not UTF-8 text ({error})") from None


def _read_zst(path):
    import zstandard

    with open(path, "rb") as raw:
        # read_across_frames: a chunk may hold several zstd frames (e.g. concatenated files).
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        try:
            yield from _json_lines(io.TextIOWrapper(reader, encoding="utf-8"), path)
        except zstandard.ZstdError as error:
            raise SourceError(f"{path}: corrupt zstd stream ({error})") from None
        except UnicodeDecodeError as error:
            raise SourceError(f"{path}: not UTF-8 text ({error})") from None


def _read_parquet(path, json_keys):
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    # Only the columns needed: a wide table's other columns are never decoded.
    columns = [name for name in (*json_keys, "meta") if name in parquet.schema_arrow.names]
    row = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns):
        for record in batch.to_pylist():
            yield record, f"{path} row {row}"
            row += 1


def _read_hf(source, split, config):
    try:
        import datasets
    except ImportError:
        raise SourceError(
            f"{source.path!r} is not an existing file, folder or glob match, and "
            "reading it as a Hugging Face dataset needs the datasets package: "
            "pip install datasets"
        ) from None
    if source.kind == "hf_disk":
        dataset = datasets.load_from_disk(source.path)  # memory-mapped Arrow, not read into memory
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise SourceError(f"{source.path}: no split {split!r}; it has {list(dataset)}")
            dataset = dataset[split]
    else:
        try:
            dataset = datasets.load_dataset(source.path, config, split=split, streaming=True)
        except Exception as error:  # datasets raises many kinds (hub, network, files, splits)
            raise SourceError(
                f"{source.path!r} is not an existing file, folder or glob match, and Hugging Face "
                f"datasets could not load it (split {split!r}): {type(error).__name__}: {error}"
            ) from None
    for row, record in enumerate(dataset):
        yield record, f"{source.path} row {row}"


def _records(source, json_keys, hf_split, hf_config):
    if source.kind == "json":
        return _read_json(source.path)
    if source.kind == "zst":
        return _read_zst(source.path)
    if source.kind == "parquet":
        return _read_parquet(source.path, json_keys)
    return _read_hf(source, hf_split, hf_config)


def iter_documents(inputs, json_keys=("text",), stats=None, hf_split="train", hf_config=None):
    """Yield a `Document` per record of `inputs` (see the module docstring), in a fixed order.

    `stats` (a SourceStats) is updated as documents are read; pass one to see the counts.
    `hf_split` / `hf_config` apply to Hugging Face datasets only.
    """
    json_keys = tuple(json_keys)
    if not json_keys:
        raise ValueError("json_keys is empty: name at least one key, e.g. ('text',)")
    sources = resolve_inputs(inputs)
    if stats is None:
        stats = SourceStats(json_keys)
    for source in sources:
        stats.sources.append(str(source))
        for record, where in _records(source, json_keys, hf_split, hf_config):
            texts = {}
            for key in json_keys:
                text = record.get(key)
                if text is None:
                    stats.missing[key] += 1
                elif not isinstance(text, str):
                    raise SourceError(f"{where}: {key!r} is a {type(text).__name__}, not a string")
                elif not text.strip():
                    stats.empty[key] += 1
                    text = None
                texts[key] = text
            stats.documents += 1
            yield Document(texts, subset_name(record), where)
