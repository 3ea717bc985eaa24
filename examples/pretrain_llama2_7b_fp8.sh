#!/usr/bin/env bash
# Llama-2-7B (32 layers, hidden 4096, 32 heads, SwiGLU, RoPE, RMSNorm) with FP8 HYBRID delayed
# scaling on one node, tensor parallel 2, selective recomputation and the distributed optimizer.
# Sizes come from the environment (GPUS TP PP MBS GBS SEQ ITERS LR MIN_LR WARMUP PRECISION
# FP8_RECIPE WORKDIR SAVE LOG_INTERVAL EXTRA_ARGS; see examples/pretrain_fp8.sh); data from
# DATA_PATH + TOKENIZER_MODEL or, when unset, the embedded sample corpus, prepared under $WORKDIR.
#   GPUS=8 TP=2 PP=1 bash examples/pretrain_llama2_7b_fp8.sh
#   PRECISION=bf16 ITERS=50 bash examples/pretrain_llama2_7b_fp8.sh           # the bf16 baseline
#   FP8_RECIPE=current bash examples/pretrain_llama2_7b_fp8.sh                # current scaling
set -euo pipefail
export TP=${TP:-2} MBS=${MBS:-1} SEQ=${SEQ:-4096} LR=${LR:-3e-4} MIN_LR=${MIN_LR:-3e-5}
export WORKDIR=${WORKDIR:-runs/llama2_7b_fp8}
MODEL=llama2-7b SAMPLE_VOCAB=32000 MODEL_ARGS="--recompute-granularity selective --use-distributed-optimizer" \
    exec bash "$(dirname "$0")/pretrain_fp8.sh"
