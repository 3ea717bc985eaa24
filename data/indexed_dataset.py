"""Megatron-LM compatible indexed dataset: `<prefix>.idx` (the index) and `<prefix>.bin` (tokens).

Byte-compatible with Megatron-LM's MMapIndexedDataset, so data preprocessed there trains here and
the other way round. `.idx` layout (little-endian): 9-byte magic, u64 version 1, u8 dtype code,
u64 sequence count, u64 document count, int32 sequence lengths, int64 byte pointers into `.bin`,
int64 document indices (0, the first sequence of each later document, ..., the sequence count).
"""

import functools
import operator
import os
import struct

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODES = {np.dtype(dtype): code for code, dtype in _DTYPES.items()}
# magic, version, dtype code, sequence count, document count; "<" means no padding: 34 bytes.
_HEADER = struct.Struct("<9sQBQQ")
# Bytes of the .bin scanned at a time for its token range: small enough that a chunk's second
# reduction finds it still in the CPU's cache (the fastest of 1 to 64 MiB, measured).
_SCAN_CHUNK_BYTES = 1 << 22


class IndexedDatasetError(ValueError):
    """An indexed dataset's files are missing, corrupt, truncated or do not belong together."""


def best_dtype(vocab_size):
    """The token dtype Megatron-LM picks: uint16 for vocabularies under 65500, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class IndexedDatasetBuilder:
    """Writes `<prefix>.bin` and `<prefix>.idx`.

    Both are written under temporary names and renamed into place by `finalize`, so an
    interrupted build never leaves a `.idx` that looks valid. As a context manager it finalizes
    on success and removes the temporary files on an exception.
    """

    def __init__(self, prefix, dtype):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        # the reader refuses float tokens
        if self.dtype not in _CODES or self.dtype.kind not in "iu":
            raise ValueError(
                f"unsupported token dtype {self.dtype}; one of "
                f"{sorted(str(dtype) for dtype in _CODES if dtype.kind in 'iu')}"
            )
        self._tmp_bin = self.prefix + ".bin.tmp"
        self._tmp_idx = self.prefix + ".idx.tmp"
        self._bin = open(self._tmp_bin, "wb")
        self._sizes = []
        self._document_indices = [0]

    def add_item(self, tokens):
        """Append one sequence (a 1-D array, list or CPU tensor of ints; may be empty)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {tokens.shape}")
        if tokens.size:
            if tokens.dtype.kind not in "iu":
                raise ValueError(f"tokens must be integers, got {tokens.dtype}")
            # Check before casting: astype would silently wrap e.g. -1 to 65535.
            info = np.iinfo(self.dtype)
            for value in (tokens.min(), tokens.max()):
                if not info.min <= value <= info.max:
                    raise ValueError(f"token {int(value)} does not fit dtype {self.dtype}")
        self._bin.write(tokens.astype(self.dtype).tobytes())
        self._sizes.append(len(tokens))

    def end_document(self):
        """Mark a document boundary after the sequences added so far."""
        self._document_indices.append(len(self._sizes))

    def finalize(self):
        """Write the index and move both files into place."""
        self._bin.close()
        document_indices = self._document_indices
        if document_indices[-1] != len(self._sizes):  # close a document left open
            document_indices = document_indices + [len(self._sizes)]
        sizes = np.array(self._sizes, dtype="<i4")
        pointers = np.zeros(len(sizes), dtype="<i8")
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self._tmp_idx, "wb") as f:
            f.write(
                _HEADER.pack(
                    _MAGIC, _VERSION, _CODES[self.dtype], len(sizes), len(document_indices)
                )
            )
            f.write(sizes.tobytes())
            f.write(pointers.tobytes())
            f.write(np.array(document_indices, dtype="<i8").tobytes())
        # Drop an old index first so that no moment pairs it with the new .bin.
        if os.path.exists(self.prefix + ".idx"):
            os.remove(self.prefix + ".idx")
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(self._tmp_idx, self.prefix + ".idx")

    def abort(self):
        """Stop the build and remove its temporary files."""
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Reads `<prefix>.idx` / `<prefix>.bin` through numpy memory maps, validating them first."""

    def __init__(self, prefix):
        self.prefix = str(prefix)
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: missing file")

        def fail(path, what):
            raise IndexedDatasetError(f"{path}: {what}")

        with open(idx_path, "rb") as f:
            header = f.read(_HEADER.size)
        if header[: len(_MAGIC)] != _MAGIC:
            fail(
                idx_path,
                f"wrong magic {header[: len(_MAGIC)]!r}: not a Megatron/megafp8 indexed dataset",
            )
        if len(header) < _HEADER.size:
            fail(
                idx_path,
                f"truncated: {len(header)} bytes, shorter than the {_HEADER.size}-byte header",
            )
        _, version, code, n_seq, n_doc = _HEADER.unpack(header)
        if version != _VERSION:
            fail(idx_path, f"unsupported version {version} (only {_VERSION})")
        if code not in _DTYPES:
            fail(idx_path, f"unknown dtype code {code} (known: {sorted(_DTYPES)})")
        if np.dtype(_DTYPES[code]).kind == "f":  # token ids are integers; this is a foreign file
            fail(
                idx_path,
                f"dtype code {code} ({np.dtype(_DTYPES[code])}): token data must be integers; "
                "this is not a token dataset (make one with tools/preprocess_data.py)",
            )
        idx_size = os.path.getsize(idx_path)
        expected = _HEADER.size + n_seq * (4 + 8) + n_doc * 8
        if idx_size < expected:
            fail(
                idx_path,
                f"truncated: {idx_size} bytes, but its header claims {n_seq} sequences "
                f"and {n_doc} document indices ({expected} bytes)",
            )
        if idx_size > expected:
            fail(idx_path, f"{idx_size - expected} unexpected bytes after the document indices")

        self.dtype = np.dtype(_DTYPES[code])
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        offset = _HEADER.size
        self.sizes = np.frombuffer(idx, dtype="<i4", count=n_seq, offset=offset)
        offset += self.sizes.nbytes
        self._pointers = np.frombuffer(idx, dtype="<i8", count=n_seq, offset=offset)
        offset += self._pointers.nbytes
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=n_doc, offset=offset)

        docs = self.document_indices
        if n_doc == 0 or docs[0] != 0:
            fail(idx_path, "document indices do not start at 0")
        if docs[-1] != n_seq:
            fail(idx_path, f"document indices end at {docs[-1]}, not at the sequence count {n_seq}")
        if np.any(np.diff(docs) < 0):
            fail(idx_path, "document indices are not non-decreasing")
        if np.any(self.sizes < 0):
            fail(idx_path, "negative sequence length")
        nbytes = self.sizes.astype(np.int64) * self.dtype.itemsize
        # Sequences lie back to back, so each pointer is the sum of the bytes before it; anything
        # else means a corrupt index, and checking it keeps every read inside the .bin.
        if n_seq and (
            self._pointers[0] != 0 or np.any(self._pointers[1:] != np.cumsum(nbytes[:-1]))
        ):
            fail(idx_path, "byte pointers do not match the sequence lengths")
        total = int(nbytes.sum())
        bin_size = os.path.getsize(bin_path)
        if bin_size != total:
            fail(
                bin_path,
                f"{bin_size} bytes, but {idx_path} describes {total}: "
                "truncated, or the .bin of another dataset",
            )
        # numpy cannot memory-map an empty file (a dataset of empty sequences has one).
        data = np.memmap(bin_path, dtype=np.uint8, mode="r") if bin_size else np.empty(0, np.uint8)
        self._tokens = np.frombuffer(data, dtype=self.dtype)
        self.num_tokens = len(self._tokens)

    @functools.cached_property
    def token_range(self):
        """(smallest, largest) token id in the `.bin`, or None when it holds no tokens.

        Reduced chunk by chunk over the memory map: a file larger than memory is read once, and
        never copied whole.
        """
        if not self.num_tokens:
            return None
        step = _SCAN_CHUNK_BYTES // self.dtype.itemsize
        smallest, largest = [], []
        for start in range(0, self.num_tokens, step):
            chunk = self._tokens[start : start + step]
            smallest.append(chunk.min())
            largest.append(chunk.max())
        return int(min(smallest)), int(max(largest))

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        return self.get(i)

    def get(self, i, offset=0, length=None):
        """Tokens `offset:offset + length` of sequence `i` (to its end when length is None)."""
        i, n = operator.index(i), len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        i %= n
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"offset {offset}, length {length} out of range of sequence {i} of {size} tokens"
            )
        start = int(self._pointers[i]) // self.dtype.itemsize + offset
        return self._tokens[start : start + length]
