"""Tokenizers: round trips for every type, GPT-2 files equal tokenizer.json, end of document, errors."""

import json

import pytest
from megafp8.data.tokenizers import build_tokenizer

from .corpora import corpus_text, train_tiny_bpe, train_tiny_sentencepiece

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2\n\n\tclass  C: pass\n",
    "naïve éclair, 数据 and 模型 — with emoji 🚀 and digits 12345",
    "  leading and trailing spaces  ",
    "",
]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A tiny byte-level BPE, GPT-2 style: tokenizer.json plus vocab.json + merges.txt."""
    out = tmp_path_factory.mktemp("bpe")
    train_tiny_bpe(out)
    return out


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A tiny SentencePiece BPE with byte fallback and identity normalisation (exact round trips)."""
    out = tmp_path_factory.mktemp("spm")
    train_tiny_sentencepiece(out / "tokenizer")
    return out / "tokenizer.model"


def assert_round_trips(tokenizer):
    for text in TEXTS:
        ids = tokenizer.tokenize(text)
        assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.detokenize(ids) == text
    assert tokenizer.tokenize_batch(TEXTS) == [tokenizer.tokenize(text) for text in TEXTS]


def test_hugging_face_tokenizer_json(bpe_dir):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=bpe_dir / "tokenizer.json")
    assert_round_trips(tokenizer)
    assert tokenizer.vocab_size == 400
    assert tokenizer.detokenize([tokenizer.eod]) == "<|endoftext|>"
    assert tokenizer.files == (str(bpe_dir / "tokenizer.json"),)
    # The folder that holds tokenizer.json works too.
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=bpe_dir).tokenize(
        TEXTS[1]
    ) == tokenizer.tokenize(TEXTS[1])


def test_gpt2_files_give_the_tokenizer_json_ids(bpe_dir):
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=bpe_dir / "tokenizer.json")
    gpt2 = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=bpe_dir / "vocab.json", merge_file=bpe_dir / "merges.txt"
    )
    assert_round_trips(gpt2)
    assert gpt2.vocab_size == hf.vocab_size and gpt2.eod == hf.eod
    for text in TEXTS + corpus_text(20, seed=7):
        assert gpt2.tokenize(text) == hf.tokenize(text)
    assert gpt2.files == (str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt"))


def test_sentencepiece(spm_model):
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model)
    assert_round_trips(tokenizer)
    assert tokenizer.vocab_size == 400
    assert tokenizer.eod == 2  # SentencePiece's </s>
    assert tokenizer.files == (str(spm_model),)
    assert (
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model, eod_token="<s>").eod
        == 1
    )


def test_null_tokenizer():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert tokenizer.tokenize("3 1 4 1 5 999") == [3, 1, 4, 1, 5, 999]
    assert tokenizer.detokenize([3, 1, 4]) == "3 1 4"
    assert tokenizer.eod == 999 and tokenizer.vocab_size == 1000
    assert tokenizer.tokenize_batch(["1 2", ""]) == [[1, 2], []]
    with pytest.raises(ValueError, match="outside"):
        tokenizer.tokenize("1 1000")
    with pytest.raises(ValueError, match="vocab_size >= 2"):
        build_tokenizer("NullTokenizer")


def test_eod_token_choice(bpe_dir, tmp_path):
    eod = build_tokenizer(
        "HuggingFaceTokenizer", tokenizer_model=bpe_dir, eod_token="<|endoftext|>"
    ).eod
    assert eod == build_tokenizer("HuggingFaceTokenizer", tokenizer_model=bpe_dir).eod
    with pytest.raises(ValueError, match="end-of-document tokens.*eod-token"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=bpe_dir, eod_token="<nope>")
    # A vocabulary without any known end-of-document token must be told which one to use.
    spec = json.loads((bpe_dir / "tokenizer.json").read_text(encoding="utf-8"))
    spec["added_tokens"] = []
    del spec["model"]["vocab"]["<|endoftext|>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match="none of the end-of-document tokens"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path)


def test_sentencepiece_unknown_eod_token(spm_model):
    with pytest.raises(ValueError, match="not in the vocabulary"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model, eod_token="<nope>")


def test_errors_name_what_is_missing(tmp_path, bpe_dir):
    with pytest.raises(ValueError, match="unknown tokenizer type 'Nope'"):
        build_tokenizer("Nope")
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path)
    with pytest.raises(FileNotFoundError, match="merge_file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_dir / "vocab.json")
    with pytest.raises(FileNotFoundError, match="no SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=tmp_path / "missing.model")


def test_unreadable_files_are_value_errors_naming_the_file(tmp_path, bpe_dir):
    # The libraries raise a bare Exception or RuntimeError; the tools report ValueErrors in one line.
    garbage = tmp_path / "garbage"
    garbage.write_text("not a tokenizer\n")
    with pytest.raises(ValueError, match=r"garbage: not a readable tokenizer\.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=garbage)
    with pytest.raises(
        ValueError, match=r"garbage: not a readable GPT-2 vocab\.json and merges\.txt"
    ):
        build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_dir / "vocab.json", merge_file=garbage)
    with pytest.raises(ValueError, match="garbage: not a readable SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=garbage)
