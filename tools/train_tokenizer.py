"""Train a tokenizer on a corpus that megafp8.data.sources reads (jsonl, .jsonl.zst, parquet, folder, glob).

    python tools/train_tokenizer.py --input sample_corpus --type bpe --vocab-size 8192 --output tok

--type bpe: Hugging Face `tokenizers` byte-level BPE, as GPT-2 (`<|endoftext|>` special token).
    Writes tokenizer.json (--tokenizer-type HuggingFaceTokenizer) and vocab.json + merges.txt
    (--tokenizer-type GPT2BPETokenizer); both give the same ids.
--type sentencepiece: SentencePiece BPE with byte fallback, as Llama (`</s>` end of sentence).
    Writes tokenizer.model (--tokenizer-type SentencePieceTokenizer).

Training is deterministic: the same corpus and flags give byte-identical files. Existing files
are never replaced without --overwrite; the new ones are moved into place only once all are
written (tokenizer.json last), so an interrupted run leaves no tokenizer that looks finished.
"""

import argparse
import io
import itertools
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

from megafp8.data.sources import SourceError, SourceStats, iter_documents, resolve_inputs
from megafp8.data.tokenizers import build_tokenizer
from tqdm import tqdm

from megafp8.messages import show_warnings_as_messages

BPE_EOD = "<|endoftext|>"
MIN_VOCAB = 384  # the 256 bytes, the special tokens and room for merges
# The files each --type writes. Moved into place last to first: the first is what
# --tokenizer-model reads, so it appears only when the others are there.
FILES = {
    "bpe": ("tokenizer.json", "vocab.json", "merges.txt"),
    "sentencepiece": ("tokenizer.model",),
}


def _texts(args, stats):
    """The non-empty texts of every json key, document by document, behind a progress bar."""
    documents = iter_documents(
        args.input, args.json_keys, stats=stats, hf_split=args.hf_split, hf_config=args.hf_config
    )
    # islice stops before reading document N + 1, so the counts cover exactly what trained.
    documents = itertools.islice(documents, args.max_documents)
    with tqdm(
        documents,
        total=args.max_documents,
        desc="reading",
        unit="doc",
        file=sys.stderr,
        mininterval=1.0,
    ) as bar:
        for doc in bar:
            yield from (text for text in doc.texts.values() if text is not None)


def train_bpe(args, texts, folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # The same pieces from_gpt2_files assembles around vocab.json + merges.txt, so both load alike.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=[BPE_EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, seen or not
        show_progress=False,  # our bar counts documents; its own would interleave with it
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer.model.save(str(folder))  # vocab.json + merges.txt


def train_sentencepiece(args, texts, parser, folder):
    import sentencepiece

    # SentencePiece trains on sentences: give it lines (whole documents would pass its length cap).
    lines = (line for text in texts for line in text.split("\n") if line.strip())
    # Written from memory: with model_prefix the model would embed the output path, and two
    # trainings into different folders would differ.
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=lines,
            model_writer=model,
            vocab_size=args.vocab_size,
            model_type="bpe",
            byte_fallback=True,  # any text encodes without <unk>
            # Keep text as it is (code's indentation included), so decode(encode(x)) == x.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=0.9995,
            max_sentence_length=1 << 16,
            minloglevel=2,
        )
    except RuntimeError as error:
        if "Vocabulary size" in str(error):
            parser.error(f"--vocab-size {args.vocab_size} does not fit this corpus: {error}")
        raise
    (folder / "tokenizer.model").write_bytes(model.getvalue())


def main(argv=None):
    show_warnings_as_messages("train_tokenizer")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files (.jsonl, .json, .jsonl.zst, .parquet), folders, globs or a "
        "Hugging Face dataset",
    )
    parser.add_argument(
        "--type",
        choices=("bpe", "sentencepiece"),
        default="bpe",
        help="bpe: byte-level BPE as GPT-2 (default); sentencepiece: as Llama",
    )
    parser.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, e.g. 8192")
    parser.add_argument("--output", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the tokenizer files already in --output (without it they are refused)",
    )
    parser.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys whose texts train the tokenizer (default: text)",
    )
    parser.add_argument(
        "--max-documents", type=int, default=None, help="train on the first N documents only"
    )
    parser.add_argument(
        "--hf-split", default="train", help="Hugging Face dataset split (default train)"
    )
    parser.add_argument("--hf-config", default=None, help="Hugging Face dataset configuration")
    args = parser.parse_args(argv)
    if args.vocab_size < MIN_VOCAB:
        parser.error(f"--vocab-size must be at least {MIN_VOCAB}, got {args.vocab_size}")
    if args.max_documents is not None and args.max_documents < 1:
        parser.error(f"--max-documents must be at least 1, got {args.max_documents}")
    try:
        resolve_inputs(args.input)
    except SourceError as error:
        parser.error(str(error))
    files = [args.output / name for name in FILES[args.type]]
    existing = [str(path) for path in files if path.exists()]
    if existing and not args.overwrite:
        # A refusal, not a usage mistake: the message alone, without the usage text.
        parser.exit(
            2,
            f"{parser.prog}: error: {', '.join(existing)} already "
            f"{'exists' if len(existing) == 1 else 'exist'}; pass --overwrite to replace "
            "the tokenizer, or choose another --output\n",
        )
    if args.output.exists() and not args.output.is_dir():
        parser.error(f"--output {args.output} is a file; give a folder")
    args.output.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    stats = SourceStats(tuple(args.json_keys))
    texts = _texts(args, stats)
    staging = Path(tempfile.mkdtemp(prefix=".train_tokenizer-", dir=args.output))
    try:
        if args.type == "bpe":
            train_bpe(args, texts, staging)
        else:
            train_sentencepiece(args, texts, parser, staging)
        for path in reversed(files):
            os.replace(staging / path.name, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    kind = "HuggingFaceTokenizer" if args.type == "bpe" else "SentencePieceTokenizer"
    tokenizer = build_tokenizer(kind, tokenizer_model=files[0])
    elapsed = time.perf_counter() - start

    summary = {
        "type": args.type,
        "vocab_size": tokenizer.vocab_size,
        "eod": tokenizer.eod,
        "documents": stats.documents,
        "missing": dict(stats.missing),
        "empty": dict(stats.empty),
        "elapsed_s": round(elapsed, 3),
        "files": [str(path) for path in files],
    }
    print(
        f"trained {args.type} tokenizer: vocabulary {tokenizer.vocab_size}, end of document "
        f"{tokenizer.eod}, {summary['documents']} documents in {elapsed:.1f} s",
        file=sys.stderr,
    )
    for key in args.json_keys:
        if stats.missing[key] or stats.empty[key]:
            print(
                f"  {key!r}: {stats.missing[key]} missing, {stats.empty[key]} empty (skipped)",
                file=sys.stderr,
            )
    print("  files: " + ", ".join(summary["files"]), file=sys.stderr)
    if tokenizer.vocab_size < args.vocab_size:
        warnings.warn(
            f"this corpus yields only {tokenizer.vocab_size} tokens, fewer than --vocab-size "
            f"{args.vocab_size}, so the tokenizer has {tokenizer.vocab_size}. Nothing else "
            "needs changing (preprocess_data and the trainer take the vocabulary size from "
            f"the tokenizer); for {args.vocab_size} tokens, train on more text"
        )
    return summary


if __name__ == "__main__":
    # Errors in what the user gave or where the files go, in one line without a traceback.
    try:
        main()
    except SourceError as error:
        print(f"train_tokenizer: error: {error}", file=sys.stderr)
        sys.exit(2)
    except OSError as error:
        print(f"train_tokenizer: error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
