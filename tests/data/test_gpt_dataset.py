"""GPT dataset, blending and the sampler: coverage, determinism, caching, resume, proportions."""

import os
import re
import time

import numpy as np
import pytest
from megafp8.data import (
    BlendedDataset,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    PretrainingSampler,
    build_datasets,
    build_split_datasets,
    gpt_dataset,
    parse_data_path,
    split_ranges,
)
from megafp8.data.gpt_dataset import build_indices

from ..multiprocess import run_on_ranks


def unique_token_corpus(prefix, rng, n_docs=40, first_token=0):
    """Documents of random lengths (some empty) whose tokens are all distinct: token = position."""
    sizes = rng.integers(0, 60, size=n_docs)
    sizes[rng.integers(0, n_docs, size=3)] = 0
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        token = first_token
        for size in sizes:
            builder.add_item(np.arange(token, token + size))
            builder.end_document()
            token += size
    return IndexedDataset(prefix)


def unshuffled_samples(ds):
    order = np.argsort(np.asarray(ds.shuffle_index))
    return [ds[int(i)]["tokens"] for i in order]


def megatron_core_ranges(num_documents, weights):
    """megatron-core 0.16's rounding, written out: the running sums of the normalised weights
    (numpy's float64 sums), each times the document count, rounded."""
    weights = np.array(weights + [0.0] * (3 - len(weights)), dtype=np.float64)
    ends = np.concatenate([[0.0], np.cumsum(weights / np.sum(weights))])
    return [
        (int(round(float(a) * num_documents)), int(round(float(b) * num_documents)))
        for a, b in zip(ends[:-1], ends[1:])
    ]


def test_split_ranges_round_like_megatron_core():
    # Old Megatron-LM rounded each split's size and gave (0, 34), (34, 67), (67, 100) here.
    assert split_ranges(100, "1,1,1") == [(0, 33), (33, 67), (67, 100)]
    assert split_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(10, "1") == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges(7, "98,2,0") == [(0, 7), (7, 7), (7, 7)]
    splits = [
        "1,1,1",
        "969,30,1",
        "98,2,0",
        "1",
        "2,1",
        "1,2,3",
        "3,3,4",
        "99,1",
        "90,5,5",
        "1,0,1",
        "0,1,0",
        "0.7,0.2,0.1",
        "0.8,0.1,0.1",
        "949,50,1",
        "5,3,2",
        "1,1",
    ]
    sizes = list(range(0, 301)) + [997, 1001, 12345, 99999, 4_000_000, 31_415_927]
    for split in splits:
        weights = [float(w) for w in split.split(",")]
        for n in sizes:
            ranges = split_ranges(n, split)
            assert ranges == megatron_core_ranges(n, weights), (n, split)
            assert ranges[0][0] == 0 and ranges[2][1] == n  # contiguous and complete
            assert ranges[0][1] == ranges[1][0] and ranges[1][1] == ranges[2][0]
    for bad in ("a,b", "1,2,3,4", "-1,2", "0,0,0"):
        with pytest.raises(ValueError, match="--split"):
            split_ranges(10, bad)


def test_a_changed_split_range_never_reuses_a_cached_index(tmp_path, monkeypatch):
    """An index cached for the old rounding's (0, 34) is not taken for the new (0, 33)."""
    indexed = unique_token_corpus(str(tmp_path / "c"), np.random.default_rng(6), n_docs=100)
    old = GPTDataset(indexed, np.arange(0, 34), 8, 20, seed=1, cache_dir=tmp_path / "cache")
    built = []
    monkeypatch.setattr(
        gpt_dataset, "build_indices", lambda *args: built.append(args) or build_indices(*args)
    )
    new = GPTDataset(indexed, np.arange(0, 33), 8, 20, seed=1, cache_dir=tmp_path / "cache")
    assert len(built) == 1 and set(old.cache_files.values()).isdisjoint(new.cache_files.values())
    assert np.asarray(new.document_index).max() == 32


def test_samples_cover_every_token_once_per_epoch(tmp_path):
    rng = np.random.default_rng(0)
    indexed = unique_token_corpus(str(tmp_path / "c"), rng)
    documents = np.arange(5, 35)
    seq_length = 16
    tokens_per_epoch = int(indexed.sizes[documents].sum())
    num_samples = int(2.5 * tokens_per_epoch) // seq_length  # needs three epochs
    ds = GPTDataset(
        indexed, documents, seq_length, num_samples, seed=1234, cache_dir=tmp_path / "cache"
    )

    samples = unshuffled_samples(ds)
    assert all(len(s) == seq_length + 1 for s in samples)
    for a, b in zip(samples, samples[1:]):  # the extra token is the next sample's first
        assert a[-1] == b[0]
    stream = np.concatenate([s[:-1] for s in samples])
    epochs = np.asarray(ds.document_index).reshape(3, len(documents))
    for e in range(2):  # the two whole epochs: each a permutation of the documents
        assert sorted(epochs[e]) == list(documents)
        epoch_tokens = stream[e * tokens_per_epoch : (e + 1) * tokens_per_epoch]
        want = np.concatenate([indexed[d] for d in documents])
        np.testing.assert_array_equal(np.sort(epoch_tokens), np.sort(want))
        # ...in the order of that epoch's shuffled documents.
        np.testing.assert_array_equal(epoch_tokens, np.concatenate([indexed[d] for d in epochs[e]]))
    assert not np.array_equal(epochs[0], epochs[1])
    # The served order is a permutation of all samples.
    assert sorted(np.asarray(ds.shuffle_index)) == list(range(num_samples))


def test_deterministic_from_seed_and_cached(tmp_path, monkeypatch):
    indexed = unique_token_corpus(str(tmp_path / "c"), np.random.default_rng(1))
    args = (indexed, np.arange(40), 8, 100)
    a = GPTDataset(*args, seed=7, cache_dir=tmp_path / "cache")
    assert all(f.exists() for f in a.cache_files.values())

    def no_rebuild(*_):
        raise AssertionError("the cached index should have been loaded")

    monkeypatch.setattr(gpt_dataset, "build_indices", no_rebuild)
    b = GPTDataset(*args, seed=7, cache_dir=tmp_path / "cache")
    for x, y in zip(
        (a.document_index, a.sample_index, a.shuffle_index),
        (b.document_index, b.sample_index, b.shuffle_index),
    ):
        np.testing.assert_array_equal(x, y)
    monkeypatch.undo()
    c = GPTDataset(*args, seed=8, cache_dir=tmp_path / "cache")
    assert c.cache_files["shuffle"] != a.cache_files["shuffle"]
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)
    # Default cache location: next to the data.
    d = GPTDataset(*args, seed=7)
    assert d.cache_files["sample"].parent == tmp_path / "index_cache"


def build_on_two_ranks(rank, world_size, prefix, cache_dir):
    os.environ["LOCAL_RANK"] = str(rank)  # one node: rank 0 builds, rank 1 waits and loads
    ds = GPTDataset(prefix, np.arange(40), 8, 200, seed=3, cache_dir=cache_dir)
    return [np.asarray(ds[i]["tokens"]) for i in range(0, 200, 37)]


def test_one_rank_builds_the_others_wait(tmp_path):
    unique_token_corpus(str(tmp_path / "c"), np.random.default_rng(2))
    first, second = run_on_ranks(
        build_on_two_ranks, 2, str(tmp_path / "c"), str(tmp_path / "cache")
    )
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert not list((tmp_path / "cache").glob("*.tmp"))


def build_where_one_builder_fails(rank, world_size, prefix, nodes, cache_dirs):
    # the first rank of a node builds
    os.environ["LOCAL_RANK"] = str(nodes[:rank].count(nodes[rank]))
    start = time.monotonic()
    try:
        GPTDataset(prefix, np.arange(40), 8, 50, seed=3, cache_dir=cache_dirs[nodes[rank]])
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return None, "", time.monotonic() - start


@pytest.mark.parametrize(
    "nodes, failing_node",
    [
        ((0, 0), 0),  # one node: its builder, rank 0, fails while rank 1 waits
        ((0, 0, 1), 1),  # two nodes: node 1's builder, rank 2, fails; node 0's succeeded
    ],
)
def test_a_failed_index_build_stops_every_rank(tmp_path, nodes, failing_node):
    unique_token_corpus(str(tmp_path / "c"), np.random.default_rng(2))
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")  # a cache folder below a file cannot be created
    cache_dirs = [
        str(blocker / "cache") if node == failing_node else str(tmp_path / f"cache{node}")
        for node in range(max(nodes) + 1)
    ]
    outcomes = run_on_ranks(
        build_where_one_builder_fails,
        len(nodes),
        str(tmp_path / "c"),
        nodes,
        cache_dirs,
        timeout_s=120,
    )
    builder = nodes.index(failing_node)
    for rank, (kind, message, elapsed) in enumerate(outcomes):
        assert "--data-cache-path" in message, (rank, kind, message)
        assert elapsed < 60, (rank, elapsed)  # at once, not at a collective's timeout
        if rank == builder:
            assert kind == "OSError"
        else:
            assert kind == "DatasetBuildError" and message.startswith(
                f"rank {builder} failed to build the train"
            )


def test_unwritable_cache_and_empty_split_are_clear_errors(tmp_path):
    indexed = unique_token_corpus(str(tmp_path / "c"), np.random.default_rng(3))
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError, match="--data-cache-path"):
        GPTDataset(indexed, np.arange(40), 8, 10, seed=1, cache_dir=blocker / "cache")
    with pytest.raises(ValueError, match="train split has no documents"):
        build_datasets(str(tmp_path / "c"), "0,1,0", 8, (10, 5, 0), seed=1)
    # Evaluation splits too small to hold a document are left out, with a warning.
    with pytest.warns(UserWarning, match="valid split .* has no documents"):
        train, valid, test = build_datasets(str(tmp_path / "c"), "1,0,0", 8, (10, 5, 0), seed=1)
    assert len(train) == 10 and valid is None and test is None


def batches(dataset, total, consumed, micro_batch_size, dp_rank, dp_size, count):
    sampler = PretrainingSampler(total, consumed, micro_batch_size, dp_rank, dp_size)
    out = []
    for indices, _ in zip(sampler, range(count)):
        out.append(np.stack([dataset[i]["tokens"] for i in indices]))
    return out


def test_resume_from_consumed_samples_serves_the_same_next_batches(tmp_path):
    unique_token_corpus(str(tmp_path / "c"), np.random.default_rng(4))
    train, _, _ = build_datasets(str(tmp_path / "c"), "969,30,1", 8, (120, 0, 0), seed=5)
    for dp_rank in range(2):
        straight = batches(train, 120, 0, 3, dp_rank, 2, 10)
        resumed = batches(train, 120, 5 * 6, 3, dp_rank, 2, 5)  # 5 micro-batch steps of 3 x dp 2
        for a, b in zip(straight[5:], resumed):
            np.testing.assert_array_equal(a, b)
    # The dp ranks split each group of micro-batches without overlap.
    seen = [i for r in range(2) for batch in PretrainingSampler(120, 0, 3, r, 2) for i in batch]
    assert sorted(seen) == list(range(120))
    with pytest.raises(ValueError, match="consumed_samples"):
        PretrainingSampler(10, 11, 1, 0, 1)


def test_parse_data_path():
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    assert parse_data_path("a") == [(1.0, "a")]
    with pytest.raises(ValueError, match="mix of weights and prefixes"):
        parse_data_path(["0.3", "a", "b"])
    with pytest.raises(ValueError, match="weights"):
        parse_data_path(["0", "a", "0", "b"])


def test_blend_proportions_within_one_percent(tmp_path):
    rng = np.random.default_rng(5)
    prefixes = []
    for k in range(3):
        prefix = str(tmp_path / f"set{k}")
        unique_token_corpus(prefix, rng, n_docs=30, first_token=100_000 * k)
        prefixes.append(prefix)
    weights = [0.2, 0.3, 0.5]
    data_path = [x for w, p in zip(weights, prefixes) for x in (str(w), p)]
    size = 5000
    train, valid, test = build_datasets(data_path, "90,10,0", 4, (size, 50, 0), seed=9)
    assert isinstance(train, BlendedDataset) and len(train) == size and test is None
    counts = np.bincount(train.dataset_index, minlength=3)
    np.testing.assert_allclose(counts / size, weights, atol=0.01)
    # Every prefix of the blend is as close as one sample allows.
    for n in (10, 100, 1000):
        lag = np.bincount(train.dataset_index[:n], minlength=3) - np.array(weights) * n
        assert np.all(np.abs(lag) <= 1), (n, lag)
    # Samples really come from the dataset the index names (token ranges are disjoint).
    for i in rng.integers(0, size, 50):
        assert train[int(i)]["tokens"][0] // 100_000 == train.dataset_index[i]
    assert len(valid) == 50
    # Prefixes without weights blend in their natural (token count) proportions.
    tokens = [IndexedDataset(p).num_tokens for p in prefixes]
    assert parse_data_path(prefixes) == [(t / sum(tokens), p) for t, p in zip(tokens, prefixes)]


def test_a_data_path_per_split_keeps_each_split_to_its_own_documents(tmp_path):
    """--train-data-path / --valid-data-path (Megatron's): each split takes every document of its
    own prefixes and none of another's; a split without a path, or asked nothing, is None."""
    rng = np.random.default_rng(3)
    for name, first in (("train", 0), ("valid", 100_000), ("more", 200_000)):
        unique_token_corpus(str(tmp_path / name), rng, n_docs=30, first_token=first)
    train, valid, test = build_split_datasets(
        ([str(tmp_path / "train")], [str(tmp_path / "valid")], None), 8, (200, 40, 10), seed=4
    )
    assert test is None and len(train) == 200 and len(valid) == 40
    assert all(int(train[i]["tokens"].max()) < 100_000 for i in range(len(train)))
    assert all(100_000 <= int(valid[i]["tokens"].min()) < 200_000 for i in range(len(valid)))
    # Every training document is in: the first epoch covers all of the prefix's tokens.
    tokens = IndexedDataset(str(tmp_path / "train")).num_tokens
    seen = np.unique(np.concatenate([train[i]["tokens"] for i in range(len(train))]))
    assert len(seen) >= min(tokens, 200 * 8)
    # A blend per split, as for --data-path.
    blended, none, _ = build_split_datasets(
        ([str(tmp_path / "train"), str(tmp_path / "more")], ["x"], None), 8, (100, 0, 0), seed=4
    )
    assert isinstance(blended, BlendedDataset) and none is None


def random_token_corpus(prefix, rng, high, planted=None, dtype=np.uint16, n_docs=20):
    """Documents of fresh random tokens in [0, high), `planted` (if given) at a random place in one."""
    documents = [rng.integers(0, high, size=int(rng.integers(20, 60))) for _ in range(n_docs)]
    if planted is not None:
        document = documents[int(rng.integers(0, n_docs))]
        document[int(rng.integers(0, len(document)))] = planted
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for document in documents:
            builder.add_item(document)
            builder.end_document()
    return prefix


# A vocabulary of 500 pads to 512 embedding rows: 505 would train a padding row, 512 on would crash.
@pytest.mark.parametrize("planted", [505, 512, 40000])
def test_token_ids_past_the_vocabulary_are_refused_naming_the_bin(tmp_path, planted):
    rng = np.random.default_rng(planted)
    good = random_token_corpus(str(tmp_path / "good"), rng, 500)
    bad = random_token_corpus(str(tmp_path / "bad"), rng, 500, planted)
    message = re.escape(
        f"{tmp_path / 'bad.bin'}: its largest token id is {planted}, past the vocabulary of 500 "
        "tokens (ids 0 to 499): the data was made with another tokenizer. Re-tokenize it"
    )
    for build in (
        lambda: build_datasets(bad, "1", 8, (20, 0, 0), seed=1, vocab_size=500),
        lambda: build_datasets(
            ["0.5", good, "0.5", bad], "1", 8, (20, 0, 0), seed=1, vocab_size=500
        ),
        lambda: build_split_datasets((good, bad, None), 8, (20, 10, 0), seed=1, vocab_size=500),
    ):
        with pytest.raises(IndexedDatasetError, match=message):
            build()
    assert len(build_datasets(bad, "1", 8, (20, 0, 0), seed=1, vocab_size=planted + 1)[0]) == 20
    assert len(build_datasets(good, "1", 8, (20, 0, 0), seed=1, vocab_size=500)[0]) == 20
    with pytest.raises(IndexedDatasetError, match=r"bad2.bin: token id -3 is negative"):
        build_datasets(
            random_token_corpus(str(tmp_path / "bad2"), rng, 500, -3, np.int32),
            "1",
            8,
            (20, 0, 0),
            seed=1,
            vocab_size=500,
        )


def test_the_token_range_is_cached_by_the_bins_size_and_mtime(tmp_path, monkeypatch):
    rng = np.random.default_rng(11)
    prefix = random_token_corpus(str(tmp_path / "c"), rng, 500)
    scans = []
    scan = IndexedDataset.token_range.func
    monkeypatch.setattr(
        IndexedDataset, "token_range", property(lambda ds: scans.append(ds.prefix) or scan(ds))
    )
    build_datasets(prefix, "1,1,0", 8, (20, 5, 0), seed=1, vocab_size=500)  # two splits, one scan
    assert len(scans) == 1 and len(list((tmp_path / "index_cache").glob("*-token_range.json"))) == 1
    build_datasets(prefix, "1,1,0", 8, (20, 5, 0), seed=1, vocab_size=500)  # another start
    assert len(scans) == 1
    # The data made again, now with an id past the vocabulary: another .bin, scanned again.
    random_token_corpus(prefix, rng, 500, planted=600)
    with pytest.raises(IndexedDatasetError, match="largest token id is 600"):
        build_datasets(prefix, "1,1,0", 8, (20, 5, 0), seed=1, vocab_size=500)
    assert len(scans) == 2
    # A cache folder that cannot take the range (read-only, its indices built elsewhere) only warns.
    random_token_corpus(prefix, rng, 500)
    build_datasets(prefix, "1,1,0", 8, (20, 5, 0), seed=1)

    def read_only(*args):
        raise PermissionError("read-only")

    monkeypatch.setattr(gpt_dataset.os, "replace", read_only)
    with pytest.warns(UserWarning, match="cannot cache the token range of .*c.bin .*read-only"):
        assert len(build_datasets(prefix, "1,1,0", 8, (20, 5, 0), seed=1, vocab_size=500)[0]) == 20


def build_with_a_vocabulary(rank, world_size, prefix, vocab_size):
    os.environ["LOCAL_RANK"] = str(rank)  # one node: rank 0 checks and builds, rank 1 waits
    try:
        GPTDataset(prefix, np.arange(20), 8, 50, seed=3, vocab_size=vocab_size)
    except Exception as error:
        return type(error).__name__, str(error)
    return None, ""


def test_data_past_the_vocabulary_stops_every_rank(tmp_path):
    prefix = random_token_corpus(str(tmp_path / "c"), np.random.default_rng(12), 500, planted=777)
    (kind, message), (other_kind, other_message) = run_on_ranks(
        build_with_a_vocabulary, 2, prefix, 500, timeout_s=120
    )
    assert kind == "IndexedDatasetError" and "largest token id is 777" in message
    assert other_kind == "DatasetBuildError" and other_message.startswith(
        "rank 0 failed to build the train"
    )
    assert message in other_message


def test_non_finite_blend_weights_and_splits_are_refused():
    for weight in ("nan", "inf", "-inf", "-1"):
        with pytest.raises(
            ValueError, match=f"--data-path weight {weight} is not a finite non-negative number"
        ):
            parse_data_path([weight, "a", "1", "b"])
    with pytest.raises(ValueError, match="positive, finite sum"):
        parse_data_path(["1e308", "a", "1e308", "b"])
    for split in ("nan", "1,inf,0", "-inf"):
        with pytest.raises(ValueError, match="--split"):
            split_ranges(10, split)
