#!/usr/bin/env bash
# The layout benchmark of benchmarks/RESULTS.md ("Eight GPUs"): GPT-1.3B or Llama-2-7B, bf16 and
# FP8 HYBRID (delayed and current scaling), one torchrun launch per tp:pp layout (dp fills the
# rest), on the embedded sample corpus. JSON lines go to $RESULTS, then the tables are printed.
#
#   MODEL=gpt bash benchmarks/layouts_8gpu.sh                      # the four 8-GPU layouts
#   MODEL=gpt GPUS=1 LAYOUTS=1:1 bash benchmarks/layouts_8gpu.sh   # the one-GPU reference
#   MODEL=llama LAYOUTS="2:2 1:4" PRECISIONS="bf16 delayed" bash benchmarks/layouts_8gpu.sh
#   GRAPHS=1 MODEL=gpt GPUS=2 LAYOUTS="1:1 1:2 2:1" bash benchmarks/layouts_8gpu.sh
#     GRAPHS=1: CUDA graphs (--enable-cuda-graph) for every layout, as the recipes run them
#     (before 2026-11-26 the recipes and GRAPHS=1 left pipelines eager); EXTRA="..." adds
#     trainer flags to every layout
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-gpt}; GPUS=${GPUS:-8}; LAYOUTS=${LAYOUTS:-"2:2 1:4 4:1 1:1"}
PRECISIONS=${PRECISIONS:-"bf16 delayed current"}
WORKDIR=${WORKDIR:-runs/layouts}; RESULTS=${RESULTS:-$WORKDIR/results}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast (NVLS) off unless asked: NCCL fails on hosts that lack it

bash examples/prepare_sample_data.sh "$WORKDIR" 32768
COMMON=(--data-path "$WORKDIR/data/sample_text_document" --split 969,30,1
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$WORKDIR/tokenizer"
        --eval-interval 1000 --eval-iters 10 --bf16 --weight-decay 0.1 --adam-beta2 0.95
        --clip-grad 1.0 --init-method-std 0.02 --lr-decay-style cosine)
case $MODEL in
    gpt) ARGS=(--model gpt-1.3b --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4
               --global-batch-size 64 --train-iters "${ITERS:-50}" --log-interval 10 --lr 2e-4 --min-lr 2e-5
               --lr-warmup-iters "${WARMUP:-5}") ;;
    llama) ARGS=(--model llama2-7b --seq-length 4096 --recompute-granularity selective
                 --use-distributed-optimizer --micro-batch-size 1 --global-batch-size 32
                 --train-iters "${ITERS:-10}" --log-interval 5 --lr 3e-4 --min-lr 3e-5
                 --lr-warmup-iters "${WARMUP:-1}") ;;
    *) echo "MODEL must be gpt or llama, got '$MODEL'" >&2; exit 2 ;;
esac

labels=()
for layout in $LAYOUTS; do
    IFS=: read -r tp pp <<< "$layout"
    label=$([ "$GPUS" -eq 1 ] && echo "${MODEL}_1gpu" || echo "${MODEL}_tp${tp}_pp${pp}")
    # shellcheck disable=SC2046,SC2086  # PRECISIONS is a word list; --sequence-parallel only with tp
    torchrun --standalone --nproc-per-node "$GPUS" benchmarks/bench_layouts.py --label "$label" \
        --output "$RESULTS/$label.jsonl" --precisions $PRECISIONS -- "${ARGS[@]}" "${COMMON[@]}" \
        --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp" \
        $([ "$tp" -gt 1 ] && echo --sequence-parallel) \
        $([ "${GRAPHS:-0}" = 1 ] && echo --enable-cuda-graph) \
        ${EXTRA:-}
    labels+=("$RESULTS/$label.jsonl")
done
python benchmarks/layout_tables.py "${labels[@]}" $(ls "$RESULTS/${MODEL}_1gpu.jsonl" 2>/dev/null) \
    --reference "${MODEL}_1gpu"
