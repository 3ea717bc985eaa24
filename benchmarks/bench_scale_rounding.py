"""Fine-grained scales as fitted fp32 against scales rounded down to a power of two: what each
costs the GEMMs' accuracy. No GPU needed: the FP8 casts are exact on the CPU, and each GEMM is
taken in fp64 from the dequantized operands, so the figures are the casts' error alone.

    python benchmarks/bench_scale_rounding.py [--tokens 2048] [--features 1024 4096] [--seeds 3]

For one linear (`y = x W^T`, x [tokens, in], W [out, in]) and its output gradient dy, each of its
GEMMs (fprop x W^T, dgrad dy W, wgrad dy^T x) under rowwise and blockwise scaling in E4M3, with
the scales as fitted and as powers of two: the relative error of the product against the fp64
product of the unquantized operands (Frobenius norms), and the share of nonzero operand elements
the casts flush to zero. The operands follow what transformer training shows:
- x: unit normal with outlier channels (1 in 64 input features 20x larger), as in LLM
  activations;
- W: normal with standard deviation 0.02 (the models' initialisation);
- dy: a heavy-tailed gradient, each element's magnitude log-normal (sigma 2) and each token's
  row scaled by another log-normal (sigma 1), so it spans decades within a row and across rows.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from megafp8.fp8.fine_grained import BLOCK, dequantize, quantize_blocks

E4M3 = torch.float8_e4m3fn
# Each operand's blocks under each recipe, for each GEMM: (rows, columns) of the block of the
# operand as the GEMM reads it (sums over its columns); None: a whole row.
RECIPES = {
    "rowwise": {"activation": (1, None), "weight": (1, None)},
    "blockwise": {"activation": (1, BLOCK), "weight": (BLOCK, BLOCK)},
}


def operands(tokens: int, features_in: int, features_out: int, seed: int):
    """x, W and dy as the module docstring describes them, in fp32."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features_in, generator=generator)
    x[:, ::64] *= 20
    weight = torch.randn(features_out, features_in, generator=generator) * 0.02
    magnitude = torch.exp(2 * torch.randn(tokens, features_out, generator=generator))
    row = torch.exp(torch.randn(tokens, 1, generator=generator))
    sign = torch.randint(0, 2, (tokens, features_out), generator=generator) * 2 - 1
    grad = 1e-3 * magnitude * row * sign
    return x, weight, grad


def cast(t: torch.Tensor, block, power_of_two: bool, counts: torch.Tensor) -> torch.Tensor:
    """`t` cast to E4M3 with a scale per block, and back in fp64."""
    return dequantize(quantize_blocks(t, E4M3, block, 0, counts, power_of_two)).double()


def gemms(x, weight, grad) -> dict:
    """The linear's three GEMMs: name -> (left operand, its role; right operand as the GEMM reads
    it, its role); each GEMM sums over both operands' columns."""
    return {
        "fprop": ((x, "activation"), (weight, "weight")),
        "dgrad": ((grad, "activation"), (weight.t(), "weight")),
        "wgrad": ((grad.t(), "activation"), (x.t(), "activation")),
    }


def measure(tokens: int, features: tuple[int, int], seeds: int) -> list:
    """Each recipe, scale kind and GEMM: its relative error and flushed share, means over seeds."""
    sums = {}
    for seed in range(seeds):
        for gemm, ((left, left_role), (right, right_role)) in gemms(
            *operands(tokens, *features, seed)
        ).items():
            exact = left.double() @ right.double().t()
            nonzero = int((left != 0).sum() + (right != 0).sum())
            for recipe, blocks in RECIPES.items():
                for power_of_two in (False, True):
                    counts = torch.zeros(3, dtype=torch.int64)
                    product = (
                        cast(left, blocks[left_role], power_of_two, counts)
                        @ cast(right, blocks[right_role], power_of_two, counts).t()
                    )
                    error = float(torch.linalg.norm(product - exact) / torch.linalg.norm(exact))
                    total = sums.setdefault((recipe, power_of_two, gemm), [0.0, 0.0])
                    total[0] += error / seeds
                    total[1] += int(counts[2]) / nonzero / seeds
    return [
        {
            "recipe": recipe,
            "scales": "power of two" if power_of_two else "fp32",
            "gemm": gemm,
            "error": error,
            "flushed": flushed,
        }
        for (recipe, power_of_two, gemm), (error, flushed) in sorted(
            sums.items(), key=lambda item: (list(RECIPES).index(item[0][0]), item[0][1])
        )
    ]


def markdown(rows: list) -> str:
    lines = [
        "| recipe | scales | GEMM | relative error | nonzero operand elements flushed |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['scales']} | {r['gemm']} | {r['error']:.3e} | "
            f"{100 * r['flushed']:.3f}% |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument(
        "--features", type=int, nargs=2, default=(1024, 4096), metavar=("IN", "OUT")
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    sizes = (args.tokens, *args.features)
    if any(size % BLOCK for size in sizes) or args.seeds < 1:
        parser.error(
            f"--tokens and --features must be multiples of {BLOCK} (got {sizes}), --seeds >= 1"
        )
    rows = measure(args.tokens, tuple(args.features), args.seeds)
    print(markdown(rows), end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
