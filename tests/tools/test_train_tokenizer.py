"""tools/train_tokenizer.py: BPE and SentencePiece from any corpus format, deterministic, loadable."""
import re

import pytest

from megafp8.data.tokenizers import build_tokenizer

from ..data.corpora import records, write_formats, write_jsonl
from .load import load_tool

tool = load_tool("train_tokenizer")
TEXT = "def main(argv=None):\n    return 0  # naïve 数据 🚀\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    write_formats(folder, records(300, seed=3))
    return folder


def train(corpus, out, *extra):
    return tool.main(["--input", str(corpus), "--output", str(out), "--vocab-size", "400", *extra])


def test_bpe_writes_tokenizer_json_and_gpt2_files(corpus, tmp_path):
    summary = train(corpus, tmp_path, "--type", "bpe")
    assert summary["vocab_size"] == 400 and summary["documents"] == 300
    assert [p.rsplit("/", 1)[1] for p in summary["files"]] == ["tokenizer.json", "vocab.json", "merges.txt"]
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path)
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=tmp_path / "vocab.json",
                           merge_file=tmp_path / "merges.txt")
    assert hf.eod == gpt2.eod == summary["eod"]
    assert hf.detokenize([hf.eod]) == "<|endoftext|>"
    assert hf.tokenize(TEXT) == gpt2.tokenize(TEXT) and hf.detokenize(hf.tokenize(TEXT)) == TEXT


def test_sentencepiece_writes_a_model_with_eos(corpus, tmp_path):
    summary = train(corpus, tmp_path, "--type", "sentencepiece")
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=tmp_path / "tokenizer.model")
    assert summary["vocab_size"] == tokenizer.vocab_size == 400
    assert tokenizer.eod == summary["eod"] == 2
    assert tokenizer.detokenize(tokenizer.tokenize(TEXT)) == TEXT  # code's spaces kept


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_training_is_deterministic(corpus, tmp_path, kind):
    first = train(corpus, tmp_path / "a", "--type", kind)["files"]
    second = train(corpus, tmp_path / "b", "--type", kind)["files"]
    for a, b in zip(first, second):
        assert open(a, "rb").read() == open(b, "rb").read(), a


def test_max_documents_and_counts(tmp_path):
    rows = records(100) + [{"text": "   "}, {"meta": {}}]
    write_jsonl(tmp_path / "a.jsonl", rows[::-1])  # the empty and missing ones first
    summary = train(tmp_path / "a.jsonl", tmp_path / "tok", "--max-documents", "60")
    assert summary["documents"] == 60
    assert summary["empty"] == {"text": 1} and summary["missing"] == {"text": 1}


def test_bad_arguments(tmp_path, capsys):
    for argv, message in [
        (["--input", str(tmp_path / "*.jsonl"), "--vocab-size", "400"], "no .* files matched"),
        (["--input", str(tmp_path), "--vocab-size", "100"], "at least 384"),
        (["--input", str(tmp_path), "--vocab-size", "400", "--max-documents", "0"], "at least 1"),
    ]:
        with pytest.raises(SystemExit):
            tool.main([*argv, "--output", str(tmp_path / "out")])
        assert re.search(message, capsys.readouterr().err)


def test_vocabulary_too_large_for_sentencepiece(tmp_path, capsys):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "tiny corpus"}])
    with pytest.raises(SystemExit):
        train(tmp_path / "a.jsonl", tmp_path / "tok", "--type", "sentencepiece")
    assert "does not fit this corpus" in capsys.readouterr().err
