"""7b FP8 delayed, graphed: the trainer with the fused pass casting weights, or (NO_PASS_CAST=1) not."""
import os, sys
from megafp8.fp8.linear import Fp8Linear
if os.environ.get("NO_PASS_CAST") == "1":
    Fp8Linear.weight_cast_target = lambda self: None
from megafp8.training.trainer import main
sys.argv = ["megafp8-train"] + sys.argv[1:]
main()
