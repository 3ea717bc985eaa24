"""megafp8.data: tokenizers, the Megatron-compatible indexed dataset, GPT datasets and blending.

Installed as `megafp8.data`; never import it as a bare `data`.
"""

from megafp8.data.blended_dataset import (
    BlendedDataset,
    build_datasets,
    build_split_datasets,
    parse_data_path,
)
from megafp8.data.gpt_dataset import DatasetBuildError, GPTDataset, parse_split, split_ranges
from megafp8.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from megafp8.data.mock_dataset import MockGPTDataset
from megafp8.data.samplers import PretrainingSampler
from megafp8.data.tokenizers import build_tokenizer

__all__ = [
    "BlendedDataset",
    "DatasetBuildError",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "MockGPTDataset",
    "PretrainingSampler",
    "build_datasets",
    "build_split_datasets",
    "build_tokenizer",
    "parse_data_path",
    "parse_split",
    "split_ranges",
]
