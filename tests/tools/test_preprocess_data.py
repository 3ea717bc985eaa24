"""tools/preprocess_data.py: the .bin holds the tokenizer's ids, for every input form and worker count."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from megafp8.data.indexed_dataset import IndexedDataset
from megafp8.data.tokenizers import build_tokenizer

from ..data.corpora import SUBSETS, records, write_formats, write_jsonl, write_parquet, write_zst
from .load import TOOLS, load_tool

tool = load_tool("preprocess_data")
TOOL = TOOLS / "preprocess_data.py"
train_tokenizer = load_tool("train_tokenizer")
N_DOCS = 90  # several batches of tool.BATCH_DOCUMENTS, the last one partial


@pytest.fixture(scope="module")
def rows():
    return records(N_DOCS, seed=5)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """--tokenizer-* flags for each tokenizer type, trained on a corpus of its own."""
    root = tmp_path_factory.mktemp("tokenizers")
    write_jsonl(root / "train.jsonl", records(300, seed=9))
    for kind in ("bpe", "sentencepiece"):
        train_tokenizer.main(
            [
                "--input",
                str(root / "train.jsonl"),
                "--type",
                kind,
                "--vocab-size",
                "400",
                "--output",
                str(root / kind),
            ]
        )
    return {
        "HuggingFaceTokenizer": ["--tokenizer-model", str(root / "bpe" / "tokenizer.json")],
        "GPT2BPETokenizer": [
            "--vocab-file",
            str(root / "bpe" / "vocab.json"),
            "--merge-file",
            str(root / "bpe" / "merges.txt"),
        ],
        "SentencePieceTokenizer": [
            "--tokenizer-model",
            str(root / "sentencepiece" / "tokenizer.model"),
        ],
    }


def tokenizer_of(flags, kind):
    names = {
        "--tokenizer-model": "tokenizer_model",
        "--vocab-file": "vocab_file",
        "--merge-file": "merge_file",
        "--vocab-size": "vocab_size",
    }
    kwargs = {names[flag]: value for flag, value in zip(flags[::2], flags[1::2])}
    if "vocab_size" in kwargs:
        kwargs["vocab_size"] = int(kwargs["vocab_size"])
    return build_tokenizer(kind, **kwargs)


def run(inputs, prefix, kind="HuggingFaceTokenizer", flags=(), *extra):
    return tool.main(
        [
            "--input",
            *map(str, inputs),
            "--output-prefix",
            str(prefix),
            "--tokenizer-type",
            kind,
            *flags,
            *extra,
        ]
    )


def files_of(prefix, key="text"):
    return [f"{prefix}_{key}_document.{ext}" for ext in ("bin", "idx")]


def read_bytes(paths):
    return [open(path, "rb").read() for path in paths]


@pytest.mark.parametrize(
    "kind", ["HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer"]
)
@pytest.mark.parametrize("append_eod", [True, False])
def test_bin_holds_the_tokenizer_ids(tmp_path, rows, tokenizers, kind, append_eod):
    path = write_jsonl(tmp_path / "corpus.jsonl", rows)
    summary = run(
        [path], tmp_path / "out", kind, tokenizers[kind], *(["--append-eod"] if append_eod else [])
    )
    tokenizer = tokenizer_of(tokenizers[kind], kind)
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert ds.dtype == np.uint16 and len(ds) == N_DOCS
    # a sequence per document
    np.testing.assert_array_equal(ds.document_indices, np.arange(N_DOCS + 1))
    for i, row in enumerate(rows):
        want = tokenizer.tokenize(row["text"]) + ([tokenizer.eod] if append_eod else [])
        assert ds[i].tolist() == want
    assert summary["documents"] == N_DOCS and summary["tokens"] == ds.num_tokens
    assert summary["bytes"] == sum(len(row["text"].encode("utf-8")) for row in rows)
    assert summary["outputs"] == files_of(tmp_path / "out")


def test_every_input_form_gives_identical_outputs(tmp_path, rows, tokenizers):
    import datasets

    flags = tokenizers["HuggingFaceTokenizer"]
    reference = run([write_jsonl(tmp_path / "all.jsonl", rows)], tmp_path / "ref", flags=flags)
    want = read_bytes(reference["outputs"])
    parts = write_formats(tmp_path / "corpus", rows)
    hf_dir = tmp_path / "hf_jsonl"
    hf_dir.mkdir()
    write_jsonl(hf_dir / "train.jsonl", rows)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    forms = {
        "zst": [write_zst(tmp_path / "all.jsonl.zst", rows, frames=3)],
        "parquet": [write_parquet(tmp_path / "all.parquet", rows)],
        "files": parts,
        "folder": [tmp_path / "corpus"],
        "glob": [str(tmp_path / "corpus" / "*")],
        "hf_load_dataset": ["hf:" + str(hf_dir)],
        "hf_save_to_disk": [tmp_path / "saved"],
    }
    for name, inputs in forms.items():
        summary = run(inputs, tmp_path / name, flags=flags)
        assert read_bytes(summary["outputs"]) == want, name


def test_workers_do_not_change_the_bytes(tmp_path, rows, tokenizers):
    write_formats(tmp_path / "corpus", rows)
    outputs = [
        run(
            [tmp_path / "corpus"],
            tmp_path / f"w{workers}",
            "HuggingFaceTokenizer",
            tokenizers["HuggingFaceTokenizer"],
            "--append-eod",
            "--workers",
            str(workers),
            "--split-by-set",
        )["outputs"]
        for workers in (1, 2)
    ]
    assert len(outputs[0]) == 2 * len(SUBSETS)
    assert [p.replace("/w1_", "/w2_") for p in outputs[0]] == outputs[1]
    assert read_bytes(outputs[0]) == read_bytes(outputs[1])


def test_split_by_set(tmp_path, rows, tokenizers, capsys):
    no_meta = [{"text": "a document without meta"}]
    path = write_jsonl(tmp_path / "corpus.jsonl", rows + no_meta)
    flags = tokenizers["HuggingFaceTokenizer"]
    summary = run([path], tmp_path / "sp", "HuggingFaceTokenizer", flags, "--split-by-set")
    tokenizer = tokenizer_of(flags, "HuggingFaceTokenizer")
    for subset in SUBSETS:
        texts = [row["text"] for row in rows if row["meta"]["redpajama_set_name"] == subset]
        ds = IndexedDataset(tmp_path / f"sp_{subset}_text_document")
        assert [ds[i].tolist() for i in range(len(ds))] == [tokenizer.tokenize(t) for t in texts]
        assert summary["subsets"][subset] == {"documents": len(texts), "tokens": ds.num_tokens}
    assert len(IndexedDataset(tmp_path / f"sp_{tool.UNKNOWN_SET}_text_document")) == 1
    assert summary["subsets"][tool.UNKNOWN_SET]["documents"] == 1
    assert not (tmp_path / "sp_text_document.idx").exists()
    out = capsys.readouterr().out
    assert all(f"{subset}: " in out for subset in SUBSETS)


def test_empty_and_missing_texts_are_counted_and_reported(tmp_path, tokenizers, capsys):
    docs = [
        {"text": "first", "title": "one"},
        {"text": "", "title": "two"},
        {"text": "  \n ", "title": None},
        {"title": "four"},
        {"text": "fifth"},
    ]
    path = write_jsonl(tmp_path / "corpus.jsonl", docs)
    flags = tokenizers["HuggingFaceTokenizer"]
    summary = run(
        [path], tmp_path / "out", "HuggingFaceTokenizer", flags, "--json-keys", "text", "title"
    )
    assert summary["documents"] == 5
    assert summary["keys"]["text"] == {
        "documents": 2,
        "tokens": summary["keys"]["text"]["tokens"],
        "empty": 2,
        "missing": 1,
    }
    assert (
        summary["keys"]["title"]["documents"],
        summary["keys"]["title"]["empty"],
        summary["keys"]["title"]["missing"],
    ) == (3, 0, 2)
    tokenizer = tokenizer_of(flags, "HuggingFaceTokenizer")
    text = IndexedDataset(tmp_path / "out_text_document")
    title = IndexedDataset(tmp_path / "out_title_document")
    assert [text[i].tolist() for i in range(len(text))] == [
        tokenizer.tokenize(t) for t in ("first", "fifth")
    ]
    assert [title[i].tolist() for i in range(len(title))] == [
        tokenizer.tokenize(t) for t in ("one", "two", "four")
    ]
    out = capsys.readouterr().out
    assert "'text': 2 documents" in out and "skipped 2 empty, 1 missing" in out
    assert "'title': 3 documents" in out and "skipped 0 empty, 2 missing" in out


def test_summary_and_progress_are_printed(tmp_path, tokenizers, capsys):
    docs = [{"text": "x"}, {"text": ""}, {"other": 1}]
    run(
        [write_jsonl(tmp_path / "c.jsonl", docs)],
        tmp_path / "out",
        "HuggingFaceTokenizer",
        tokenizers["HuggingFaceTokenizer"],
    )
    captured = capsys.readouterr()
    assert "skipped 1 empty, 1 missing" in captured.out
    for rate in ("docs/s", "tokens/s", "MB/s", "out_text_document.idx"):
        assert rate in captured.out
    assert "tokenizing" in captured.err  # the progress bar


def test_a_failed_run_leaves_no_index(tmp_path):
    docs = [{"text": "1 2 3"}] * 50 + [{"text": "1 two 3"}] + [{"text": "4 5"}] * 20
    path = write_jsonl(tmp_path / "corpus.jsonl", docs)
    for workers in ("1", "2"):
        with pytest.raises(ValueError, match=r"corpus\.jsonl:51: tokenizing 'text' failed"):
            run(
                [path],
                tmp_path / "out" / "ds",
                "NullTokenizer",
                ["--vocab-size", "100"],
                "--workers",
                workers,
            )
        assert list((tmp_path / "out").iterdir()) == []  # no .idx, .bin nor temporary files


@pytest.mark.parametrize(
    "vocab_size, dtype",
    [(1000, np.uint16), (65499, np.uint16), (65500, np.int32), (70000, np.int32)],
)
def test_token_dtype_follows_the_vocabulary(tmp_path, vocab_size, dtype):
    top = vocab_size - 2
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": f"0 1 {top}"}, {"text": "7"}])
    summary = run(
        [path], tmp_path / "out", "NullTokenizer", ["--vocab-size", str(vocab_size)], "--append-eod"
    )
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert ds.dtype == dtype and summary["dtype"] == np.dtype(dtype).name
    assert ds[0].tolist() == [0, 1, top, vocab_size - 1] and ds[1].tolist() == [7, vocab_size - 1]


def test_bad_arguments_are_clear(tmp_path, tokenizers, capsys):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "1"}])
    flags = tokenizers["HuggingFaceTokenizer"]
    cases = [
        ([path], "HuggingFaceTokenizer", [], "needs --tokenizer-model"),
        (
            [path],
            "HuggingFaceTokenizer",
            ["--tokenizer-model", str(tmp_path / "nope.json")],
            "no tokenizer.json",
        ),
        ([path], "GPT2BPETokenizer", ["--vocab-file", flags[1]], "merge_file"),
        ([path], "NullTokenizer", [], "vocab_size >= 2"),
        ([tmp_path / "*.parquet"], "HuggingFaceTokenizer", flags, "no .* files matched"),
        ([tmp_path / "missing.jsonl"], "HuggingFaceTokenizer", flags, "no such file"),
        (
            [path],
            "HuggingFaceTokenizer",
            [*flags, "--workers", "0"],
            "--workers must be at least 1",
        ),
    ]
    for inputs, kind, kind_flags, message in cases:
        with pytest.raises(SystemExit):
            run(inputs, tmp_path / "out", kind, kind_flags)
        err = capsys.readouterr().err
        assert "error:" in err and re.search(message, err), err
    assert not list(tmp_path.glob("out*"))
    with pytest.raises(SystemExit):
        run([path], tmp_path / "out", "NoSuchTokenizer")
    assert "invalid choice" in capsys.readouterr().err


def test_meta_as_json_string_splits_too(tmp_path, tokenizers):
    rows = [{"text": "hello", "meta": json.dumps({"redpajama_set_name": "RedPajamaArXiv"})}]
    summary = run(
        [write_jsonl(tmp_path / "c.jsonl", rows)],
        tmp_path / "o",
        "HuggingFaceTokenizer",
        tokenizers["HuggingFaceTokenizer"],
        "--split-by-set",
    )
    assert summary["outputs"] == files_of(tmp_path / "o_RedPajamaArXiv")


NULL = ["--vocab-size", "100"]  # NullTokenizer: text is ids, nothing to train


def test_existing_outputs_are_refused_before_any_work(tmp_path, monkeypatch, capsys):
    run(
        [write_jsonl(tmp_path / "a.jsonl", [{"text": "1 2 3"}])],
        tmp_path / "out",
        "NullTokenizer",
        NULL,
    )
    before = read_bytes(files_of(tmp_path / "out"))
    capsys.readouterr()

    def no_reading(*args, **kwargs):
        raise AssertionError("a refused run must not read the corpus")

    monkeypatch.setattr(tool, "iter_documents", no_reading)
    second = write_jsonl(tmp_path / "b.jsonl", [{"text": "4 5"}])
    with pytest.raises(SystemExit) as exit:
        run([second], tmp_path / "out", "NullTokenizer", NULL)
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert all(path in err for path in files_of(tmp_path / "out")), err
    assert "pass --overwrite to replace them, or choose another --output-prefix" in err
    assert read_bytes(files_of(tmp_path / "out")) == before
    # --split-by-set: a file that any subset would write is refused, whichever subsets come.
    (tmp_path / "sp_RedPajamaBook_text_document.idx").write_bytes(b"precious")
    with pytest.raises(SystemExit):
        run([second], tmp_path / "sp", "NullTokenizer", NULL, "--split-by-set")
    assert "sp_RedPajamaBook_text_document.idx" in capsys.readouterr().err
    assert (tmp_path / "sp_RedPajamaBook_text_document.idx").read_bytes() == b"precious"


def test_overwrite_replaces_the_outputs(tmp_path):
    run(
        [write_jsonl(tmp_path / "a.jsonl", [{"text": "1 2 3"}, {"text": "4"}])],
        tmp_path / "out",
        "NullTokenizer",
        NULL,
    )
    run(
        [write_jsonl(tmp_path / "b.jsonl", [{"text": "7 8"}])],
        tmp_path / "out",
        "NullTokenizer",
        NULL,
        "--overwrite",
    )
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [[7, 8]]
    assert sorted(p.name for p in tmp_path.glob("out*")) == [
        "out_text_document.bin",
        "out_text_document.idx",
    ]


def test_overwrite_by_set_names_what_an_earlier_run_left(tmp_path):
    def rows(*subsets):
        return [{"text": str(i), "meta": {"redpajama_set_name": s}} for i, s in enumerate(subsets)]

    run(
        [write_jsonl(tmp_path / "a.jsonl", rows("RedPajamaBook", "RedPajamaGitHub"))],
        tmp_path / "sp",
        "NullTokenizer",
        NULL,
        "--split-by-set",
    )
    left = [str(tmp_path / f"sp_RedPajamaGitHub_text_document.{ext}") for ext in ("bin", "idx")]
    with pytest.warns(UserWarning, match="2 files of an earlier run") as caught:
        run(
            [write_jsonl(tmp_path / "b.jsonl", rows("RedPajamaBook", "RedPajamaBook"))],
            tmp_path / "sp",
            "NullTokenizer",
            NULL,
            "--split-by-set",
            "--overwrite",
        )
    assert all(path in str(caught[0].message) for path in left)
    assert len(IndexedDataset(tmp_path / "sp_RedPajamaBook_text_document")) == 2


def test_user_errors_are_one_line_and_exit_code_2(tmp_path):
    """As a command: what was wrong in one line, no traceback, exit code 2, nothing written."""
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "1 2"}])
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"text": "1 2"}\n{"text": "3\n')
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json")
    (tmp_path / "taken_text_document.bin").write_bytes(b"precious")
    hf = ["--tokenizer-type", "HuggingFaceTokenizer"]
    null = ["--tokenizer-type", "NullTokenizer", *NULL]
    cases = [
        ([malformed], "out/a", null, r"malformed\.jsonl:2: malformed JSON"),
        (
            [write_jsonl(tmp_path / "words.jsonl", [{"text": "1 two"}])],
            "out/b",
            null,
            r"words\.jsonl:1: tokenizing 'text' failed",
        ),
        ([tmp_path / "missing.jsonl"], "out/c", null, "no such file"),
        ([good], "out/d", [*hf, "--tokenizer-model", str(tmp_path / "nope")], "no tokenizer.json"),
        (
            [good],
            "out/e",
            [*hf, "--tokenizer-model", str(garbage)],
            r"garbage\.json: not a readable tokenizer",
        ),
        ([good], "taken", null, r"taken_text_document\.bin\).*--overwrite"),
    ]
    for inputs, prefix, flags, message in cases:
        done = subprocess.run(
            [
                sys.executable,
                str(TOOL),
                "--input",
                *map(str, inputs),
                "--output-prefix",
                str(tmp_path / prefix),
                *flags,
            ],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 2 and re.search(message, done.stderr), (message, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
    assert list((tmp_path / "out").iterdir()) == []  # the failed runs removed their partial outputs
    assert (tmp_path / "taken_text_document.bin").read_bytes() == b"precious"
