"""The parallel-layout planner's models (`tools/plan_parallel.py`): which layouts of a model fit a
cluster and how fast each would train.

- `megafp8.planner.memory`: what a rank of a layout holds, by kind, from the model's shape
  (`MemoryLayout`, `estimate`);
- `megafp8.planner.throughput`: a layout's step time and tokens/s per GPU from measurements
  (`Calibration`, `predict`, `NotPredicted`);
- `megafp8.planner.layer_map`: the format of the layer maps `benchmarks/bench_layer_grid.py`
  measures and the throughput model reads.

Nothing in the trainer depends on it: it reads the models' configurations and the parallel
engines' rules (stages, buckets), and the trainer's arguments reach it through `tools/`.
"""

from .memory import MemoryLayout, estimate
from .throughput import Calibration, NotPredicted, predict

__all__ = ["Calibration", "MemoryLayout", "NotPredicted", "estimate", "predict"]
