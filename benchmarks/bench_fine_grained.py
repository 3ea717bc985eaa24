"""Fine-grained scaling on one GPU, piece by piece: what each GEMM granularity costs, what its
casts cost (eager torch against the fused kernels), and an Fp8Linear step under each recipe.

    python benchmarks/bench_fine_grained.py [--model 7b|1b] [--tokens 8192] [--json out.json]

- gemms: each linear's three GEMMs (fprop, dgrad, wgrad) in bf16, tensorwise FP8 (fast
  accumulation in fprop, as the delayed recipe runs them), rowwise and blockwise scaling;
- casts: an activation cast for both of its GEMMs (rows and transposed columns), torch against
  megafp8.fp8.fine_grained_kernels; the output gradient's, plain, summing its columns (the bias
  gradient, beside torch's sum) and counting saturation; and the weight's cast;
- activations: the MLP's activation and the pair cast of its output, and of its gradient, in
  the cast's read (neighbour fusion) against the torch op followed by the cast;
- layers: one linear's forward + backward, captured in a CUDA graph, in bf16 and under the
  delayed, rowwise and blockwise recipes (the speed-up over bf16 each).
Times are medians of CUDA-event timings (triton.testing.do_bench).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_fp8_linear import graphed, layer_step, ms

from megafp8 import BlockwiseScaling, DelayedScaling, Fp8Linear, RowwiseScaling
from megafp8.fp8 import activation_kernels, fine_grained_kernels
from megafp8.fp8.fine_grained import blockwise_gemm, quantize_blocks, rowwise_gemm
from megafp8.fp8.gemm import fp8_gemm
from megafp8.fp8.quantize import quantize

# (in, out) of each linear: QKV, attention projection, fc1, fc2
MODELS = {
    "7b": [(4096, 12288), (4096, 4096), (4096, 16384), (16384, 4096)],
    "1b": [(2048, 6144), (2048, 2048), (2048, 8192), (8192, 2048)],
}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {
    "delayed": DelayedScaling(),
    "rowwise": RowwiseScaling(),
    "blockwise": BlockwiseScaling(),
}
ACTIVATIONS = ("gelu_tanh", "gelu", "swiglu")  # the GPT presets' GELU is the tanh form


def gemm_times(tokens, k, n):
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    times = {
        "bf16": [ms(lambda: x @ w.t()), ms(lambda: dy @ w), ms(lambda: dy.t() @ x)],
    }
    qx, qw, qdy = (quantize(t, E4M3, columnwise=True) for t in (x, w, dy))
    times["tensorwise"] = [
        ms(
            lambda: fp8_gemm(
                qx.data, qw.data, qx.scale_inv, qw.scale_inv, torch.bfloat16, fast_accum=True
            )
        ),
        ms(lambda: fp8_gemm(qdy.data, qw.data_t, qdy.scale_inv, qw.scale_inv, torch.bfloat16)),
        ms(lambda: fp8_gemm(qdy.data_t, qx.data_t, qdy.scale_inv, qx.scale_inv, torch.bfloat16)),
    ]
    pair = fine_grained_kernels.quantize_pair
    for name, gemm, blockwise in (
        ("rowwise", rowwise_gemm, False),
        ("blockwise", blockwise_gemm, True),
    ):
        (rx, rxt), (rdy, rdyt) = pair(x, E4M3, blockwise), pair(dy, E4M3, blockwise)
        rw, rwt = (
            fine_grained_kernels.quantize_squares(w, E4M3) if blockwise else pair(w, E4M3, False)
        )
        times[name] = [
            ms(lambda: gemm(rx, rw, torch.bfloat16)),
            ms(lambda: gemm(rdy, rwt, torch.bfloat16)),
            ms(lambda: gemm(rdyt, rxt, torch.bfloat16)),
        ]
    return times


def cast_times(tokens, k, n):
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    row = {"tensorwise_fused": ms(lambda: quantize(x, E4M3, columnwise=True))}
    for name, blockwise, block in (("rowwise", False, (1, None)), ("blockwise", True, (1, 128))):
        row[f"{name}_torch"] = ms(
            lambda: (quantize_blocks(x, E4M3, block), quantize_blocks(x.t(), E4M3, block))
        )
        row[f"{name}_fused"] = ms(lambda: fine_grained_kernels.quantize_pair(x, E4M3, blockwise))
    # the output gradient's pair cast as backward runs it: plain, summing its columns (the bias
    # gradient; torch's separate sum beside), and counting saturation (a log step)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    sums = torch.empty(n, device="cuda")
    counts = torch.zeros(3, device="cuda", dtype=torch.int64)
    row["bias_sum_torch"] = ms(lambda: torch.sum(dy, dim=0, dtype=torch.float32, out=sums))
    for name, blockwise in (("rowwise", False), ("blockwise", True)):
        for extra, kwargs in (
            ("", {}),
            ("_col_sums", {"col_sum_out": sums}),
            ("_counts", {"saturation_out": counts}),
        ):
            row[f"grad_{name}{extra}"] = ms(
                lambda: fine_grained_kernels.quantize_pair(dy, E4M3, blockwise, **kwargs)
            )
    row["weight_squares_torch"] = ms(lambda: quantize_blocks(w, E4M3, (128, 128)))
    row["weight_squares_fused"] = ms(lambda: fine_grained_kernels.quantize_squares(w, E4M3))
    row["bytes_pair"] = x.numel() * (2 + 2)  # read bf16 once, write two FP8 copies
    row["pair_fused_TBps"] = row["bytes_pair"] / row["blockwise_fused"] / 1e9
    return row


def activation_times(tokens, ffn):
    """The MLP's activation and the pair cast of its output (forward) or of its gradient
    (backward), computed in the cast's read (fused) against the torch op and then the cast."""
    pair = fine_grained_kernels.quantize_pair
    row = {}
    for kind in ACTIVATIONS:
        width = 2 * ffn if kind == "swiglu" else ffn
        h = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        dout = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16)
        sums = torch.empty(width, device="cuda")
        for name, blockwise in (("rowwise", False), ("blockwise", True)):
            row[f"{kind}_{name}_forward_unfused"] = ms(
                lambda: pair(activation_kernels.activation_torch(h, kind), E4M3, blockwise)
            )
            row[f"{kind}_{name}_forward_fused"] = ms(
                lambda: pair(h, E4M3, blockwise, activation=kind)
            )
            row[f"{kind}_{name}_backward_unfused"] = ms(
                lambda: pair(
                    activation_kernels.activation_backward_torch(dout, h, kind),
                    E4M3,
                    blockwise,
                    col_sum_out=sums,
                )
            )
            row[f"{kind}_{name}_backward_fused"] = ms(
                lambda: pair(
                    dout, E4M3, blockwise, col_sum_out=sums, activation=kind, activation_input=h
                )
            )
    return row


def layer_times(tokens, k, n):
    torch.manual_seed(0)
    base = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear(k, n, device="cuda", dtype=torch.bfloat16)
    layer.load_state_dict(base.state_dict(), strict=False)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    row = {"bf16": ms(graphed(layer_step(base, x, dy, None)))}
    for name, recipe in RECIPES.items():
        row[name] = ms(graphed(layer_step(layer, x, dy, recipe)))
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="7b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--json", help="write all figures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_fine_grained needs a CUDA GPU")
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": args.tokens,
        "model": args.model,
        "linears": [],
    }
    print(f"{results['device']}, torch {results['torch']}, {args.tokens} tokens, {args.model}")
    print(
        "ms           | GEMMs: bf16  tensor  row   block | casts: row torch/fused  block torch/fused"
        " | layer graphed: bf16 delayed row block (x bf16)"
        " | output gradient's block cast: plain +sums +counts, torch sum"
    )
    for k, n in MODELS[args.model]:
        gemms, casts, layers = (f(args.tokens, k, n) for f in (gemm_times, cast_times, layer_times))
        results["linears"].append(
            {"in": k, "out": n, "gemms": gemms, "casts": casts, "layers": layers}
        )
        total = {name: sum(t) for name, t in gemms.items()}
        print(
            f"{k:>5}->{n:<6} | {total['bf16']:6.3f} {total['tensorwise']:6.3f} "
            f"{total['rowwise']:6.3f} {total['blockwise']:6.3f} | "
            f"{casts['rowwise_torch']:6.3f}/{casts['rowwise_fused']:6.3f} "
            f"{casts['blockwise_torch']:6.3f}/{casts['blockwise_fused']:6.3f} | "
            + " ".join(
                f"{layers[name]:6.3f}"
                + ("" if name == "bf16" else f" ({layers['bf16'] / layers[name]:.2f}x)")
                for name in ("bf16", *RECIPES)
            )
            + " | "
            + " ".join(
                f"{casts[key]:6.3f}"
                for key in (
                    "grad_blockwise",
                    "grad_blockwise_col_sums",
                    "grad_blockwise_counts",
                    "bias_sum_torch",
                )
            )
        )
    ffn = MODELS[args.model][-1][0]
    results["activations"] = activation_times(args.tokens, ffn)
    print(f"the MLP's activation and its pair cast, [{args.tokens}, {ffn}], ms unfused / fused:")
    for kind in ACTIVATIONS:
        for name in ("rowwise", "blockwise"):
            print(
                f"  {kind:9} {name:9} "
                + "  ".join(
                    f"{way} {results['activations'][f'{kind}_{name}_{way}_unfused']:6.3f} / "
                    f"{results['activations'][f'{kind}_{name}_{way}_fused']:6.3f}"
                    for way in ("forward", "backward")
                )
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
