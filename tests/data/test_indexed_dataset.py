"""The Megatron-compatible indexed dataset: round trips, the byte layout, and corrupt files."""

import os
import struct

import numpy as np
import pytest
import torch
from megafp8.data import indexed_dataset
from megafp8.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    best_dtype,
)


def random_documents(rng, high, n_docs=4):
    """Several documents of several sequences each, of fresh random tokens in [1, high)."""
    return [
        [rng.integers(1, high, size=rng.integers(1, 50)) for _ in range(rng.integers(2, 5))]
        for _ in range(n_docs)
    ]


def build(prefix, documents, dtype):
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for document in documents:
            for sequence in document:
                builder.add_item(sequence)
            builder.end_document()


def hand_built_idx(code, sizes, itemsize, document_indices):
    """The .idx bytes written straight from the documented layout, independent of the builder."""
    pointers = np.concatenate([[0], np.cumsum(np.array(sizes[:-1], dtype=np.int64) * itemsize)])
    return (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", code)
        + struct.pack("<Q", len(sizes))
        + struct.pack("<Q", len(document_indices))
        + np.array(sizes, dtype="<i4").tobytes()
        + pointers.astype("<i8").tobytes()
        + np.array(document_indices, dtype="<i8").tobytes()
    )


@pytest.mark.parametrize("vocab_size", [50257, 65499, 65500, 128256])
def test_round_trip(tmp_path, vocab_size):
    dtype = best_dtype(vocab_size)
    rng = np.random.default_rng(vocab_size)
    documents = random_documents(rng, vocab_size)
    build(tmp_path / "ds", documents, dtype)

    ds = IndexedDataset(tmp_path / "ds")
    sequences = [sequence for document in documents for sequence in document]
    assert ds.dtype == dtype and len(ds) == len(sequences)
    for i, sequence in enumerate(sequences):
        assert ds[i].dtype == dtype
        np.testing.assert_array_equal(ds[i], sequence)
    np.testing.assert_array_equal(ds[-1], sequences[-1])
    np.testing.assert_array_equal(ds.sizes, [len(s) for s in sequences])
    assert ds.sizes.dtype == np.int32
    np.testing.assert_array_equal(ds.document_indices, np.cumsum([0] + [len(d) for d in documents]))
    assert ds.num_tokens == sum(map(len, sequences))
    with pytest.raises(IndexError):
        ds[len(sequences)]
    with pytest.raises(IndexError):
        ds[-len(sequences) - 1]


def test_best_dtype():
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32


def test_builder_accepts_lists_and_tensors(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "ds", np.int32) as builder:
        builder.add_item([7, 70000, 3])
        builder.add_item(torch.tensor([5, 9], dtype=torch.int64))
    ds = IndexedDataset(tmp_path / "ds")
    assert ds[0].tolist() == [7, 70000, 3] and ds[1].tolist() == [5, 9]
    np.testing.assert_array_equal(ds.document_indices, [0, 2])  # the open document is closed


def test_idx_and_bin_bytes_match_the_documented_layout(tmp_path):
    rng = np.random.default_rng(1)
    sequences = [
        rng.integers(1, 65499, size=3),
        np.array([], dtype=np.int64),
        rng.integers(1, 65499, size=2),
    ]
    with IndexedDatasetBuilder(tmp_path / "ds", np.uint16) as builder:
        builder.add_item(sequences[0])
        builder.add_item(sequences[1])
        builder.end_document()
        builder.add_item(sequences[2])
        builder.end_document()

    expected = hand_built_idx(code=8, sizes=[3, 0, 2], itemsize=2, document_indices=[0, 2, 3])
    assert (tmp_path / "ds.idx").read_bytes() == expected
    assert (tmp_path / "ds.bin").read_bytes() == np.concatenate(sequences).astype("<u2").tobytes()


def test_reads_a_hand_built_pair(tmp_path):
    rng = np.random.default_rng(2)
    sequences = [rng.integers(-(2**31), 2**31 - 1, size=n) for n in (5, 1, 4)]
    (tmp_path / "hand.idx").write_bytes(
        hand_built_idx(code=4, sizes=[5, 1, 4], itemsize=4, document_indices=[0, 1, 3])
    )
    (tmp_path / "hand.bin").write_bytes(np.concatenate(sequences).astype("<i4").tobytes())

    ds = IndexedDataset(tmp_path / "hand")
    assert ds.dtype == np.int32 and len(ds) == 3
    for i, sequence in enumerate(sequences):
        np.testing.assert_array_equal(ds[i], sequence)
    np.testing.assert_array_equal(ds.document_indices, [0, 1, 3])


def test_empty_sequences_round_trip(tmp_path):
    build(tmp_path / "ds", [[[], [4, 2]], [[]]], np.uint16)
    ds = IndexedDataset(tmp_path / "ds")
    assert [ds[i].tolist() for i in range(len(ds))] == [[], [4, 2], []]
    build(tmp_path / "empty", [[[]]], np.uint16)  # an empty .bin
    ds = IndexedDataset(tmp_path / "empty")
    assert len(ds) == 1 and ds[0].tolist() == [] and ds.num_tokens == 0


def test_get_slices(tmp_path):
    tokens = np.random.default_rng(3).integers(1, 65499, size=20)
    build(tmp_path / "ds", [[tokens[:7], tokens[7:]]], np.uint16)
    ds = IndexedDataset(tmp_path / "ds")
    np.testing.assert_array_equal(ds.get(1, offset=4), tokens[11:])
    np.testing.assert_array_equal(ds.get(1, offset=2, length=5), tokens[9:14])
    np.testing.assert_array_equal(ds.get(0, length=3), tokens[:3])
    assert ds.get(0, offset=7).tolist() == []
    with pytest.raises(IndexError):
        ds.get(0, offset=5, length=3)
    with pytest.raises(IndexError):
        ds.get(0, offset=-1)


@pytest.mark.parametrize(
    "dtype, bad", [(np.uint16, -1), (np.uint16, 65536), (np.int32, 2**31), (np.uint8, 256)]
)
def test_tokens_that_do_not_fit_the_dtype_raise(tmp_path, dtype, bad):
    builder = IndexedDatasetBuilder(tmp_path / "ds", dtype)
    with pytest.raises(ValueError, match=rf"{bad}.*{np.dtype(dtype)}"):
        builder.add_item([1, bad, 2])
    builder.abort()


def test_exception_inside_with_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(tmp_path / "ds", np.uint16) as builder:
            builder.add_item([1, 2, 3])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_interrupted_build_leaves_no_idx(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "ds", np.uint16)
    builder.add_item([1, 2, 3])
    builder.end_document()  # finalize never called
    assert not (tmp_path / "ds.idx").exists() and not (tmp_path / "ds.bin").exists()
    with pytest.raises(IndexedDatasetError, match="ds.idx: missing file"):
        IndexedDataset(tmp_path / "ds")
    builder.abort()


def corrupt_idx(offset, data):
    def corrupt(idx, bin_):
        raw = bytearray(idx.read_bytes())
        raw[offset : offset + len(data)] = data
        idx.write_bytes(bytes(raw))

    return corrupt


# In the dataset built below: 3 sequences, 3 document indices, so they start at 34 + 3 * 12 = 70.
CORRUPTIONS = {
    "bad magic": (corrupt_idx(0, b"NOTMMIDX\x00"), "idx", "not a Megatron/megafp8 indexed dataset"),
    "version": (corrupt_idx(9, struct.pack("<Q", 2)), "idx", "unsupported version 2"),
    "dtype code": (corrupt_idx(17, b"\x09"), "idx", "unknown dtype code 9"),
    "truncated idx": (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-5]), "idx", "truncated"),
    "truncated header": (
        lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:20]),
        "idx",
        "truncated",
    ),
    "truncated bin": (
        lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-2]),
        "bin",
        "truncated",
    ),
    "another dataset's bin": (
        lambda idx, bin_: bin_.write_bytes(b"\x01\x00" * 4),
        "bin",
        "another dataset",
    ),
    "docs not from 0": (corrupt_idx(70, struct.pack("<q", 1)), "idx", "do not start at 0"),
    "docs not to the end": (
        corrupt_idx(86, struct.pack("<q", 2)),
        "idx",
        "not at the sequence count 3",
    ),
    "docs out of order": (corrupt_idx(78, struct.pack("<q", 4)), "idx", "not non-decreasing"),
    "pointers": (corrupt_idx(34 + 12 + 8, struct.pack("<q", 10**9)), "idx", "pointers"),
    "missing bin": (lambda idx, bin_: bin_.unlink(), "bin", "missing file"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_corrupt_files_raise_naming_the_file(tmp_path, name):
    corrupt, bad_file, message = CORRUPTIONS[name]
    rng = np.random.default_rng(4)
    documents = [[rng.integers(1, 65499, size=4)], [rng.integers(1, 65499, size=3)] * 2]
    build(tmp_path / "ds", documents, np.uint16)
    IndexedDataset(tmp_path / "ds")  # valid before the corruption
    corrupt(tmp_path / "ds.idx", tmp_path / "ds.bin")
    with pytest.raises(IndexedDatasetError, match=message) as error:
        IndexedDataset(tmp_path / "ds")
    assert str(tmp_path / f"ds.{bad_file}") in str(error.value)


@pytest.mark.parametrize(
    "code, built_as", [(7, np.int32), (6, np.int64)], ids=["float32", "float64"]
)
def test_a_float_dtype_code_is_refused_naming_the_file(tmp_path, code, built_as):
    """Integer tokens under a float code read as tiny floats, all 0 as ids: the index is refused."""
    rng = np.random.default_rng(code)
    # the .bin's size fits the float dtype
    build(tmp_path / "ds", random_documents(rng, 50257), built_as)
    corrupt_idx(17, bytes([code]))(tmp_path / "ds.idx", tmp_path / "ds.bin")
    name = np.dtype(np.float32 if code == 7 else np.float64).name
    with pytest.raises(
        IndexedDatasetError, match=rf"dtype code {code} \({name}\): token data must be integers"
    ) as error:
        IndexedDataset(tmp_path / "ds")
    assert str(error.value).startswith(str(tmp_path / "ds.idx"))
    with pytest.raises(ValueError, match=f"unsupported token dtype {name}"):
        IndexedDatasetBuilder(tmp_path / "floats", name)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_token_range_scans_every_chunk(tmp_path, monkeypatch, dtype):
    """The smallest and largest id of fresh random tokens, wherever they lie across the chunks."""
    monkeypatch.setattr(indexed_dataset, "_SCAN_CHUNK_BYTES", 64)  # 32 or 16 tokens a chunk
    rng = np.random.default_rng(5)
    low = 0 if dtype == np.uint16 else -1000
    documents = [
        [rng.integers(low, 50257, size=rng.integers(1, 50)) for _ in range(3)] for _ in range(12)
    ]
    build(tmp_path / "ds", documents, dtype)
    tokens = np.concatenate([sequence for document in documents for sequence in document])
    ds = IndexedDataset(tmp_path / "ds")
    assert ds.num_tokens > 10 * 64 // np.dtype(dtype).itemsize  # many chunks, the last one partial
    assert ds.token_range == (int(tokens.min()), int(tokens.max()))
    build(tmp_path / "empty", [[[]]], dtype)
    assert IndexedDataset(tmp_path / "empty").token_range is None
