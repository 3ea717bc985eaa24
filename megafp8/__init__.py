"""megafp8: Megatron-style 3D-parallel pretraining with native FP8.

The FP8 core is re-exported here: `from megafp8 import Fp8Linear, fp8_autocast, DelayedScaling`.
"""

from .fp8 import *  # noqa: F401,F403
from .fp8 import __all__ as __all__

__version__ = "0.1.0"
