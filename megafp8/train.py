"""`python -m megafp8.train` / `megafp8-train`: pretraining with Megatron-LM's flags, under torchrun.

    torchrun --nproc-per-node 8 -m megafp8.train --model gpt-1.3b --bf16 --fp8-format hybrid ...
"""
from megafp8.training.trainer import main

if __name__ == "__main__":
    main()
