#!/usr/bin/env bash
# The whole pipeline on whatever machine this is (CPU: a few minutes): build the sample corpus,
# train a tokenizer on it, preprocess it into an indexed dataset, pretrain a small GPT with FP8
# (HYBRID, delayed scaling), save a checkpoint. Everything goes under $WORKDIR. Run it again and
# it resumes from its checkpoint (with a larger ITERS it trains on; with the same, nothing to do).
#   bash examples/quickstart.sh                 # defaults
#   WORKDIR=/tmp/qs ITERS=300 bash examples/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${WORKDIR:-quickstart_run}
ITERS=${ITERS:-150}
NPROC=${NPROC:-1}
if ! [[ $ITERS =~ ^[1-9][0-9]*$ ]]; then
    echo "quickstart.sh: ITERS=$ITERS: give the number of training iterations (e.g. ITERS=150)" >&2
    exit 2
fi
CHECKPOINTS="$WORKDIR/checkpoints"

PRECISION=()
if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    PRECISION=(--bf16)  # bf16 parameters on a GPU; on the CPU fp32 parameters, FP8 GEMMs either way
fi
ARGS=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128
      --max-position-embeddings 128 --micro-batch-size 8 --global-batch-size 16
      --train-iters "$ITERS" --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters "$((ITERS / 10))" --lr-decay-style cosine
      --weight-decay 0.1 --clip-grad 1.0 "${PRECISION[@]}" --fp8-format hybrid --fp8-recipe delayed
      --data-path "$WORKDIR/data/sample_text_document" --split 98,2,0
      --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$WORKDIR/tokenizer"
      --log-interval 10 --eval-interval 50 --eval-iters 2
      --save "$CHECKPOINTS" --load "$CHECKPOINTS" --save-interval 100)
# The trainer's checks of the flags before anything is prepared or launched: a mistake is one line,
# exit status 2.
WORLD_SIZE=$NPROC python -m megafp8.train --check-args "${ARGS[@]}" >/dev/null

# Said here in the terms of this script (the trainer would name its flag, --train-iters).
LATEST=$(cat "$CHECKPOINTS/latest_checkpointed_iteration.txt" 2>/dev/null || true)
if [[ $LATEST =~ ^[0-9]+$ ]] && [ "$LATEST" -ge "$ITERS" ]; then
    echo "nothing to do: the checkpoint in $CHECKPOINTS is at iteration $LATEST and ITERS is $ITERS;" \
         "set a larger ITERS to train further, e.g. ITERS=$((LATEST + 150)) bash examples/quickstart.sh"
    exit 0
fi

echo "== 1/2 sample corpus (SlimPajama format, from the Python standard library), tokenizer, indexed dataset"
bash examples/prepare_sample_data.sh "$WORKDIR" 4096

echo "== 2/2 pretraining a 4-layer GPT with FP8"
torchrun --standalone --nproc-per-node "$NPROC" -m megafp8.train "${ARGS[@]}"

echo
echo "corpus:      $WORKDIR/corpus"
echo "tokenizer:   $WORKDIR/tokenizer/tokenizer.json"
echo "dataset:     $WORKDIR/data/sample_text_document.{bin,idx}"
echo "checkpoint:  $CHECKPOINTS (latest: $(cat "$CHECKPOINTS/latest_checkpointed_iteration.txt"))"
echo "metrics:     $CHECKPOINTS/metrics.jsonl"
