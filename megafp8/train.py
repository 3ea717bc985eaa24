"""`python -m megafp8.train` / `megafp8-train`: pretraining with Megatron-LM's flags, under torchrun.

    torchrun --nproc-per-node 8 -m megafp8.train --model gpt-1.3b --bf16 --fp8-format hybrid ...
    WORLD_SIZE=8 python -m megafp8.train --check-args --model gpt-1.3b --bf16 --fp8-format hybrid ...

`--check-args` runs the trainer's checks of the flags (parse_args, then validate_args for the world
size in WORLD_SIZE, default 1) and nothing else: no process group, GPU work or data. A mistake is
the trainer's one line, `megafp8-train: error: ...`, and exit status 2, before any launcher runs;
the recipes run it before torchrun, whose report of the failed ranks would follow the line.
"""

import os
import sys
import warnings

from megafp8.training import arguments, checkpointing


def check_args(argv) -> int:
    """The exit status of `--check-args` for the flags `argv`; says what is wrong, or what they describe."""
    world = os.environ.get("WORLD_SIZE", "1")
    try:
        if not world.isdigit() or int(world) == 0:
            raise arguments.ArgumentsError(
                f"WORLD_SIZE={world!r}: give the number of ranks the run will have"
            )
        world_size = int(world)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run itself says them
            args = arguments.validate_args(arguments.parse_args(argv), world_size)
    # what the trainer says in one line
    except (
        checkpointing.CheckpointError,
        ValueError,
        OSError,
    ) as error:
        print(f"megafp8-train: error: {error}", file=sys.stderr)
        return 2
    micro = args.num_micro_batches
    print(
        f"megafp8-train: the flags hold for a world size of {world_size}: tensor {args.tensor_model_parallel_size}"
        f" x pipeline {args.pipeline_model_parallel_size} x data {args.data_parallel_size}, global batch "
        f"{args.global_batch_size} ({micro} micro-batch{'es' if micro > 1 else ''} of {args.micro_batch_size} per "
        f"data-parallel rank), {args.train_iters} iterations"
    )
    return 0


def main() -> None:
    if "--check-args" in sys.argv[1:]:
        sys.exit(check_args([token for token in sys.argv[1:] if token != "--check-args"]))
    # Only for a run: the check needs none of the model, parallel or data code.
    from megafp8.training import trainer

    trainer.main()


if __name__ == "__main__":
    main()
