"""tools/train_tokenizer.py: BPE and SentencePiece from any corpus format, deterministic, loadable."""

import re
import subprocess
import sys

import pytest
from megafp8.data.tokenizers import build_tokenizer

from ..data.corpora import records, write_formats, write_jsonl
from .load import TOOLS, load_tool

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
    assert [p.rsplit("/", 1)[1] for p in summary["files"]] == [
        "tokenizer.json",
        "vocab.json",
        "merges.txt",
    ]
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path)
    gpt2 = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=tmp_path / "vocab.json", merge_file=tmp_path / "merges.txt"
    )
    assert hf.eod == gpt2.eod == summary["eod"]
    assert hf.detokenize([hf.eod]) == "<|endoftext|>"
    assert hf.tokenize(TEXT) == gpt2.tokenize(TEXT) and hf.detokenize(hf.tokenize(TEXT)) == TEXT


def test_sentencepiece_writes_a_model_with_eos(corpus, tmp_path):
    summary = train(corpus, tmp_path, "--type", "sentencepiece")
    tokenizer = build_tokenizer(
        "SentencePieceTokenizer", tokenizer_model=tmp_path / "tokenizer.model"
    )
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


def test_existing_tokenizer_files_are_refused(corpus, tmp_path, capsys):
    train(corpus, tmp_path, "--type", "bpe")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        train(corpus, tmp_path, "--type", "bpe", "--max-documents", "10")
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert all(
        str(tmp_path / name) in err for name in ("tokenizer.json", "vocab.json", "merges.txt")
    )
    assert "pass --overwrite to replace the tokenizer, or choose another --output" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# 30 documents give a little less than 400
@pytest.mark.filterwarnings("ignore:this corpus yields only")
def test_overwrite_replaces_the_tokenizer(corpus, tmp_path):
    train(corpus, tmp_path / "tok", "--type", "bpe")
    train(corpus, tmp_path / "tok", "--type", "bpe", "--max-documents", "30", "--overwrite")
    fresh = train(corpus, tmp_path / "fresh", "--type", "bpe", "--max-documents", "30")["files"]
    for path in fresh:
        name = path.rsplit("/", 1)[1]
        assert (tmp_path / "tok" / name).read_bytes() == open(path, "rb").read(), name
    # no leftovers
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == sorted(tool.FILES["bpe"])


def test_an_interrupted_run_leaves_no_tokenizer(corpus, tmp_path, monkeypatch):
    train_bpe = tool.train_bpe

    def interrupted(*args):
        train_bpe(*args)
        raise KeyboardInterrupt  # Ctrl-C once the files are written

    monkeypatch.setattr(tool, "train_bpe", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(corpus, tmp_path / "tok", "--type", "bpe")
    assert list((tmp_path / "tok").iterdir()) == []


def test_as_a_command_messages_are_lines(tmp_path):
    """A small corpus's notice and a bad input's error read as one-line messages, no traceback."""
    command = [sys.executable, str(TOOLS / "train_tokenizer.py"), "--vocab-size", "400"]
    small = write_jsonl(tmp_path / "small.jsonl", [{"text": "tiny corpus"}])
    done = subprocess.run(
        [*command, "--input", str(small), "--output", str(tmp_path / "tok")],
        capture_output=True,
        text=True,
    )
    size = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path / "tok").vocab_size
    assert done.returncode == 0 and size < 400
    assert re.search(
        rf"^train_tokenizer: warning: this corpus yields only {size} tokens, fewer than "
        rf"--vocab-size 400, so the tokenizer has {size}\. .*train on more text$",
        done.stderr,
        re.MULTILINE,
    ), done.stderr
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"text": "fine"}\n{"text": \n')
    done = subprocess.run(
        [*command, "--input", str(malformed), "--output", str(tmp_path / "bad")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert re.search(
        r"^train_tokenizer: error: .*malformed\.jsonl:2: malformed JSON", done.stderr, re.MULTILINE
    ), done.stderr
    assert list((tmp_path / "bad").iterdir()) == []
