#!/usr/bin/env bash
# Llama-2-7B (32 layers, hidden 4096, 32 heads, SwiGLU, RoPE, RMSNorm) with FP8 HYBRID delayed scaling on one node.
# Sizes come from the environment; data from DATA_PATH (Megatron's --data-path syntax, with
# TOKENIZER_MODEL a tokenizer.json or its folder) or, when unset, the embedded sample corpus,
# which this script prepares itself under $WORKDIR.
#   GPUS=8 TP=1 PP=1 bash examples/pretrain_llama2_7b_fp8.sh
#   PRECISION=bf16 ITERS=50 bash examples/pretrain_llama2_7b_fp8.sh           # the bf16 baseline
#   FP8_RECIPE=current bash examples/pretrain_llama2_7b_fp8.sh                # current scaling
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS=${GPUS:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
TP=${TP:-2}; PP=${PP:-1}
MBS=${MBS:-1}; GBS=${GBS:-$((MBS * GPUS / (TP * PP) * 8))}
SEQ=${SEQ:-4096}; ITERS=${ITERS:-500}
LR=${LR:-3e-4}; MIN_LR=${MIN_LR:-3e-5}; WARMUP=${WARMUP:-$((ITERS / 10))}
PRECISION=${PRECISION:-fp8}; FP8_RECIPE=${FP8_RECIPE:-delayed}
WORKDIR=${WORKDIR:-runs/llama2_7b_fp8}
SAVE=${SAVE-$WORKDIR/checkpoints}  # SAVE= (empty): no checkpoints, for benchmarks
LOG_INTERVAL=${LOG_INTERVAL:-10}
EXTRA_ARGS=${EXTRA_ARGS:-}

if [ -z "${DATA_PATH:-}" ]; then
    # The embedded default: a SlimPajama-format sample from the Python stdlib (not SlimPajama).
    bash examples/prepare_sample_data.sh "$WORKDIR" 32000
    DATA_PATH="$WORKDIR/data/sample_text_document"
    TOKENIZER_MODEL="$WORKDIR/tokenizer"
fi

PRECISION_ARGS=(--bf16)
if [ "$PRECISION" = fp8 ]; then
    PRECISION_ARGS+=(--fp8-format hybrid --fp8-recipe "$FP8_RECIPE")
    if [ "$FP8_RECIPE" = delayed ]; then
        PRECISION_ARGS+=(--fp8-amax-history-len 1024 --fp8-amax-compute-algo max)
    fi
fi

# shellcheck disable=SC2086  # DATA_PATH and EXTRA_ARGS are word lists on purpose
torchrun --standalone --nproc-per-node "$GPUS" -m megafp8.train \
    --model llama2-7b --seq-length "$SEQ" \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    $( [ "$TP" -gt 1 ] && echo --sequence-parallel ) \
    --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS" \
    --lr "$LR" --min-lr "$MIN_LR" --lr-warmup-iters "$WARMUP" --lr-decay-style cosine \
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 --recompute-granularity selective --use-distributed-optimizer \
    "${PRECISION_ARGS[@]}" \
    --data-path $DATA_PATH --split 969,30,1 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --log-interval "$LOG_INTERVAL" --eval-interval 1000 --eval-iters 10 \
    ${SAVE:+--save "$SAVE" --save-interval 1000} $EXTRA_ARGS
