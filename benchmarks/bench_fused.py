"""The fused neighbour kernels (megafp8/fp8/norm_kernels.py, activation_kernels.py, and the QKV
gradient cast triton_kernels.quantize_heads) against the unfused ops they replace, on one GPU: microseconds per call (triton's do_bench, median).

    python benchmarks/bench_fused.py            # fused vs unfused at the GPT-1.3B, 7B and Llama-7B shapes
    python benchmarks/bench_fused.py --sweep    # the kernels' tiles and warps, best per kernel last

"counting": with the saturation counts a log step collects (`saturation_out`). Unfused means
what the layers ran before: the norm module then `quantize` (both FP8 layouts), the
activation then `quantize`, autograd's activation backward then `quantize` with the bias sums,
the q, k, v gradients concatenated then `quantize` with the bias sums.
"""

import argparse
import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from megafp8.fp8 import activation_kernels, norm_kernels
from megafp8.fp8.fused import HeadGradsSource
from megafp8.fp8.quantize import quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (label, tokens, hidden, ffn, activation): micro-batch x sequence of the side-by-side runs, with
# the models' activations (GPT: GELU's tanh form; Llama: SwiGLU) and GELU's erf form.
SHAPES = [
    ("1b", 16384, 2048, 8192, "gelu_tanh"),
    ("7b", 8192, 4096, 16384, "gelu_tanh"),
    ("1b", 16384, 2048, 8192, "gelu"),
    ("llama7b", 8192, 4096, 11008, "swiglu"),
]
# (label, tokens, query heads, key/value heads) of head_dim 128: the QKV gradient cast.
QKV_SHAPES = [("1b", 16384, 16, 16), ("7b", 8192, 32, 32), ("gqa", 8192, 32, 8)]


def microseconds(fn):
    return 1000 * do_bench(fn, warmup=25, rep=200, return_mode="median")


def inputs(tokens, hidden, ffn, kind):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    bias = (
        None
        if kind == "swiglu"
        else torch.randn(hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    )
    h = 3 * torch.randn(
        tokens,
        2 * ffn if kind == "swiglu" else ffn,
        device="cuda",
        dtype=torch.bfloat16,
        generator=g,
    )
    dout = 0.01 * torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, weight, bias, h, dout


def compare():
    scale, grad_scale = torch.tensor(20.0, device="cuda"), torch.tensor(2000.0, device="cuda")
    for label, tokens, hidden, ffn, kind in SHAPES:
        x, weight, bias, h, dout = inputs(tokens, hidden, ffn, kind)
        rms = bias is None

        def norm():
            return (
                F.rms_norm(x, (hidden,), weight, 1e-5)
                if rms
                else F.layer_norm(x, (hidden,), weight, bias, 1e-5)
            )

        y = norm()
        counts = torch.zeros(3, device="cuda", dtype=torch.int64)
        rows = [
            # what counting saturation (the trainer's log steps) adds to a cast
            ("cast", lambda: quantize(y, E4M3, scale, rowwise=True, columnwise=True)),
            (
                "cast, counting",
                lambda: quantize(
                    y, E4M3, scale, rowwise=True, columnwise=True, saturation_out=counts
                ),
            ),
            (
                "norm + cast, unfused",
                lambda: quantize(norm(), E4M3, scale, rowwise=True, columnwise=True),
            ),
            (
                "norm + cast, fused",
                lambda: norm_kernels.norm_quantize(x, weight, bias, 1e-5, rms, E4M3, scale),
            ),
            (
                f"{kind} + cast, unfused",
                lambda: quantize(
                    activation_kernels.activation_torch(h, kind),
                    E4M3,
                    scale,
                    rowwise=True,
                    columnwise=True,
                ),
            ),
            (
                f"{kind} + cast, fused",
                lambda: activation_kernels.activation_quantize(h, kind, E4M3, scale),
            ),
            (
                f"{kind} + cast, fused, counting",
                lambda: activation_kernels.activation_quantize(
                    h, kind, E4M3, scale, saturation_out=counts
                ),
            ),
            (
                f"{kind} backward + cast, unfused",
                lambda: quantize(
                    activation_kernels.activation_backward_torch(dout, h, kind),
                    E5M2,
                    grad_scale,
                    rowwise=True,
                    columnwise=True,
                    col_sum=True,
                ),
            ),
            (
                f"{kind} backward + cast, fused",
                lambda: activation_kernels.activation_backward_quantize(
                    dout, h, kind, E5M2, grad_scale, col_sum=True
                ),
            ),
        ]
        for name, fn in rows:
            print(f"{label:8s} {name:36s} {microseconds(fn):8.1f} us", flush=True)
    for label, tokens, heads, kv_heads in QKV_SHAPES:
        dq, dk, dv = (
            0.01 * torch.randn(tokens, n * 128, device="cuda", dtype=torch.bfloat16)
            for n in (heads, kv_heads, kv_heads)
        )
        source = HeadGradsSource(dq, dk, dv, 128)
        rows = [
            (
                "q, k, v grads cat + cast, unfused",
                lambda: quantize(
                    source.materialize(),
                    E5M2,
                    grad_scale,
                    rowwise=True,
                    columnwise=True,
                    col_sum=True,
                ),
            ),
            (
                "q, k, v grads cast, fused",
                lambda: source.quantize(
                    E5M2, grad_scale, rowwise=True, columnwise=True, col_sum=True
                ),
            ),
        ]
        for name, fn in rows:
            print(f"{label:8s} {name:36s} {microseconds(fn):8.1f} us", flush=True)


def sweep():
    scale, grad_scale = torch.tensor(20.0, device="cuda"), torch.tensor(2000.0, device="cuda")
    best = {}

    def record(key, config, us):
        print(f"{key:28s} {str(config):20s} {us:8.1f} us", flush=True)
        if key not in best or us < best[key][1]:
            best[key] = (config, us)

    defaults = (
        norm_kernels.BLOCK_M,
        norm_kernels.BLOCK_N,
        norm_kernels.NUM_WARPS,
        activation_kernels.FWD_BLOCK_M,
        activation_kernels.FWD_BLOCK_N,
        activation_kernels.BWD_BLOCK_M,
        activation_kernels.BWD_BLOCK_N,
        activation_kernels.NUM_WARPS,
    )
    for label, tokens, hidden, ffn, kind in SHAPES:
        x, weight, bias, h, dout = inputs(tokens, hidden, ffn, kind)
        for config in itertools.product((16, 32), (128, 256), (4, 8)):
            norm_kernels.BLOCK_M, norm_kernels.BLOCK_N, norm_kernels.NUM_WARPS = config
            record(
                f"{label} norm + cast",
                config,
                microseconds(
                    lambda: norm_kernels.norm_quantize(
                        x, weight, bias, 1e-5, bias is None, E4M3, scale
                    )
                ),
            )
        for (block_m, block_n), warps in itertools.product(
            ((32, 128), (64, 128), (64, 64), (32, 256), (128, 64)), (4, 8)
        ):
            activation_kernels.FWD_BLOCK_M, activation_kernels.FWD_BLOCK_N = block_m, block_n
            activation_kernels.BWD_BLOCK_M, activation_kernels.BWD_BLOCK_N = block_m, block_n
            activation_kernels.NUM_WARPS = warps
            config = (block_m, block_n, warps)
            record(
                f"{label} {kind} + cast",
                config,
                microseconds(lambda: activation_kernels.activation_quantize(h, kind, E4M3, scale)),
            )
            record(
                f"{label} {kind} backward + cast",
                config,
                microseconds(
                    lambda: activation_kernels.activation_backward_quantize(
                        dout, h, kind, E5M2, grad_scale, col_sum=True
                    )
                ),
            )
    (
        norm_kernels.BLOCK_M,
        norm_kernels.BLOCK_N,
        norm_kernels.NUM_WARPS,
        activation_kernels.FWD_BLOCK_M,
        activation_kernels.FWD_BLOCK_N,
        activation_kernels.BWD_BLOCK_M,
        activation_kernels.BWD_BLOCK_N,
        activation_kernels.NUM_WARPS,
    ) = defaults
    print("\nbest")
    for key, (config, us) in best.items():
        print(f"{key:28s} {str(config):20s} {us:8.1f} us")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true", help="sweep the kernels' tiles instead")
    sweep() if parser.parse_args().sweep else compare()
