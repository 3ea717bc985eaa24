"""megafp8.models: TransformerConfig, presets, GPT and Llama built from parallel FP8 layers.

Installed as `megafp8.models`; never import it as a bare `models`.
"""
