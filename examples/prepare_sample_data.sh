#!/usr/bin/env bash
# Prepare the embedded default data under WORKDIR: the SlimPajama-format sample corpus (built from
# the Python standard library; a stand-in, not SlimPajama), a byte-level BPE tokenizer of
# VOCAB_SIZE tokens trained on it, and the indexed dataset WORKDIR/data/sample_text_document.
#   Usage: bash examples/prepare_sample_data.sh WORKDIR [VOCAB_SIZE]     (VOCAB_SIZE default 8192)
# Steps already done are kept, so a re-run is quick. A step is done when the file its tool moves
# into place last exists (each tool writes under temporary names first): the corpus's README.txt,
# tokenizer.json, the dataset's .idx. An interrupted step leaves no such file and runs again; the
# tools refuse to replace what is there, so nothing is overwritten behind anyone's back.
set -euo pipefail
WORKDIR=${1:?usage: bash examples/prepare_sample_data.sh WORKDIR [VOCAB_SIZE]}
VOCAB=${2:-8192}
mkdir -p "$WORKDIR"
WORKDIR=$(CDPATH= cd -- "$WORKDIR" && pwd)  # relative to where it was called from, not the repository
cd "$(dirname "$0")/.."

kept() {
    echo "prepare_sample_data: kept $1 from an earlier run" \
         "(to redo a step, delete its output and the later steps' too)"
}

if [ -f "$WORKDIR/corpus/README.txt" ]; then kept "$WORKDIR/corpus"
else python tools/make_sample_corpus.py --output "$WORKDIR/corpus"; fi

if [ -f "$WORKDIR/tokenizer/tokenizer.json" ]; then kept "$WORKDIR/tokenizer"
else python tools/train_tokenizer.py --input "$WORKDIR/corpus" --type bpe --vocab-size "$VOCAB" \
    --output "$WORKDIR/tokenizer"; fi

if [ -f "$WORKDIR/data/sample_text_document.idx" ]; then kept "$WORKDIR/data/sample_text_document.{bin,idx}"
else python tools/preprocess_data.py --input "$WORKDIR/corpus" --output-prefix "$WORKDIR/data/sample" \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$WORKDIR/tokenizer" --append-eod --workers 2; fi
