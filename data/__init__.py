"""megafp8.data: tokenizers, the Megatron-compatible indexed dataset, GPT datasets and blending.

Installed as `megafp8.data`; never import it as a bare `data`.
"""
