"""tools/make_sample_corpus.py: SlimPajama-format stand-in corpus from the Python stdlib."""
import importlib.util
import io
import json
from pathlib import Path

import pytest

import zstandard  # a dependency of megafp8: its absence is a failure, not a skip

TOOL = Path(__file__).resolve().parents[2] / "tools" / "make_sample_corpus.py"
MAX_MB = 0.3


def _load_tool():
    # tools/ is not a package: load the script from its path.
    spec = importlib.util.spec_from_file_location("make_sample_corpus", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def _build(out: Path, *extra) -> Path:
    assert tool.main(["--output", str(out), "--max-mb", str(MAX_MB), "--docs-per-chunk", "40", *extra]) == 0
    return out


def _files(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _tiny_stdlib(stdlib):
    return {tool.GITHUB: ["x = 1\n"], tool.BOOK: ["Prose."], tool.WIKI: ["Reference."]}


def _read_lines(path: Path):
    with open(path, "rb") as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        yield from (json.loads(line) for line in io.TextIOWrapper(reader, encoding="utf-8"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("corpus") / "out")


def test_chunks_are_slimpajama_jsonl(corpus):
    files = sorted((corpus / "chunk1").glob("example_train_*.jsonl.zst"))
    assert files and (corpus / "chunk1" / "example_train_0.jsonl.zst") in files
    docs = [doc for path in files for doc in _read_lines(path)]
    assert all(len(list(_read_lines(path))) <= 40 for path in files)
    assert all(doc["text"].strip() for doc in docs)
    names = {doc["meta"]["redpajama_set_name"] for doc in docs}
    assert names == set(tool.SUBSETS)
    assert sum(len(doc["text"].encode("utf-8")) for doc in docs) <= MAX_MB * 1_000_000


def test_readme_says_not_slimpajama(corpus):
    readme = (corpus / "README.txt").read_text(encoding="utf-8")
    assert "NOT SlimPajama" in readme
    assert all(name in readme for name in tool.SUBSETS)


def test_two_runs_are_byte_identical(corpus, tmp_path):
    again = _build(tmp_path / "again")
    first = sorted(p.relative_to(corpus) for p in corpus.rglob("*") if p.is_file())
    second = sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert first == second
    assert all((corpus / p).read_bytes() == (again / p).read_bytes() for p in first)


def test_a_folder_that_holds_files_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "chunk1").mkdir(parents=True)
    (out / "chunk1" / "example_train_0.jsonl.zst").write_bytes(b"the real SlimPajama")
    (out / "notes.txt").write_text("mine")
    before = _files(out)
    with pytest.raises(SystemExit) as exit:
        tool.main(["--output", str(out)])
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert f"--output {out} already holds files (chunk1/, notes.txt); pass --overwrite" in err, err
    assert _files(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left beside it


def test_overwrite_replaces_the_corpus_and_keeps_other_files(corpus, tmp_path):
    out = tmp_path / "out"
    (out / "chunk1").mkdir(parents=True)
    for k in (0, 99):  # chunk 99: more chunks than the new corpus has
        (out / "chunk1" / f"example_train_{k}.jsonl.zst").write_bytes(b"old")
    (out / "README.txt").write_text("old")
    (out / "notes.txt").write_text("mine")
    _build(out, "--overwrite")
    assert _files(out) == {**_files(corpus), "notes.txt": b"mine"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_empty_folder_is_used(tmp_path, monkeypatch):
    monkeypatch.setattr(tool, "collect", _tiny_stdlib)
    (tmp_path / "out").mkdir()
    assert tool.main(["--output", str(tmp_path / "out")]) == 0
    assert sorted(_files(tmp_path / "out")) == ["README.txt", "chunk1/example_train_0.jsonl.zst"]


def test_an_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    """No half corpus that a later step (or examples/prepare_sample_data.sh) would take as done."""
    monkeypatch.setattr(tool, "collect", _tiny_stdlib)

    write = tool.write

    def interrupted(*args):
        write(*args)
        raise KeyboardInterrupt  # Ctrl-C once the chunks are written

    monkeypatch.setattr(tool, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tool.main(["--output", str(tmp_path / "out")])
    assert list(tmp_path.iterdir()) == []
