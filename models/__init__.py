"""megafp8.models: TransformerConfig and presets, and one transformer (GPT or Llama by its
config) built from tensor-parallel FP8 layers; Hugging Face weight mapping in hf_mapping.

Installed as `megafp8.models`; never import it as a bare `models`.
"""

from .config import PRESETS, RopeScaling, TransformerConfig, preset
from .transformer import TransformerLM

__all__ = ["PRESETS", "RopeScaling", "TransformerConfig", "TransformerLM", "preset"]
