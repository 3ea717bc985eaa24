#!/usr/bin/env bash
# Llama-2-7B (32 layers, hidden 4096, 32 heads, SwiGLU, RoPE, RMSNorm) with FP8 HYBRID delayed
# scaling on one node: 4 pipeline stages, data parallel over the rest (the distributed optimizer
# wherever DP > 1, as in every recipe) and selective recomputation. Pipeline rather than tensor
# parallelism because FP8 keeps its gain there (1.27x bf16 at pp 4 x dp 2 on 8 H200s, 0.76x at
# tp 2 x pp 2 x dp 2: docs/tuning.md).
# Sizes come from the environment (GPUS TP PP VPP MBS GBS SEQ ITERS LR MIN_LR WARMUP PRECISION
# FP8_RECIPE WORKDIR SAVE LOG_INTERVAL EXTRA_ARGS; see examples/pretrain_fp8.sh); data from
# DATA_PATH + TOKENIZER_MODEL or, when unset, the embedded sample corpus, prepared under $WORKDIR.
#   GPUS=8 bash examples/pretrain_llama2_7b_fp8.sh                           # pp 4 x dp 2
#   GPUS=8 TP=2 PP=2 bash examples/pretrain_llama2_7b_fp8.sh                  # another layout
#   PRECISION=bf16 ITERS=50 bash examples/pretrain_llama2_7b_fp8.sh           # the bf16 baseline
#   FP8_RECIPE=current bash examples/pretrain_llama2_7b_fp8.sh                # current scaling
set -euo pipefail
GPUS=${GPUS:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
# 16 micro-batches per pipeline: 1F1B's bubble (pp - 1) / (micro-batches + pp - 1) is 16% at pp 4.
export GPUS TP=${TP:-1} PP=${PP:-$((GPUS < 4 ? GPUS : 4))} MBS=${MBS:-1}
export GBS=${GBS:-$((MBS * GPUS / (TP * PP) * 16))} SEQ=${SEQ:-4096} LR=${LR:-3e-4} MIN_LR=${MIN_LR:-3e-5}
export WORKDIR=${WORKDIR:-runs/llama2_7b_fp8}
MODEL=llama2-7b SAMPLE_VOCAB=32000 MODEL_ARGS="--recompute-granularity selective" \
    RECIPE=$0 exec bash "$(dirname "$0")/pretrain_fp8.sh"
