"""Probe: graphed vs eager under pipeline layouts with half-layer stages; which parameters differ."""
import sys
import torch
from megafp8.training.trainer import pretrain
from tests.multiprocess import run_on_ranks
from tests.training.test_cuda_graphs import BASE, GRAPHED


def run(argv):
    trainer = pretrain(argv)
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return trainer.history, params


def body(rank, world_size, extra):
    eager, ep = run(BASE + extra)
    graphed, gp = run(BASE + extra + GRAPHED)
    bad = [n for n, v in ep.items() if not torch.equal(gp[n], v)]
    return repr(eager), repr(graphed), bad, list(ep)


CASES = {
    "pp4-halves-delayed": (4, ["--fp8-format", "hybrid", "--pipeline-model-parallel-size", "4", "--num-layers", "4", "--decoder-first-pipeline-num-layers", "1.5", "--decoder-last-pipeline-num-layers", "0.5"]),
    "pp4-halves-current": (4, ["--fp8-format", "hybrid", "--fp8-recipe", "current", "--pipeline-model-parallel-size", "4", "--num-layers", "4", "--decoder-first-pipeline-num-layers", "1.5", "--decoder-last-pipeline-num-layers", "0.5"]),
    "pp4-halves-bf16": (4, ["--pipeline-model-parallel-size", "4", "--num-layers", "4", "--decoder-first-pipeline-num-layers", "1.5", "--decoder-last-pipeline-num-layers", "0.5"]),
    "pp4-whole-delayed": (4, ["--fp8-format", "hybrid", "--pipeline-model-parallel-size", "4", "--num-layers", "4"]),
    "pp2-first1.5-delayed": (2, ["--fp8-format", "hybrid", "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--decoder-first-pipeline-num-layers", "1.5"]),
    "pp2-first2.5-delayed": (2, ["--fp8-format", "hybrid", "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--decoder-first-pipeline-num-layers", "2.5"]),
    "pp2-first3.5-delayed": (2, ["--fp8-format", "hybrid", "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--decoder-first-pipeline-num-layers", "3.5"]),
}

if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        ranks, extra = CASES[name]
        try:
            results = run_on_ranks(body, ranks, extra, backend="nccl")
        except Exception as e:
            print(f"{name}: ERROR {str(e)[-2000:]}")
            continue
        for rank, (eager, graphed, bad, names) in enumerate(results):
            same = eager == graphed
            print(f"{name} rank {rank}: losses {'equal' if same else 'DIFFER'}; {len(bad)}/{len(names)} params differ: {bad[:12]}")
            if not same:
                print("   eager  ", eager[:300]); print("   graphed", graphed[:300])
        sys.stdout.flush()
