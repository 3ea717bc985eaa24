"""Tokenize a corpus into Megatron-LM indexed datasets (`<prefix>_<key>_document.{bin,idx}`).

    python tools/preprocess_data.py --input sample_corpus --output-prefix out/sample \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tok/tokenizer.json \\
        --append-eod --workers 2

Megatron-LM's interface and output: one sequence per document (no sentence splitting), tokens as
uint16 for vocabularies under 65500 else int32. --input takes files (.jsonl, .json, .jsonl.zst,
.parquet), folders, globs or a Hugging Face dataset (see megafp8.data.sources). With
--split-by-set each SlimPajama subset (meta.redpajama_set_name) gets its own
`<prefix>_<set>_<key>_document` dataset, ready to blend with weights.

The output is identical for any --workers: documents go to the workers in fixed-size batches and
come back in order. Outputs are written under temporary names and moved into place only when the
whole corpus has been processed, so a failed or interrupted run leaves no .idx that looks valid.
Existing outputs are never replaced without --overwrite.

A bad input (a malformed line, text the tokenizer refuses) or a refusal ends the run with a
one-line message and exit code 2; a failure to write (a full disk) with one line and code 1.
"""

import argparse
import glob
import multiprocessing
import re
import signal
import sys
import threading
import time
import warnings
from collections import Counter
from itertools import islice, takewhile
from pathlib import Path

import numpy as np
from megafp8.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megafp8.data.sources import SourceError, SourceStats, iter_documents, resolve_inputs
from megafp8.data.tokenizers import TOKENIZER_TYPES, build_tokenizer, disable_tokenizers_parallelism
from tqdm import tqdm

from megafp8.messages import show_warnings_as_messages

# Documents per task. Fixed (never derived from --workers) so batching cannot change the output;
# large enough that a task's pickling and scheduling cost is small beside its tokenization.
BATCH_DOCUMENTS = 16
UNKNOWN_SET = "unknown"  # --split-by-set name for documents without meta.redpajama_set_name


class InputError(ValueError):
    """The corpus cannot be processed as it is: text the tokenizer refuses, clashing subset names."""


class Encoder:
    """Tokenizes batches of documents; each worker process builds its own (Megatron-LM's Encoder)."""

    def __init__(self, tokenizer_kwargs, json_keys, append_eod):
        disable_tokenizers_parallelism()  # one thread per worker: --workers is the CPU budget
        self.tokenizer = build_tokenizer(**tokenizer_kwargs)
        self.json_keys = json_keys
        self.append_eod = append_eod
        self.dtype = best_dtype(self.tokenizer.vocab_size)

    def _tokenize(self, docs, key):
        texts = [doc.texts[key] for doc in docs]
        try:
            return self.tokenizer.tokenize_batch(texts)
        except Exception:
            # Find the document that failed, so the error can name its file and line.
            for doc, text in zip(docs, texts):
                try:
                    self.tokenizer.tokenize(text)
                except Exception as error:
                    raise InputError(
                        f"{doc.where}: tokenizing {key!r} failed: {type(error).__name__}: {error}"
                    ) from None
            raise

    def encode(self, batch):
        """[(subset, {key: token array or None}, UTF-8 bytes of text)] for a batch of documents."""
        tokens = [{} for _ in batch]
        for key in self.json_keys:
            present = [i for i, doc in enumerate(batch) if doc.texts[key] is not None]
            for i, ids in zip(present, self._tokenize([batch[i] for i in present], key)):
                if self.append_eod:
                    ids = list(ids) + [self.tokenizer.eod]
                tokens[i][key] = np.array(ids, dtype=self.dtype)
        return [
            (
                doc.subset,
                tokens[i],
                sum(len(text.encode("utf-8")) for text in doc.texts.values() if text is not None),
            )
            for i, doc in enumerate(batch)
        ]


_encoder = None


def _init_worker(tokenizer_kwargs, json_keys, append_eod):
    global _encoder
    # Ctrl-C reaches the whole process group: let only the main process handle it (and clean up).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _encoder = Encoder(tokenizer_kwargs, json_keys, append_eod)


def _encode(batch):
    return _encoder.encode(batch)


def _batches(documents):
    while batch := list(islice(documents, BATCH_DOCUMENTS)):
        yield batch


def _file_part(name):
    """A subset or key name made safe for a file name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "_"


class _Outputs:
    """The builders, one per key (per subset and key with --split-by-set), created on first use."""

    def __init__(self, prefix, dtype, split_by_set):
        self.prefix, self.dtype, self.split_by_set = prefix, dtype, split_by_set
        self.builders = {}
        self._set_files = {}  # file-name part -> subset, to refuse two subsets sharing a file

    def prefix_for(self, subset, key):
        if not self.split_by_set:
            return f"{self.prefix}_{_file_part(key)}_document"
        name = UNKNOWN_SET if subset is None else subset
        part = _file_part(name)
        if self._set_files.setdefault(part, name) != name:
            raise InputError(
                f"subsets {self._set_files[part]!r} and {name!r} would share the file "
                f"name part {part!r}; rename one in the corpus"
            )
        return f"{self.prefix}_{part}_{_file_part(key)}_document"

    def builder(self, subset, key):
        group = (subset if self.split_by_set else None, key)
        if group not in self.builders:
            self.builders[group] = IndexedDatasetBuilder(self.prefix_for(subset, key), self.dtype)
        return self.builders[group]

    def finalize(self):
        for builder in self.builders.values():
            builder.finalize()
        return [f"{b.prefix}.{ext}" for b in self.builders.values() for ext in ("bin", "idx")]

    def abort(self):
        for builder in self.builders.values():
            builder.abort()


def _existing_outputs(prefix, json_keys, split_by_set):
    """The files under `prefix` that this run could write; with --split-by-set, those of any subset."""
    subset = "_*" if split_by_set else ""
    patterns = [
        f"{glob.escape(prefix)}{subset}_{_file_part(key)}_document.{ext}"
        for key in json_keys
        for ext in ("bin", "idx")
    ]
    return sorted({path for pattern in patterns for path in glob.glob(pattern)})


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input")
    group.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files (.jsonl, .json, .jsonl.zst, .parquet), folders (recursive), "
        "globs, or a Hugging Face dataset name or path (hf:PATH forces it)",
    )
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys to tokenize, one dataset each (default: text)",
    )
    group.add_argument(
        "--split-by-set",
        action="store_true",
        help="one dataset per SlimPajama subset (meta.redpajama_set_name)",
    )
    group.add_argument(
        "--hf-split", default="train", help="Hugging Face dataset split (default train)"
    )
    group.add_argument("--hf-config", default=None, help="Hugging Face dataset configuration")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument(
        "--tokenizer-model", help="tokenizer.json (or its folder), or a SentencePiece .model"
    )
    group.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer: vocabulary size")
    group.add_argument("--eod-token", help="end-of-document token (default: the vocabulary's own)")
    group.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token to every document",
    )
    group = parser.add_argument_group("output")
    group.add_argument(
        "--output-prefix",
        required=True,
        help="path prefix of the outputs: <prefix>_<key>_document.{bin,idx}",
    )
    group.add_argument(
        "--overwrite",
        action="store_true",
        help="replace outputs that already exist (without it they are refused)",
    )
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    group.add_argument(
        "--log-interval",
        type=int,
        default=100,
        help="refresh the progress rates every N documents (default 100)",
    )
    args = parser.parse_args(argv)

    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be at least 1, got {args.log_interval}")
    args.tokenizer_kwargs = dict(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        eod_token=args.eod_token,
    )
    try:
        args.tokenizer = build_tokenizer(**args.tokenizer_kwargs)
    except (ValueError, OSError, ImportError) as error:
        parser.error(f"tokenizer: {error}")
    try:
        resolve_inputs(args.input)
    except (SourceError, OSError) as error:
        parser.error(str(error))
    args.existing_outputs = _existing_outputs(args.output_prefix, args.json_keys, args.split_by_set)
    if args.existing_outputs and not args.overwrite:
        shown = ", ".join(args.existing_outputs[:6]) + (
            ", ..." if len(args.existing_outputs) > 6 else ""
        )
        # A refusal, not a usage mistake: the message alone, without the usage text.
        parser.exit(
            2,
            f"{parser.prog}: error: {len(args.existing_outputs)} output files already exist "
            f"({shown}); pass --overwrite to replace them, or choose another --output-prefix\n",
        )
    return args


def _summary_lines(summary, split_by_set):
    yield (
        f"processed {summary['documents']} documents, {summary['tokens']} tokens, "
        f"{summary['bytes'] / 1e6:.2f} MB of text in {summary['elapsed_s']:.1f} s: "
        f"{summary['docs_per_s']:.1f} docs/s, {summary['tokens_per_s']:.0f} tokens/s, "
        f"{summary['mb_per_s']:.2f} MB/s"
    )
    for key, counts in summary["keys"].items():
        yield (
            f"  {key!r}: {counts['documents']} documents, {counts['tokens']} tokens; skipped "
            f"{counts['empty']} empty, {counts['missing']} missing"
        )
    if split_by_set:
        for name, counts in summary["subsets"].items():
            yield f"  {name}: {counts['documents']} documents, {counts['tokens']} tokens"
    yield "outputs:"
    yield from (f"  {path}" for path in summary["outputs"])


def main(argv=None):
    """Process the corpus and return the summary; a failure raises (see the end of this file)."""
    show_warnings_as_messages("preprocess_data")
    args = _parse_args(argv)
    tokenizer = args.tokenizer
    stats = SourceStats(tuple(args.json_keys))
    documents = iter_documents(
        args.input, args.json_keys, stats=stats, hf_split=args.hf_split, hf_config=args.hf_config
    )
    outputs = _Outputs(args.output_prefix, best_dtype(tokenizer.vocab_size), args.split_by_set)

    written, key_tokens, no_tokens = Counter(), Counter(), Counter()
    subsets = {}
    n_tokens = n_bytes = n_docs = 0
    # fork: workers inherit the loaded modules (this script need not be importable by name).
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    )
    start = time.perf_counter()
    bar = tqdm(desc="tokenizing", unit="doc", file=sys.stderr, mininterval=1.0, smoothing=0.1)
    try:
        Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
        if not args.split_by_set:
            for key in args.json_keys:  # a dataset per key even if every document lacks it
                outputs.builder(None, key)
        pool = context.Pool(
            args.workers,
            _init_worker,
            (args.tokenizer_kwargs, tuple(args.json_keys), args.append_eod),
        )
        # On a failure the batches run out and the workers finish the few already queued:
        # Pool.terminate() (the with-block's exit) can kill a worker while it holds the result
        # queue's lock, and then wait forever for the pool's thread that needs that lock.
        stopped = threading.Event()
        try:
            # chunksize 1: each task is already a batch of documents; imap keeps their order.
            feed = takewhile(lambda _: not stopped.is_set(), _batches(documents))
            for results in pool.imap(_encode, feed, chunksize=1):
                for subset, tokens, nbytes in results:
                    counts = subsets.setdefault(
                        UNKNOWN_SET if subset is None else subset, {"documents": 0, "tokens": 0}
                    )
                    counts["documents"] += 1
                    for key, ids in tokens.items():
                        if not len(ids):  # text that tokenizes to nothing: skip like an empty one
                            no_tokens[key] += 1
                            continue
                        builder = outputs.builder(subset, key)
                        builder.add_item(ids)
                        builder.end_document()
                        written[key] += 1
                        key_tokens[key] += len(ids)
                        counts["tokens"] += len(ids)
                        n_tokens += len(ids)
                    n_bytes += nbytes
                n_docs += len(results)
                bar.update(len(results))
                if n_docs % args.log_interval < len(results):
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(
                        f"{n_tokens / elapsed:.0f} tok/s, {n_bytes / elapsed / 1e6:.2f} MB/s",
                        refresh=False,
                    )
        except BaseException:
            stopped.set()
            raise
        finally:
            pool.close()
            pool.join()
        files = outputs.finalize()
    except BaseException as error:
        outputs.abort()
        bar.close()
        reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        print(f"preprocess_data: stopped ({reason}); removed the partial outputs", file=sys.stderr)
        raise
    bar.close()
    elapsed = max(time.perf_counter() - start, 1e-9)
    # --split-by-set with --overwrite: an earlier run's subsets that this corpus lacks stay behind.
    untouched = sorted(set(args.existing_outputs) - set(files))
    if untouched:
        warnings.warn(
            f"{len(untouched)} files of an earlier run under this --output-prefix were not "
            f"replaced, as this corpus has no such subset: {', '.join(untouched)}; delete "
            "them unless they belong with these outputs"
        )

    summary = {
        "documents": n_docs,
        "tokens": n_tokens,
        "bytes": n_bytes,
        "keys": {
            key: {
                "documents": written[key],
                "tokens": key_tokens[key],
                "empty": stats.empty[key] + no_tokens[key],
                "missing": stats.missing[key],
            }
            for key in args.json_keys
        },
        "subsets": dict(sorted(subsets.items())),
        "elapsed_s": elapsed,
        "docs_per_s": n_docs / elapsed,
        "tokens_per_s": n_tokens / elapsed,
        "mb_per_s": n_bytes / elapsed / 1e6,
        "dtype": str(best_dtype(tokenizer.vocab_size)),
        "outputs": files,
    }
    print("\n".join(_summary_lines(summary, args.split_by_set)))
    return summary


if __name__ == "__main__":
    # main has already said what went wrong (argparse, or the "stopped" line); a traceback would
    # only bury it. An unexpected (internal) error keeps its traceback.
    try:
        main()
    except (SourceError, InputError):
        sys.exit(2)
    except OSError:
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
