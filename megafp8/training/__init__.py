"""megafp8.training: flags and their checks, the trainer loop, the optimizer (its own package) and LR
schedule, checkpointing, metrics."""
