"""What a checkpoint's checksums cost: the seconds a save takes (the checksums hashed afterwards on
a thread while training goes on), how long after it the checksums are recorded, and what checking
them adds to a load. One process, fresh random fp32 tensors written to `--folder`.

    python benchmarks/bench_checkpoint.py --gib 2 --folder /scratch/ckpt_bench
"""

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from megafp8.models import preset

from megafp8.training import checkpointing


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="checkpoint size (default 2 GiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", type=Path, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    tensors = max(1, round(args.gib * 4))  # of 256 MiB each
    state = {f"model/w{i}": torch.randn(64 << 20) for i in range(tensors)}
    folder = Path(tempfile.mkdtemp(dir=args.folder))
    try:
        print(f"{'GiB':>5s} {'save s':>7s} {'checksums s after':>18s} {'verify s':>9s}")
        for repeat in range(1, args.repeats + 1):
            start = time.perf_counter()
            path = checkpointing.write_checkpoint(
                folder, repeat, state, train_state={}, args={}, model_config=preset("gpt-tiny")
            )
            saved = time.perf_counter()
            checkpointing.wait_for_checksums()
            hashed = time.perf_counter()
            checkpointing.verify_checkpoint(path)
            verified = time.perf_counter()
            size = sum(p.stat().st_size for p in path.iterdir() if p.is_file()) / 2**30
            print(
                f"{size:5.2f} {saved - start:7.2f} {hashed - saved:18.2f} {verified - hashed:9.2f}"
            )
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
