#!/usr/bin/env bash
# GPT-1.3B (24 layers, hidden 2048, 16 heads) with FP8 HYBRID delayed scaling on one node.
# Sizes come from the environment (GPUS TP PP VPP MBS GBS SEQ ITERS LR MIN_LR WARMUP PRECISION
# FP8_RECIPE WORKDIR SAVE LOG_INTERVAL EXTRA_ARGS; see examples/pretrain_fp8.sh); data from
# DATA_PATH + TOKENIZER_MODEL or, when unset, the embedded sample corpus, prepared under $WORKDIR.
#   GPUS=8 TP=1 PP=1 bash examples/pretrain_gpt_1b_fp8.sh
#   PRECISION=bf16 ITERS=50 bash examples/pretrain_gpt_1b_fp8.sh           # the bf16 baseline
#   FP8_RECIPE=current bash examples/pretrain_gpt_1b_fp8.sh                # current scaling
set -euo pipefail
export SEQ=${SEQ:-2048} WORKDIR=${WORKDIR:-runs/gpt_1b_fp8}
# Learned positions: the table is as long as the sequence.
MODEL=gpt-1.3b SAMPLE_VOCAB=32768 MODEL_ARGS="--max-position-embeddings $SEQ" \
    RECIPE=$0 exec bash "$(dirname "$0")/pretrain_fp8.sh"
