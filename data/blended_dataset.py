"""Weighted blends of datasets and Megatron-LM's `--data-path W1 PREFIX1 W2 PREFIX2 ...` syntax.

The blend serves sample i from the dataset that lags its weight the most: dataset d's k-th
sample is due when the blend reaches (k + 1) / w_d samples, and the blend takes the samples in
order of that due time. After any n samples each dataset has served within one sample of
n * w_d, so realised proportions match the weights to within 1/n.
"""

import math
import warnings

import numpy as np
import torch
from megafp8.data.gpt_dataset import SPLIT_NAMES, GPTDataset, split_ranges
from megafp8.data.indexed_dataset import IndexedDataset


def parse_data_path(data_path):
    """[(weight, prefix), ...] with weights summing to 1, from Megatron's --data-path list.

    Either `PREFIX` alone, pairs `W1 PREFIX1 W2 PREFIX2 ...`, or prefixes without weights (each
    then weighted by its number of tokens, i.e. the natural mixture).
    """
    items = [data_path] if isinstance(data_path, str) else list(data_path)
    if not items:
        raise ValueError("--data-path is empty: give PREFIX or W1 PREFIX1 W2 PREFIX2 ...")

    def number(text):
        try:
            return float(text)
        except ValueError:
            return None

    weights = [number(item) for item in items[0::2]]
    if len(items) % 2 == 0 and all(w is not None for w in weights):
        prefixes = items[1::2]
        if any(number(p) is not None for p in prefixes):
            raise ValueError(
                f"--data-path {' '.join(items)}: expected W1 PREFIX1 W2 PREFIX2 ..., "
                "but a prefix position holds a number"
            )
        bad = [text for text, w in zip(items[0::2], weights) if not 0 <= w < math.inf]
        if bad:
            raise ValueError(
                f"--data-path weight {bad[0]} is not a finite non-negative number: give "
                "W1 PREFIX1 W2 PREFIX2 ... with weights such as 0.3"
            )
        if not 0 < sum(weights) < math.inf:
            raise ValueError(f"--data-path weights {weights} must have a positive, finite sum")
    elif all(number(item) is None for item in items):
        prefixes = items
        weights = (
            [1.0]
            if len(prefixes) == 1
            else [float(IndexedDataset(prefix).num_tokens) for prefix in prefixes]
        )
    else:
        raise ValueError(
            f"--data-path {' '.join(items)}: mix of weights and prefixes; give PREFIX, "
            "or W1 PREFIX1 W2 PREFIX2 ... with a weight before every prefix"
        )
    total = sum(weights)
    return [(w / total, prefix) for w, prefix in zip(weights, prefixes)]


def blend_indices(weights, size):
    """(dataset index, sample index within that dataset) for `size` blended samples."""
    weights = np.asarray(weights, dtype=np.float64)
    due, dataset, within = [], [], []
    for d, w in enumerate(weights):
        if w <= 0:
            continue
        count = int(np.ceil(w * size)) + 1
        k = np.arange(count, dtype=np.int64)
        due.append((k + 1) / w)
        dataset.append(np.full(count, d, dtype=np.int16 if len(weights) < 2**15 else np.int32))
        within.append(k)
    # Stable sort: a tie goes to the dataset listed first.
    order = np.argsort(np.concatenate(due), kind="stable")[:size]
    return np.concatenate(dataset)[order], np.concatenate(within)[order]


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in the proportions `weights`."""

    def __init__(self, datasets, weights, size):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
        self.size = size
        self.dataset_index, self.dataset_sample_index = blend_indices(self.weights, size)
        for d, dataset in enumerate(self.datasets):
            needed = np.count_nonzero(self.dataset_index == d)
            if dataset is not None and needed > len(dataset):
                raise ValueError(
                    f"blended dataset {d} holds {len(dataset)} samples, {needed} needed"
                )

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} samples")
        return self.datasets[self.dataset_index[idx]][int(self.dataset_sample_index[idx])]


def build_datasets(
    data_path, split, seq_length, num_samples, seed, cache_dir=None, vocab_size=None
):
    """Train / valid / test datasets (None where no samples are asked) from `--data-path`.

    Each prefix is split by documents with `split`; with several prefixes, each split blends the
    prefixes' same split. A dataset is asked for its share of the samples plus 0.5% (at least
    one), so the blend never runs a component short. With `vocab_size`, a prefix holding a token
    id outside [0, vocab_size) is refused.
    """
    blend = parse_data_path(data_path)
    indexed = [IndexedDataset(prefix) for _, prefix in blend]
    ranges = [split_ranges(len(ds), split) for ds in indexed]
    result = []
    for s, (name, count) in enumerate(zip(SPLIT_NAMES, num_samples)):
        empty = [
            prefix
            for (_, prefix), split_range in zip(blend, ranges)
            if split_range[s][0] == split_range[s][1]
        ]
        if count and empty and name != "train":
            # Too few documents for a small share (e.g. the test 1 of 969,30,1): evaluate without it.
            warnings.warn(
                f"the {name} split of {', '.join(empty)} has no documents under --split {split}; "
                f"no {name} dataset"
            )
            count = 0
        result.append(
            _dataset(
                blend,
                indexed,
                [r[s] for r in ranges],
                name,
                count,
                seq_length,
                seed,
                cache_dir,
                vocab_size,
            )
            if count
            else None
        )
    return result


def build_split_datasets(
    data_paths, seq_length, num_samples, seed, cache_dir=None, vocab_size=None
):
    """Train / valid / test datasets from one data path each (Megatron's --train-data-path,
    --valid-data-path, --test-data-path): every document of a split's prefixes is in that split.
    None where a split has no path or is asked no samples; `vocab_size` as for `build_datasets`."""
    result = []
    for name, data_path, count in zip(SPLIT_NAMES, data_paths, num_samples):
        if not data_path or not count:
            result.append(None)
            continue
        blend = parse_data_path(data_path)
        indexed = [IndexedDataset(prefix) for _, prefix in blend]
        result.append(
            _dataset(
                blend,
                indexed,
                [(0, len(ds)) for ds in indexed],
                name,
                count,
                seq_length,
                seed,
                cache_dir,
                vocab_size,
            )
        )
    return result


def _dataset(blend, indexed, document_ranges, name, count, seq_length, seed, cache_dir, vocab_size):
    """The `name` split's dataset of `count` samples: one prefix's documents in its range, or a
    blend of each prefix's."""
    if len(blend) == 1:
        start, end = document_ranges[0]
        return GPTDataset(
            indexed[0], np.arange(start, end), seq_length, count, seed, name, cache_dir, vocab_size
        )
    components, weights = [], []
    for (weight, _), ds, (start, end) in zip(blend, indexed, document_ranges):
        if weight == 0:
            continue
        share = int(np.ceil(weight * count * 1.005)) + 1
        components.append(
            GPTDataset(
                ds, np.arange(start, end), seq_length, share, seed, name, cache_dir, vocab_size
            )
        )
        weights.append(weight)
    return BlendedDataset(components, weights, count)
