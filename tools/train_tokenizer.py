"""Train a tokenizer on a corpus that megafp8.data.sources reads (jsonl, .jsonl.zst, parquet, folder, glob).

    python tools/train_tokenizer.py --input sample_corpus --type bpe --vocab-size 8192 --output tok

--type bpe: Hugging Face `tokenizers` byte-level BPE, as GPT-2 (`<|endoftext|>` special token).
    Writes tokenizer.json (--tokenizer-type HuggingFaceTokenizer) and vocab.json + merges.txt
    (--tokenizer-type GPT2BPETokenizer); both give the same ids.
--type sentencepiece: SentencePiece BPE with byte fallback, as Llama (`</s>` end of sentence).
    Writes tokenizer.model (--tokenizer-type SentencePieceTokenizer).

Training is deterministic: the same corpus and flags give byte-identical files.
"""
import argparse
import io
import itertools
import sys
import time
from pathlib import Path

from tqdm import tqdm

from megafp8.data.sources import SourceError, SourceStats, iter_documents, resolve_inputs
from megafp8.data.tokenizers import build_tokenizer

BPE_EOD = "<|endoftext|>"
MIN_VOCAB = 384  # the 256 bytes, the special tokens and room for merges


def _texts(args, stats):
    """The non-empty texts of every json key, document by document, behind a progress bar."""
    documents = iter_documents(args.input, args.json_keys, stats=stats,
                               hf_split=args.hf_split, hf_config=args.hf_config)
    # islice stops before reading document N + 1, so the counts cover exactly what trained.
    documents = itertools.islice(documents, args.max_documents)
    with tqdm(documents, total=args.max_documents, desc="reading", unit="doc", file=sys.stderr,
              mininterval=1.0) as bar:
        for doc in bar:
            yield from (text for text in doc.texts.values() if text is not None)


def train_bpe(args, texts):
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
    tokenizer.save(str(args.output / "tokenizer.json"))
    tokenizer.model.save(str(args.output))  # vocab.json + merges.txt
    files = [args.output / name for name in ("tokenizer.json", "vocab.json", "merges.txt")]
    return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=files[0]), files


def train_sentencepiece(args, texts, parser):
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
    files = [args.output / "tokenizer.model"]
    files[0].write_bytes(model.getvalue())
    return build_tokenizer("SentencePieceTokenizer", tokenizer_model=files[0]), files


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="files (.jsonl, .json, .jsonl.zst, .parquet), folders, globs or a "
                             "Hugging Face dataset")
    parser.add_argument("--type", choices=("bpe", "sentencepiece"), default="bpe",
                        help="bpe: byte-level BPE as GPT-2 (default); sentencepiece: as Llama")
    parser.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, e.g. 8192")
    parser.add_argument("--output", type=Path, required=True, help="output folder")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys whose texts train the tokenizer (default: text)")
    parser.add_argument("--max-documents", type=int, default=None,
                        help="train on the first N documents only")
    parser.add_argument("--hf-split", default="train", help="Hugging Face dataset split (default train)")
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
    args.output.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    stats = SourceStats(tuple(args.json_keys))
    texts = _texts(args, stats)
    if args.type == "bpe":
        tokenizer, files = train_bpe(args, texts)
    else:
        tokenizer, files = train_sentencepiece(args, texts, parser)
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
    print(f"trained {args.type} tokenizer: vocabulary {tokenizer.vocab_size}, end of document "
          f"{tokenizer.eod}, {summary['documents']} documents in {elapsed:.1f} s", file=sys.stderr)
    for key in args.json_keys:
        if stats.missing[key] or stats.empty[key]:
            print(f"  {key!r}: {stats.missing[key]} missing, {stats.empty[key]} empty (skipped)",
                  file=sys.stderr)
    if tokenizer.vocab_size < args.vocab_size:
        print(f"  warning: the corpus yields only {tokenizer.vocab_size} tokens, fewer than "
              f"--vocab-size {args.vocab_size}", file=sys.stderr)
    print("  files: " + ", ".join(summary["files"]), file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
