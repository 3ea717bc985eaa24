#!/usr/bin/env bash
# Prepare the embedded default data under $1: the SlimPajama-format sample corpus (built from
# the Python standard library; a stand-in, not SlimPajama), a byte-level BPE tokenizer of $2
# tokens trained on it, and the indexed dataset $1/data/sample_text_document. Steps already
# done are skipped.  Usage: bash examples/prepare_sample_data.sh WORKDIR [VOCAB_SIZE]
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR=$1; VOCAB=${2:-8192}
mkdir -p "$WORKDIR"
[ -d "$WORKDIR/corpus" ] || python tools/make_sample_corpus.py --output "$WORKDIR/corpus"
[ -f "$WORKDIR/tokenizer/tokenizer.json" ] || python tools/train_tokenizer.py --input "$WORKDIR/corpus" \
    --type bpe --vocab-size "$VOCAB" --output "$WORKDIR/tokenizer"
[ -f "$WORKDIR/data/sample_text_document.idx" ] || python tools/preprocess_data.py \
    --input "$WORKDIR/corpus" --output-prefix "$WORKDIR/data/sample" --tokenizer-type HuggingFaceTokenizer \
    --tokenizer-model "$WORKDIR/tokenizer" --append-eod --workers 2
