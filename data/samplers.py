"""Which samples each data-parallel rank reads, resumable from a consumed-samples count.

Global batch g holds samples [g * B, (g + 1) * B) of the dataset (B = global batch size), in
order; micro-batch m of data-parallel rank r takes its slice of them. A run that resumes with
`consumed_samples = k` therefore reads exactly what an uninterrupted run reads after k samples.
"""


class PretrainingSampler:
    """Yields lists of dataset indices, one micro-batch of this rank at a time.

    Within a global batch the order is micro-batch-major: the batch's samples are cut into
    `num_micro_batches` consecutive groups of `micro_batch_size * dp_size`, and rank r reads the
    r-th slice of each group (Megatron-LM's layout, so the same data reaches the same ranks).
    """

    def __init__(
        self, total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size, drop_last=True
    ):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"bad sampler shape: micro_batch_size {micro_batch_size}, "
                f"dp_rank {dp_rank}, dp_size {dp_size}"
            )
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} outside [0, {total_samples}]: "
                "the checkpoint read more samples than this dataset holds"
            )
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.drop_last = drop_last

    def __len__(self):
        step = self.micro_batch_size * self.dp_size
        remaining = self.total_samples - self.consumed_samples
        return remaining // step if self.drop_last else -(-remaining // step)

    def __iter__(self):
        step = self.micro_batch_size * self.dp_size
        mine = slice(
            self.dp_rank * self.micro_batch_size, (self.dp_rank + 1) * self.micro_batch_size
        )
        for start in range(self.consumed_samples, self.total_samples, step):
            group = list(range(start, min(start + step, self.total_samples)))
            if len(group) < step and self.drop_last:
                return
            yield group[mine]
