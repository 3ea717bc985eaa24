"""tools/make_sample_corpus.py: SlimPajama-format stand-in corpus from the Python stdlib."""

import io
import json
from pathlib import Path

import pytest
import zstandard  # a dependency of megafp8: its absence is a failure, not a skip

from .load import load_tool

MAX_MB = 0.3

tool = load_tool("make_sample_corpus")


def _build(out: Path, *extra) -> Path:
    assert (
        tool.main(["--output", str(out), "--max-mb", str(MAX_MB), "--docs-per-chunk", "40", *extra])
        == 0
    )
    return out


def _files(folder: Path) -> dict:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


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


# -- --packages: a corpus from installed packages, validation packages held out whole --------------

DOCSTRING = '"""' + ("Prose about this module. " * 3 + "\n") * 20 + '"""\n'


# Two folders of packages: a package with a module, docstrings and a README, a bare module,
# a folder without Python, metadata and caches (no packages), and in the second folder a
# package of the same name as one in the first (shadowed) beside a new one.
PACKAGE_FILES = {
    "first/alpha/__init__.py": DOCSTRING + "def f():\n    " + DOCSTRING + "    return 1\n",
    "first/alpha/core.py": "x = 1\n",
    "first/alpha/README.md": "# alpha\n\n" + "How to use alpha. " * 20,
    "first/beta.py": DOCSTRING + "y = 2\n",
    "first/gamma/__init__.py": "z = 3\n",
    "first/data_only/table.txt": "numbers " * 100,
    "first/alpha-1.0.dist-info/METADATA": "Name: alpha\n",
    "first/__pycache__/beta.cpython-311.py": "cached = True\n",
    "second/alpha/other.py": "shadowed = True\n",
    "second/delta/__init__.py": DOCSTRING + "w = 4\n",
    "second/epsilon.py": "v = 5\n",
    # Sources in other languages are code too; a vendored copy counts once; generated,
    # minified and data files do not count.
    "first/alpha/include/alpha.h": "#pragma once\nint alpha_version(void);  /* header of alpha */\n",
    "second/delta/include/alpha.h": "#pragma once\nint alpha_version(void);  /* header of alpha */\n",
    "first/gamma/kernel.cu": "__global__ void gamma_kernel(float *x) { x[threadIdx.x] *= 2; }\n",
    "first/gamma/generated.h": "static const int table[][3] = {\n"
    + "{ -1, -1, -1 },\n" * 300
    + "};\n",
    "first/gamma/bundle.js": "var a=1;" * 200 + "\n",
    "first/gamma/Makefile": "gamma: kernel.cu\n\tnvcc -o gamma kernel.cu  # gamma's build\n",
    "first/gamma/schema.sql": "CREATE TABLE gamma_runs (id INTEGER PRIMARY KEY, note TEXT);\n",
    # Test suites: a package's own, and a top-level one (the standard library's `test`).
    "first/alpha/tests/test_core.py": "def test_core():\n    assert 1 + 1 == 2  # alpha's own test\n",
    "second/test/__init__.py": "suite = 'the regression tests'\n",
}


def _package_tree(root: Path) -> Path:
    for name, text in PACKAGE_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _build_packages(tree: Path, out: Path, *extra) -> Path:
    assert (
        tool.main(
            [
                "--output",
                str(out),
                "--packages",
                str(tree / "first"),
                str(tree / "second"),
                "--docs-per-chunk",
                "3",
                "--validation-fraction",
                "0.4",
                *extra,
            ]
        )
        == 0
    )
    return out


def _documents(folder: Path):
    return [doc for path in sorted(folder.rglob("*.jsonl.zst")) for doc in _read_lines(path)]


def test_packages_corpus_holds_out_whole_packages(tmp_path):
    tree = _package_tree(tmp_path / "tree")
    out = _build_packages(tree, tmp_path / "out")
    train, validation = _documents(out / "train"), _documents(out / "validation")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.jsonl.zst"))[0].startswith(
        "train/chunk1/"
    )
    assert (out / "validation" / "chunk1" / "example_holdout_0.jsonl.zst").is_file()
    train_packages = {d["meta"]["package"] for d in train}
    validation_packages = {d["meta"]["package"] for d in validation}
    assert train_packages and validation_packages and not train_packages & validation_packages
    assert train_packages | validation_packages == {"alpha", "beta", "gamma", "delta", "epsilon"}
    texts = [d["text"] for d in train + validation]
    assert not any(
        "shadowed" in t or "cached" in t or "Name: alpha" in t or "numbers" in t for t in texts
    )
    # no test suites
    assert not any("alpha's own test" in t or "regression tests" in t for t in texts)
    by_text = {d["text"]: d["meta"] for d in train + validation}
    header = PACKAGE_FILES["first/alpha/include/alpha.h"]
    assert texts.count(header) == 1 and by_text[header] == {
        "redpajama_set_name": tool.GITHUB,
        "package": "alpha",
    }
    # RedPajama's GitHub languages, by suffix or name
    for name in (
        "kernel.cu",
        "Makefile",
        "schema.sql",
    ):
        assert by_text[PACKAGE_FILES[f"first/gamma/{name}"]] == {
            "redpajama_set_name": tool.GITHUB,
            "package": "gamma",
        }
    assert not any("{ -1, -1, -1 }" in t or "var a=1" in t for t in texts)  # data-like and minified
    sets = {(d["meta"]["package"], d["meta"]["redpajama_set_name"]) for d in train + validation}
    assert {("alpha", tool.GITHUB), ("alpha", tool.BOOK), ("alpha", tool.WIKI)} <= sets
    readme = (out / "README.txt").read_text()
    # Duplicates: delta's copy of the header, and delta's docstrings (beta's, word for word).
    assert "Left out: 2 duplicates, 2 generated or data-like sources." in readme
    assert (
        "NOT SlimPajama" in readme
        and f"held out whole): {', '.join(sorted(validation_packages))}" in readme
    )
    # The same input gives the same bytes, and the split depends on the package names only.
    again = _build_packages(tree, tmp_path / "again", "--workers", "3")  # read in 3 processes
    assert _files(again) == _files(out)
    assert (
        tool.validation_packages(["alpha", "beta", "gamma", "delta", "epsilon"], 0.4)
        == validation_packages
    )


def test_test_suites_are_added_on_request(tmp_path, capsys):
    tree = _package_tree(tmp_path / "tree")
    out = _build_packages(tree, tmp_path / "out", "--test-suites")
    docs = _documents(out / "train") + _documents(out / "validation")
    by_text = {d["text"]: d["meta"]["package"] for d in docs}
    assert by_text[PACKAGE_FILES["first/alpha/tests/test_core.py"]] == "alpha"
    assert by_text[PACKAGE_FILES["second/test/__init__.py"]] == "test"
    assert "--packages --test-suites from 6 packages" in (out / "README.txt").read_text()
    with pytest.raises(SystemExit) as exit:  # the standard-library sample has none to add
        tool.main(["--output", str(tmp_path / "sample"), "--test-suites"])
    assert exit.value.code == 2 and "--test-suites goes with --packages" in capsys.readouterr().err


# A folder of code in other languages (as /usr/include): folders and loose files are projects.
SOURCE_FILES = {
    "include/stdio.h": "#pragma once\nint printf(const char *format, ...);  /* the C library */\n",
    "include/linux/types.h": "typedef unsigned int __u32;  /* the kernel's types */\n",
    "include/linux/README.md": "# linux headers\n\n"
    + "What the kernel exports to user space. " * 10,
    "include/boost/config.hpp": "#define BOOST_VERSION 108300  // boost's configuration\n",
    "include/boost/detail/alpha.h": "#pragma once\nint alpha_version(void);  /* header of alpha */\n",
    "include/table.dat": "numbers " * 100,
    "include/.hidden.h": "int hidden;  /* a dot file */\n",
}


def test_sources_add_projects_in_other_languages_held_out_whole(tmp_path, capsys):
    tree = _package_tree(tmp_path / "tree")
    for name, text in SOURCE_FILES.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    out = _build_packages(tree, tmp_path / "out", "--sources", str(tree / "include"))
    train, validation = _documents(out / "train"), _documents(out / "validation")
    by_text = {d["text"]: d["meta"] for d in train + validation}
    for name, project in (
        ("stdio.h", "include/stdio.h"),
        ("linux/types.h", "include/linux"),
        ("boost/config.hpp", "include/boost"),
    ):
        assert by_text[SOURCE_FILES[f"include/{name}"]] == {
            "redpajama_set_name": tool.GITHUB,
            "package": project,
        }
    assert (
        by_text[SOURCE_FILES["include/linux/README.md"].strip()]["redpajama_set_name"] == tool.WIKI
    )
    # Packages come first: boost's copy of alpha's header is a duplicate; data and dot files are no code.
    assert by_text[PACKAGE_FILES["first/alpha/include/alpha.h"]]["package"] == "alpha"
    assert not any("numbers" in t or "hidden" in t for t in by_text)
    train_names = {d["meta"]["package"] for d in train}
    validation_names = {d["meta"]["package"] for d in validation}
    assert not train_names & validation_names
    assert train_names | validation_names == {
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "include/stdio.h",
        "include/linux",
        "include/boost",
    }
    readme = (out / "README.txt").read_text()
    assert f"--sources {tree / 'include'} from 8 packages and projects" in readme
    again = _build_packages(
        tree, tmp_path / "again", "--sources", str(tree / "include"), "--workers", "2"
    )
    assert _files(again) == _files(out)
    for argv, message in (
        (["--sources", str(tree / "include")], "--sources goes with --packages"),
        (
            ["--packages", str(tree / "first"), "--sources", str(tmp_path / "nowhere")],
            "--sources: no folder",
        ),
    ):
        with pytest.raises(SystemExit) as exit:
            tool.main(["--output", str(tmp_path / "refused"), *argv])
        assert exit.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_packages_mode_refuses_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        tool.main(["--output", str(tmp_path / "out"), "--packages", str(tmp_path / "nowhere")])
    assert exit.value.code == 2 and "--packages: no folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit:
        tool.main(["--output", str(tmp_path / "out"), "--packages", str(tmp_path / "empty")])
    assert exit.value.code == 2 and "no Python package or module under" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        tool.main(["--output", str(tmp_path / "out"), "--packages", "--validation-fraction", "1.5"])
    assert (
        exit.value.code == 2
        and "--validation-fraction 1.5: give a share in [0, 1)" in capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()


def test_validation_packages_always_leave_some_to_train():
    assert tool.validation_packages(["a"], 0.5) == set()
    assert len(tool.validation_packages(["a", "b"], 0.0001)) == 1  # at least one held out
    assert len(tool.validation_packages(["a", "b"], 0.9999)) == 1  # and one left
    assert tool.validation_packages(["a", "b"], 0.0) == set()


def test_default_roots_are_every_site_folder_imports_read_then_the_standard_library(
    tmp_path, monkeypatch
):
    pure, system, stdlib = (tmp_path / name for name in ("pure", "system", "stdlib"))
    for folder in (pure, system, stdlib):
        folder.mkdir()
    monkeypatch.setattr(
        tool.sysconfig, "get_paths", lambda: {"purelib": str(pure), "platlib": str(pure)}
    )
    monkeypatch.setattr(tool.sys, "base_prefix", tool.sys.prefix)
    # A Debian Python's site list: its own site-packages, the system's, and one that is absent.
    monkeypatch.setattr(
        tool.site,
        "getsitepackages",
        lambda prefixes=None: [str(pure), str(system), str(tmp_path / "absent")],
    )
    roots = tool.default_package_roots(stdlib)
    assert list(dict.fromkeys(roots)) == [pure, system, stdlib]


def test_default_roots_in_a_virtual_environment_add_the_base_interpreters_packages(
    tmp_path, monkeypatch
):
    venv, base, stdlib = (tmp_path / name for name in ("venv", "base", "stdlib"))
    for folder in (venv, base, stdlib):
        (folder / "site-packages").mkdir(parents=True) if folder != stdlib else folder.mkdir()
    monkeypatch.setattr(
        tool.sysconfig,
        "get_paths",
        lambda: {"purelib": str(venv / "site-packages"), "platlib": str(venv / "site-packages")},
    )
    monkeypatch.setattr(tool.sys, "prefix", str(venv))
    monkeypatch.setattr(tool.sys, "base_prefix", str(base))
    monkeypatch.setattr(
        tool.site,
        "getsitepackages",
        lambda prefixes=None: [
            str(Path(p) / "site-packages") for p in prefixes or [tool.sys.prefix]
        ],
    )
    roots = tool.default_package_roots(stdlib)
    assert list(dict.fromkeys(roots)) == [venv / "site-packages", base / "site-packages", stdlib]
