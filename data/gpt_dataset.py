"""GPT pretraining samples from an indexed dataset: Megatron-LM's GPT dataset, same knobs.

A split (train / valid / test) owns a contiguous range of the indexed dataset's sequences
(one sequence per document after `tools/preprocess_data.py`). For `num_samples` samples of
`seq_length + 1` tokens it builds three index arrays, deterministic from the seed:

- document index: each epoch a fresh permutation of the split's documents, as many epochs as
  the samples need. Every epoch visits every document once.
- sample index: `(num_samples + 1, 2)` rows of (position in the document index, token offset).
  Sample i is the token stream from row i to row i + 1 plus one token, so consecutive samples
  overlap by exactly the one token that is the last label of one and the first input of the
  next, and the samples of an epoch cover each of its tokens once.
- shuffle index: the order in which the samples are served.

The arrays are cached as `.npy` next to the data (or in `cache_dir`) under a name that hashes
everything they depend on; one process per node builds them while the others wait, and later
runs load them. Given the vocabulary size, the builder first checks that every token id of the
`.bin` lies in it (the scan cached alongside). A build or check that fails on one rank (a full
disk, an unwritable cache folder, another tokenizer's data) stops every rank with its message,
not only the builder. Resuming is a matter of the consumed-samples count: sample k is the same
in every run, so a sampler that starts at k serves the same next batch (see `samplers.py`).
"""

import hashlib
import json
import math
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from megafp8.data.indexed_dataset import IndexedDataset, IndexedDatasetError

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split):
    """Megatron's `--split "969,30,1"` (or "98,2,0", or "1") as three fractions summing to 1."""
    try:
        parts = [float(part) for part in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(
            f"--split {split!r}: expected up to three comma-separated numbers, e.g. 969,30,1"
        ) from None
    if not 1 <= len(parts) <= 3 or not all(0 <= p < math.inf for p in parts) or sum(parts) <= 0:
        raise ValueError(
            f"--split {split!r}: expected up to three finite non-negative numbers with a positive sum"
        )
    parts = np.array(parts + [0.0] * (3 - len(parts)))
    # numpy's plain sum, as megatron-core normalises (Python >= 3.12's sum() rounds differently).
    return (parts / parts.sum()).tolist()


def split_ranges(num_documents, split):
    """[start, end) document ranges of train, valid and test, as megatron-core rounds them.

    The boundaries are the running sums of the normalised split weights, each scaled by the
    document count and rounded on its own (megatron-core's BlendedMegatronDatasetBuilder; older
    Megatron-LM rounded each split's size instead and could differ by a document).
    """
    bounds = [0.0]
    for fraction in parse_split(split):
        bounds.append(bounds[-1] + fraction)
    edges = [int(round(bound * float(num_documents))) for bound in bounds]
    return [(edges[i], edges[i + 1]) for i in range(3)]


def _epochs_needed(tokens_per_epoch, seq_length, num_samples):
    # num_samples samples of seq_length tokens plus the one extra label token at the end.
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_indices(sizes, documents, seq_length, num_samples, seed):
    """(document index, sample index, shuffle index) for `num_samples` samples; pure numpy."""
    documents = np.asarray(documents, dtype=np.int64)
    tokens_per_epoch = int(sizes[documents].sum())
    if tokens_per_epoch == 0:
        raise ValueError("the split's documents hold no tokens")
    num_epochs = _epochs_needed(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed)
    dtype = np.int32 if documents.max(initial=0) < 2**31 else np.int64
    document_index = np.concatenate([rng.permutation(documents) for _ in range(num_epochs)]).astype(
        dtype
    )

    # Where each document of the stream ends, in tokens; sample i starts at token i * seq_length.
    ends = np.cumsum(sizes[document_index], dtype=np.int64)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # The document holding a start token is the first whose end lies beyond it (empty ones skipped).
    position = np.searchsorted(ends, starts, side="right")
    # The last row only bounds the last sample; it may sit exactly at the stream's end.
    position[-1] = min(position[-1], len(document_index) - 1)
    offset = starts - (ends[position] - sizes[document_index[position]])
    sample_index = np.stack([position, offset], axis=1).astype(np.int64)

    shuffle_index = rng.permutation(num_samples).astype(np.int64)
    return document_index, sample_index, shuffle_index


def _is_index_builder():
    # One builder per node: right on shared and node-local file systems alike, and the write-then-
    # rename below makes two nodes writing the same shared file harmless.
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def check_token_ids(indexed, vocab_size, folder):
    """Refuse a dataset with token ids outside [0, vocab_size): ids past the vocabulary would train
    the padding rows of the embedding without a word, or past those fail the first step.

    The ids' range is cached in `folder` under the `.bin`'s path, size and modification time, so a
    large `.bin` is scanned once (a second or two per GB read from disk), not at every start.
    """
    bin_path = indexed.prefix + ".bin"
    stat = os.stat(bin_path)
    key = {
        "class": "TokenRange",
        "version": 1,
        "bin": os.path.abspath(bin_path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }
    cache = (
        folder
        / f"{hashlib.md5(json.dumps(key, sort_keys=True).encode()).hexdigest()}-token_range.json"
    )
    if cache.exists():
        token_range = json.loads(cache.read_text())["token_range"]
    else:
        token_range = indexed.token_range
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**key, "token_range": token_range}))
            os.replace(tmp, cache)
        except OSError as error:  # a read-only folder of index caches built elsewhere still trains
            warnings.warn(
                f"cannot cache the token range of {bin_path} in {folder} ({error}), so it is scanned "
                "again at every start; point --data-cache-path at a writable folder to keep it"
            )
    if token_range is None:  # no tokens
        return
    smallest, largest = token_range
    if largest >= vocab_size:
        raise IndexedDatasetError(
            f"{bin_path}: its largest token id is {largest}, past the vocabulary of {vocab_size} tokens (ids 0 "
            f"to {vocab_size - 1}): the data was made with another tokenizer. Re-tokenize it with this run's "
            "tokenizer (tools/preprocess_data.py), or give the run the tokenizer the data was made with"
        )
    if smallest < 0:
        raise IndexedDatasetError(
            f"{bin_path}: token id {smallest} is negative: a corrupt or foreign file; "
            "make the data again with tools/preprocess_data.py"
        )


class DatasetBuildError(RuntimeError):
    """Another rank failed to build a dataset index, so this one stops too (its message says why)."""


def _share_build_outcome(name, error):
    """Tell every rank how the index builds went; raise on all of them if any build failed.

    Stands where a barrier would: the waiting ranks learn of a builder's failure (a full disk,
    an unwritable cache) at once, instead of waiting for it until the collective times out.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        if error is not None:
            raise error
        return
    outcomes = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(outcomes, None if error is None else str(error))
    failed = [(rank, message) for rank, message in enumerate(outcomes) if message is not None]
    if error is not None:
        raise error  # the builder's own error, with its traceback
    if failed:
        rank, message = failed[0]
        raise DatasetBuildError(
            f"rank {rank} failed to build the {name} dataset index, so this rank "
            f"stops too: {message}"
        )


class GPTDataset(torch.utils.data.Dataset):
    """`len()` samples of `seq_length + 1` tokens (int64) drawn from `documents` of `indexed`;
    with `vocab_size`, only if every token id of `indexed` lies in [0, vocab_size)."""

    def __init__(
        self,
        indexed,
        documents,
        seq_length,
        num_samples,
        seed,
        name="train",
        cache_dir=None,
        vocab_size=None,
    ):
        if seq_length < 1 or num_samples < 1:
            raise ValueError(
                f"seq_length and num_samples must be positive, got {seq_length}, {num_samples}"
            )
        if not isinstance(indexed, IndexedDataset):
            indexed = IndexedDataset(indexed)
        documents = np.asarray(documents, dtype=np.int64)
        if len(documents) == 0:
            raise ValueError(
                f"{indexed.prefix}: the {name} split has no documents; "
                "give it a share in --split or ask for no samples from it"
            )
        self.indexed, self.seq_length, self.num_samples = indexed, seq_length, num_samples
        self.name = name
        description = {
            "class": "GPTDataset",
            "version": 1,
            "dataset": os.path.abspath(indexed.prefix),
            "num_sequences": len(indexed),
            "num_tokens": indexed.num_tokens,
            "name": name,
            "documents": [int(documents[0]), int(documents[-1]), len(documents)],
            "seq_length": seq_length,
            "num_samples": num_samples,
            "seed": seed,
        }
        digest = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
        folder = Path(cache_dir) if cache_dir else Path(indexed.prefix).parent / "index_cache"
        self.cache_files = {
            kind: folder / f"{digest}-{name}-{kind}_index.npy"
            for kind in ("document", "sample", "shuffle")
        }
        arrays = self._load_or_build(folder, description, documents, seed, vocab_size)
        self.document_index, self.sample_index, self.shuffle_index = arrays

    def _load_or_build(self, folder, description, documents, seed, vocab_size):
        error = None
        if _is_index_builder():
            try:
                if vocab_size is not None:
                    check_token_ids(self.indexed, vocab_size, folder)
                if not all(f.exists() for f in self.cache_files.values()):
                    self._build(folder, description, documents, seed)
            except Exception as failure:  # shared with the other ranks before it is raised
                error = failure
        _share_build_outcome(self.name, error)
        return tuple(
            np.load(path, mmap_mode="r", allow_pickle=False) for path in self.cache_files.values()
        )

    def _build(self, folder, description, documents, seed):
        arrays = build_indices(
            self.indexed.sizes, documents, self.seq_length, self.num_samples, seed
        )
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for (kind, path), array in zip(self.cache_files.items(), arrays):
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    np.save(f, array, allow_pickle=False)
                os.replace(tmp, path)
            with open(self.cache_files["document"].with_suffix(".json"), "w") as f:
                json.dump(description, f, indent=1)
        except OSError as error:
            raise OSError(
                f"cannot write the {self.name} index cache in {folder} ({error}); "
                "point --data-cache-path at a writable folder"
            ) from error

    def __len__(self):
        return self.num_samples

    def __getitem__(self, idx):
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        i = int(self.shuffle_index[idx])
        position, offset = (int(v) for v in self.sample_index[i])
        sizes, doc = self.indexed.sizes, self.document_index
        pieces, remaining = [], self.seq_length + 1
        while remaining:
            document = int(doc[position])
            take = min(int(sizes[document]) - offset, remaining)
            if take > 0:
                pieces.append(self.indexed.get(document, offset, take))
                remaining -= take
            position += 1
            offset = 0
        return {"tokens": np.concatenate(pieces).astype(np.int64)}
