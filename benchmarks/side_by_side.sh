#!/usr/bin/env bash
# megafp8 beside its peer on one GPU, same shapes, in one run (benchmarks/RESULTS.md, "Against
# the peer on one GPU"): megafp8's trainer in bf16, FP8 delayed (amax history 1024, max) and FP8
# current, with CUDA graphs as the recipes ship, against benchmarks/peer_gpt.py, plain PyTorch +
# torch.compile in bf16 and with torchao's float8 tensorwise training. The ratios are what it
# measures: absolute tokens/s move between machines and runs.
#
#   bash benchmarks/side_by_side.sh 1b   # GPT-1.3B, sequence 2048, micro-batch 8
#   bash benchmarks/side_by_side.sh 7b   # 8 layers of hidden 4096, FFN 16384, 32 heads; sequence 4096, micro-batch 2
#
# Mock data, one micro-batch per optimizer step. megafp8: 20 iterations, the tokens/s of the last
# logging window (11-20; the graphs are captured before it); the peer: 12 steps timed after 4
# warm-up ones (compilation). Each run appends its JSON line to $RESULTS/<shape>.jsonl (RESULTS,
# relative to the checkout, defaults to benchmarks/results/one_gpu/<date>_side_by_side) and leaves its
# output in $RESULTS/<shape>_<run>.log; the table of tokens/s and ratios is printed and saved as
# $RESULTS/<shape>.md. EXTRA="...": more trainer flags, and NAME their runs' name in the table
# (a second call into the same RESULTS adds them beside the first call's runs); PRECISIONS: megafp8's runs (default
# "bf16 delayed current"; also rowwise, blockwise); PEER_VARIANTS: the peer's variants (default
# "bf16_compile float8_tensorwise"; float8_rowwise beside rowwise; "" for none); RUN_TIMEOUT: seconds per run (default 600).
# No internet needed: the peer uses whatever torchao imports (pip install 'megafp8[peer]', or its
# wheel); a run that fails shows as "not run" in the table, and the script then exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
SHAPE=${1:-1b}
RESULTS=${RESULTS:-benchmarks/results/one_gpu/$(date +%Y-%m-%d)_side_by_side}
PRECISIONS=${PRECISIONS:-"bf16 delayed current"}
PEER_VARIANTS=${PEER_VARIANTS-"bf16_compile float8_tensorwise"}
RUN_TIMEOUT=${RUN_TIMEOUT:-600}
EXTRA=${EXTRA:-}
NAME=${NAME:-}

if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -eq 0 ]; then
    echo "side_by_side.sh: needs an NVIDIA GPU, and this machine has none (torch sees no CUDA device)." >&2
    echo "On a CPU only the peer runs, with its sizes shrunk: python benchmarks/peer_gpt.py --device cpu --help" >&2
    exit 1
fi
# The trainer's flags for the peer's shape: one definition of the shapes for both.
SHAPE_FLAGS=$(python benchmarks/peer_gpt.py --shape "$SHAPE" --trainer-flags)

mkdir -p "$RESULTS"
OUT=$RESULTS/$SHAPE.jsonl
FAILED=()
# run NAME COMMAND...: the command's output to its log; a failure is noted and the next run goes on.
run() {
    local name=$1 log=$RESULTS/${SHAPE}_$1.log
    shift
    echo "### $name" >&2
    if ! timeout "$RUN_TIMEOUT" "$@" > "$log" 2>&1; then
        FAILED+=("$name")
        tail -n 3 "$log" >&2
    fi
}
for precision in $PRECISIONS; do
    # shellcheck disable=SC2086  # SHAPE_FLAGS and EXTRA are word lists on purpose
    run "megafp8_$precision${NAME:+_${NAME//[^A-Za-z0-9]/_}}" python -m torch.distributed.run --standalone --nproc-per-node 1 \
        benchmarks/bench_layouts.py --output "$OUT" --label "$SHAPE${NAME:+, $NAME}" --precisions "$precision" -- \
        $SHAPE_FLAGS --bf16 --enable-cuda-graph --train-iters 20 --log-interval 10 --lr 1e-4 --mock-data $EXTRA
done
for variant in $PEER_VARIANTS; do
    run "peer_$variant" python benchmarks/peer_gpt.py --shape "$SHAPE" --variant "$variant" --output "$OUT"
done

[ -s "$OUT" ] && python benchmarks/side_by_side_table.py "$OUT" | tee "$RESULTS/$SHAPE.md"
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "side_by_side.sh: ${FAILED[*]} failed (logs in $RESULTS)" >&2
    exit 1
fi
