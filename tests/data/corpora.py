"""Tiny corpora written in each format that megafp8.data.sources reads, for the data and tools tests."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

SUBSETS = ("RedPajamaGitHub", "RedPajamaBook", "RedPajamaWikipedia")
WORDS = (
    "the quick brown fox jumps over lazy dog data model token layer scale gradient "
    "tensor pipeline parallel éclair naïve 数据 模型 def return import class"
).split()


def sentence(rng, n_words):
    return " ".join(rng.choice(WORDS, size=n_words)) + "."


def records(n=60, seed=0):
    """SlimPajama-like records of fresh random text, cycling through the subsets."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        text = "\n".join(sentence(rng, rng.integers(3, 15)) for _ in range(rng.integers(1, 6)))
        if i % 7 == 3:  # some code, whose indentation must survive
            text = f"def f{i}(x):\n    return x * {i}\n\n\tclass  C: pass\n"
        out.append({"text": text, "meta": {"redpajama_set_name": SUBSETS[i % len(SUBSETS)]}})
    return out


def corpus_text(n=400, seed=1):
    """Training text for tiny tokenizers."""
    return [r["text"] for r in records(n, seed)]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_zst(path, rows, frames=1):
    """SlimPajama's .jsonl.zst; with frames > 1, several zstd frames back to back."""
    lines = [json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n" for row in rows]
    compressor = zstandard.ZstdCompressor(level=3)
    step = -(-len(lines) // frames)
    with open(path, "wb") as f:
        for start in range(0, len(lines), step):
            f.write(compressor.compress(b"".join(lines[start : start + step])))
    return path


def write_parquet(path, rows, row_group_size=16, meta_as_string=False):
    """Parquet with meta as a struct column (or a JSON string column) and small row groups."""
    table = {"text": [row.get("text") for row in rows]}
    metas = [row.get("meta") for row in rows]
    table["meta"] = [json.dumps(m) for m in metas] if meta_as_string else metas
    pq.write_table(pa.table(table), path, row_group_size=row_group_size)
    return path


def write_formats(folder, rows):
    """The same rows split over jsonl, zst and parquet files under `folder`: the parts in order."""
    folder.mkdir(parents=True, exist_ok=True)
    third = len(rows) // 3
    return [
        write_jsonl(folder / "a.jsonl", rows[:third]),
        write_zst(folder / "b.jsonl.zst", rows[third : 2 * third], frames=2),
        write_parquet(folder / "c.parquet", rows[2 * third :]),
    ]


def train_tiny_bpe(folder):
    """A byte-level BPE of 400 tokens, GPT-2 style, on `corpus_text()`: `folder/tokenizer.json`
    plus `vocab.json` + `merges.txt` (trained here, not by the tool under test)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text(), trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer.model.save(str(folder))


def train_tiny_sentencepiece(prefix):
    """A SentencePiece BPE of 400 pieces with byte fallback and identity normalisation (exact
    round trips) on the lines of `corpus_text()`: `<prefix>.model`."""
    import sentencepiece

    lines = [line for text in corpus_text() for line in text.split("\n") if line.strip()]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
