"""--enable-cuda-graph on the GPU: a run whose layers replay CUDA graphs equals the eager run bit
for bit (losses and every parameter), with FP8 delayed, current, rowwise and blockwise scaling, gradient
accumulation, the per-step weight cast, recomputation and dropout, on one GPU and under tensor
(with sequence), data and pipeline parallelism (1F1B, interleaved) on two. (Start-up refusals
are in test_arguments.py.)"""

import pytest
import torch
from megafp8.parallel.cuda_graphs import LayerGraphs

from megafp8.training.trainer import pretrain

from ..multiprocess import run_on_ranks

pytestmark = pytest.mark.gpu

# Four micro-batches per step; a log step every other step, whose first micro-batch counts FP8
# saturation (a second set of graphs).
BASE = [
    "--model",
    "gpt-tiny",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "5",
    "--lr",
    "3e-3",
    "--lr-warmup-iters",
    "2",
    "--log-interval",
    "2",
    "--seed",
    "7",
    "--mock-data",
    "--eval-iters",
    "0",
    "--bf16",
]
GRAPHED = ["--enable-cuda-graph", "--cuda-graph-warmup-steps", "1"]


def run(argv):
    trainer = pretrain(argv)
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return trainer, trainer.history, params


@pytest.mark.parametrize(
    "extra",
    [
        ["--fp8-format", "hybrid"],
        ["--fp8-format", "hybrid", "--fp8-recipe", "current"],
        ["--fp8-format", "hybrid", "--recompute-granularity", "selective"],
        ["--fp8-format", "hybrid", "--fp8-recipe", "current", "--recompute-granularity", "full"],
        ["--fp8-format", "hybrid", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"],
        ["--fp8-format", "e4m3", "--fp8-interval", "2", "--fp8-amax-compute-algo", "most_recent"],
        ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
        [
            "--fp8-format",
            "e4m3",
            "--fp8-recipe",
            "blockwise",
            "--hidden-size",
            "256",
            "--ffn-hidden-size",
            "1024",
        ],
        [],  # bf16
    ],
    ids=[
        "delayed",
        "current",
        "delayed-selective",
        "current-full",
        "delayed-dropout",
        "e4m3-interval",
        "rowwise",
        "blockwise",
        "bf16",
    ],
)
def test_graphed_training_equals_eager_bitwise(extra):
    _, eager, eager_params = run(BASE + extra)
    trainer, graphed, graphed_params = run(BASE + extra + GRAPHED)
    assert trainer.captured_graphs[0]["graph sets"], "the layers were not graphed"
    assert graphed == eager
    for name, value in eager_params.items():
        assert torch.equal(graphed_params[name], value), name


def two_gpu_body(rank, world_size, extra):
    """Eager then graphed on both ranks: losses and this rank's parameters."""
    _, eager, eager_params = run(BASE + extra)
    trainer, graphed, graphed_params = run(BASE + extra + GRAPHED)
    graphs = trainer.captured_graphs  # what the run captured, recorded as it released them
    assert len(graphs) == len(trainer.chunks) and all(g["graph sets"] for g in graphs), (
        "the layers were not graphed"
    )
    # the first stage: micro-batches in flight
    if "--pipeline-model-parallel-size" in extra and rank == 0:
        assert all(g["slots"] > 1 for g in graphs)
    return eager, graphed, eager_params, graphed_params


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(
    "extra",
    [
        ["--fp8-format", "hybrid", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
        [
            "--fp8-format",
            "hybrid",
            "--fp8-recipe",
            "current",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        [
            "--fp8-format",
            "hybrid",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--tp-comm-overlap",
        ],
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--tp-comm-overlap",
        ],  # bf16: async reduce-scatter
        ["--fp8-format", "hybrid", "--tensor-model-parallel-size", "2"],
        [
            "--fp8-format",
            "hybrid",
            "--use-distributed-optimizer",
        ],  # dp 2: the buckets launched after each replay
        [
            "--fp8-format",
            "hybrid",
            "--use-distributed-optimizer",
            "--overlap-param-gather",
        ],  # waited before each replay
        ["--fp8-format", "hybrid", "--pipeline-model-parallel-size", "2"],
        [
            "--fp8-format",
            "hybrid",
            "--fp8-recipe",
            "current",
            "--pipeline-model-parallel-size",
            "2",
            "--recompute-granularity",
            "selective",
        ],
        ["--pipeline-model-parallel-size", "2"],  # bf16
        [
            "--fp8-format",
            "hybrid",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers",
            "4",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ],
    ],
    ids=[
        "tp2-sp-delayed",
        "tp2-sp-current",
        "tp2-sp-overlap-delayed",
        "tp2-sp-overlap-bf16",
        "tp2-delayed",
        "dp2-delayed",
        "dp2-overlap-param-gather-delayed",
        "pp2-delayed",
        "pp2-current-selective",
        "pp2-bf16",
        "pp2-vpp2-delayed",
    ],
)
def test_graphed_tensor_data_and_pipeline_parallel_equal_eager_bitwise(extra):
    """The sequence-parallel gathers and reduce-scatters replay inside the graphs; the amax
    reduction over tp, the gradient buckets over dp and the pipeline's sends run eagerly around
    them. A pipeline stage keeps several micro-batches in flight, each in its own graphs' slot,
    and only the step's first backward overwrites the gradient buffer."""
    for eager, graphed, eager_params, graphed_params in run_on_ranks(
        two_gpu_body, 2, extra, backend="nccl"
    ):
        # a first pipeline stage logs NaN losses (the last has them)
        assert repr(graphed) == repr(eager)
        for name, value in eager_params.items():
            assert torch.equal(graphed_params[name], value), name


def test_an_input_gradient_handed_out_survives_its_slots_next_forward():
    """A micro-batch's input gradient leaves the graphs as a copy: a pipeline sends it to the
    previous stage on NCCL's stream while the same slot already replays the next micro-batch's
    forward, whose temporaries may sit where the backward graph wrote that gradient."""
    torch.manual_seed(0)
    hidden = 1024
    mlp = torch.nn.Sequential(
        torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)
    ).cuda()
    for p in mlp.parameters():
        p.main_grad = torch.zeros_like(p)
    graphs = LayerGraphs([(lambda x: x + mlp(x), mlp)])
    inputs = [torch.randn(512, hidden, device="cuda", requires_grad=True) for _ in range(4)]
    handed_out = []
    for x in inputs:  # one micro-batch at a time: each takes slot 0 again
        for p in mlp.parameters():  # each a step's first, so every call has one signature
            p.main_grad_empty = True
        graphs(x).backward(torch.randn(512, hidden, device="cuda"))
        handed_out.append((x.grad, x.grad.clone()))
    torch.cuda.synchronize()
    assert len(graphs.pools) == 1 and len(graphs.sets) == 1, "one slot, one set expected"
    for grad, at_hand_out in handed_out:
        assert torch.equal(grad, at_hand_out)
