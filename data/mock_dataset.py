"""Synthetic token samples for benchmarks and smoke tests (`--mock-data`): no files needed.

Sample i is `seq_length + 1` tokens drawn from a generator seeded by (seed, i), so any rank,
run or resume sees the same sample i. Every `document_length`-th token is the end-of-document
token, which gives document-reset code paths something to do.
"""

import numpy as np
import torch


class MockGPTDataset(torch.utils.data.Dataset):
    def __init__(self, vocab_size, seq_length, num_samples, seed, eod=None, document_length=257):
        if vocab_size < 2 or seq_length < 1 or num_samples < 1:
            raise ValueError(
                f"bad mock dataset: vocab_size {vocab_size}, seq_length {seq_length}, "
                f"num_samples {num_samples}"
            )
        self.vocab_size, self.seq_length, self.num_samples, self.seed = (
            vocab_size,
            seq_length,
            num_samples,
            seed,
        )
        self.eod = vocab_size - 1 if eod is None else eod
        self.document_length = document_length

    def __len__(self):
        return self.num_samples

    def __getitem__(self, idx):
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        rng = np.random.default_rng((self.seed, idx))
        tokens = rng.integers(0, self.vocab_size - 1, size=self.seq_length + 1, dtype=np.int64)
        tokens[self.document_length - 1 :: self.document_length] = self.eod
        return {"tokens": tokens}
