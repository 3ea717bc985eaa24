"""megafp8.parallel: process groups, tensor/sequence-parallel layers on the FP8 core and the
autograd mappings between tensor-parallel ranks (communication.py), the vocabulary-parallel
embedding and cross-entropy, a pipeline rank's share of the model and its gradient
finalisation (stages.py), pipeline schedules and point-to-point exchange between stages
(schedules.py, p2p.py), and data-parallel gradient buffers. The collectives underneath are
megafp8.collectives.

Installed as `megafp8.parallel`; never import it as a bare `parallel`.
"""

from .initialization import master_slice, normal_init
from .layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from .p2p import P2PCommunicator, pipeline_tensor_shape
from .process_groups import ParallelGroups, ParallelSizes
from .schedules import SCHEDULES, forward_backward, get_schedule
from .stages import (
    PipelineStage,
    balanced_stage_split,
    check_embeddings_in_sync,
    finalize_grads,
    stage_layers,
    tied_embedding,
)
from .vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "SCHEDULES",
    "ColumnParallelLinear",
    "P2PCommunicator",
    "ParallelGroups",
    "ParallelSizes",
    "PipelineStage",
    "QKVParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "balanced_stage_split",
    "check_embeddings_in_sync",
    "finalize_grads",
    "forward_backward",
    "get_schedule",
    "master_slice",
    "normal_init",
    "pipeline_tensor_shape",
    "stage_layers",
    "tied_embedding",
    "vocab_parallel_cross_entropy",
]
