"""Streaming document readers: every format gives the same documents, counts, and clear errors."""

import json
import sys

import pytest
from megafp8.data.sources import SourceError, SourceStats, iter_documents, resolve_inputs

from .corpora import records, write_formats, write_jsonl, write_parquet, write_zst


def read(inputs, keys=("text",), **kwargs):
    stats = SourceStats(keys)
    docs = [(doc.texts, doc.subset) for doc in iter_documents(inputs, keys, stats=stats, **kwargs)]
    return docs, stats


def expected(rows):
    return [({"text": row["text"]}, row["meta"]["redpajama_set_name"]) for row in rows]


def test_jsonl_texts_subsets_and_locations(tmp_path):
    rows = records(10)
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    docs, stats = read([path])
    assert docs == expected(rows)
    assert stats.documents == 10 and stats.sources == [str(path)]
    wheres = [doc.where for doc in iter_documents([path])]
    assert wheres == [f"{path}:{i}" for i in range(1, 11)]


def test_meta_as_dict_json_string_or_absent(tmp_path):
    rows = [
        {"text": "a", "meta": {"redpajama_set_name": "RedPajamaBook"}},
        {"text": "b", "meta": json.dumps({"redpajama_set_name": "RedPajamaArXiv"})},
        {"text": "c", "meta": "not json"},
        {"text": "d", "meta": {"other": 1}},
        {"text": "e"},
    ]
    docs, _ = read([write_jsonl(tmp_path / "a.json", rows)])
    assert [subset for _, subset in docs] == ["RedPajamaBook", "RedPajamaArXiv", None, None, None]


def test_missing_and_empty_texts_are_counted_per_key(tmp_path):
    rows = [
        {"text": "one", "title": "t1"},
        {"text": "", "title": "t2"},
        {"text": " \n\t ", "title": None},
        {"title": "t4"},
        {"text": "five"},
    ]
    docs, stats = read([write_jsonl(tmp_path / "a.jsonl", rows)], keys=("text", "title"))
    assert [texts for texts, _ in docs] == [
        {"text": "one", "title": "t1"},
        {"text": None, "title": "t2"},
        {"text": None, "title": None},
        {"text": None, "title": "t4"},
        {"text": "five", "title": None},
    ]
    assert stats.documents == 5
    assert stats.empty == {"text": 2} and stats.missing == {"text": 1, "title": 2}


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a"}\n\n   \n{"text": "b"}\n', encoding="utf-8")
    docs, stats = read([path])
    assert [texts["text"] for texts, _ in docs] == ["a", "b"] and stats.documents == 2


@pytest.mark.parametrize(
    "line, what",
    [
        ('{"text": "a"', "malformed JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"text": 3}', "'text' is a int, not a string"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, line, what):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(SourceError, match=rf"a\.jsonl:2.*{what}"):
        read([path])


def test_malformed_line_inside_zst(tmp_path):
    path = tmp_path / "a.jsonl.zst"
    import zstandard

    path.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "a"}\n{"text": "b"}\n{oops\n'))
    with pytest.raises(SourceError, match=r"a\.jsonl\.zst:3: malformed JSON"):
        read([path])


def test_zst_reads_every_frame(tmp_path):
    rows = records(30)
    path = write_zst(tmp_path / "a.jsonl.zst", rows, frames=3)
    assert read([path])[0] == expected(rows)


def test_parquet_batches_and_meta_string(tmp_path):
    rows = records(2100)  # more than one row group and more than one read batch
    docs, _ = read([write_parquet(tmp_path / "a.parquet", rows, row_group_size=700)])
    assert docs == expected(rows)
    docs, _ = read([write_parquet(tmp_path / "b.parquet", rows[:20], meta_as_string=True)])
    assert docs == expected(rows[:20])


def test_parquet_missing_column_is_counted(tmp_path):
    rows = records(5)
    docs, stats = read([write_parquet(tmp_path / "a.parquet", rows)], keys=("text", "title"))
    assert stats.missing == {"title": 5} and all(texts["title"] is None for texts, _ in docs)


def test_all_formats_folder_and_glob_agree(tmp_path):
    rows = records(45)
    files = write_formats(tmp_path / "corpus", rows)
    (tmp_path / "corpus" / "README.txt").write_text("not a data file")
    want = expected(rows)
    assert read(files)[0] == want
    assert read([tmp_path / "corpus"])[0] == want
    assert read([str(tmp_path / "corpus" / "*")])[0] == want
    # Inputs keep their order; files named twice are read once.
    assert read([files[2], files[0], tmp_path / "corpus"])[0] == (
        expected(rows[30:]) + expected(rows[:15]) + expected(rows[15:30])
    )


def test_folder_is_recursive_and_sorted(tmp_path):
    for name in ("b/2.jsonl", "b/10.jsonl", "a/z.jsonl", "c.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(tmp_path / name, [{"text": name}])
    docs, _ = read([tmp_path])
    assert [texts["text"] for texts, _ in docs] == [
        "a/z.jsonl",
        "b/10.jsonl",
        "b/2.jsonl",
        "c.jsonl",
    ]
    docs, _ = read([str(tmp_path / "**" / "*.jsonl")])
    assert sorted(texts["text"] for texts, _ in docs) == [
        "a/z.jsonl",
        "b/10.jsonl",
        "b/2.jsonl",
        "c.jsonl",
    ]


def test_unmatched_inputs_are_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SourceError, match="no .* files matched"):
        resolve_inputs([str(tmp_path / "*.jsonl")])
    with pytest.raises(SourceError, match="folder holds no"):
        resolve_inputs([tmp_path / "empty"])
    with pytest.raises(SourceError, match="unsupported file type"):
        resolve_inputs([tmp_path / "notes.txt"])
    with pytest.raises(SourceError, match="no such file"):
        resolve_inputs([str(tmp_path / "missing.jsonl")])
    with pytest.raises(SourceError, match="no inputs"):
        resolve_inputs([])


def test_order_is_deterministic(tmp_path):
    write_formats(tmp_path / "corpus", records(30))
    assert read([tmp_path / "corpus"]) == read([tmp_path / "corpus"])


def test_hugging_face_local_datasets(tmp_path):
    import datasets

    rows = records(20)
    folder = tmp_path / "jsonl"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows)
    # hf: sends a local folder through datasets.load_dataset (streaming).
    docs, stats = read(["hf:" + str(folder)])
    assert docs == expected(rows) and stats.sources == [str(folder)]
    # A save_to_disk folder is recognised without the prefix.
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert read([tmp_path / "saved"])[0] == expected(rows)
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows[:3])}).save_to_disk(
        str(tmp_path / "saved_dict")
    )
    assert read([tmp_path / "saved_dict"], hf_split="validation")[0] == expected(rows[:3])
    with pytest.raises(SourceError, match="no split 'train'"):
        read([tmp_path / "saved_dict"])


def test_unloadable_hugging_face_name(monkeypatch):
    import datasets
    import huggingface_hub.constants

    # Offline: the Hub is never asked, so the test neither waits on nor needs a network.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SourceError, match="not an existing file.*could not load it"):
        read(["no-such-owner/no-such-dataset"])


def test_hugging_face_without_datasets_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(SourceError, match="pip install datasets"):
        read(["some-owner/some-dataset"])


def test_a_zst_chunk_is_streamed_not_read_whole(tmp_path, monkeypatch):
    import zstandard

    path = write_zst(tmp_path / "a.jsonl.zst", records(50))
    calls = []
    original = zstandard.ZstdDecompressor.stream_reader

    def spy(self, source, *args, **kwargs):
        calls.append(kwargs)
        return original(self, source, *args, **kwargs)

    monkeypatch.setattr(zstandard.ZstdDecompressor, "stream_reader", spy)
    monkeypatch.setattr(zstandard.ZstdDecompressor, "decompress", None)  # whole-buffer API off
    first = next(iter_documents([path]))
    assert first.texts["text"] == records(50)[0]["text"]
    assert calls and calls[0].get("read_across_frames") is True
