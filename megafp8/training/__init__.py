"""megafp8.training: arguments, trainer loop, optimizer + LR schedule, checkpointing, metrics."""
