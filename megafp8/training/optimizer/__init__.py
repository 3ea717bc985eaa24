"""The optimizer: mixed-precision AdamW with fp32 master weights (or lean states), global
gradient clipping and the distributed optimizer (`adamw.py`), and its fused Triton pass over every parameter, which
also writes the FP8 linears' next weight casts (`adamw_kernel.py`)."""

from .adamw import STATE_DTYPES, MixedPrecisionAdamW, squared_norm, squared_norms

__all__ = ["STATE_DTYPES", "MixedPrecisionAdamW", "squared_norm", "squared_norms"]
