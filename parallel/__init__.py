"""megafp8.parallel: process groups, tensor/sequence-parallel layers on the FP8 core, and the
vocabulary-parallel embedding and cross-entropy. Pipeline and data parallelism come next.

Installed as `megafp8.parallel`; never import it as a bare `parallel`.
"""
from .initialization import master_slice, normal_init
from .layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from .process_groups import ParallelGroups, ParallelSizes
from .vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "ParallelGroups",
    "ParallelSizes",
    "QKVParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "master_slice",
    "normal_init",
    "vocab_parallel_cross_entropy",
]
