"""Write a small real-text corpus in SlimPajama's format, built from the Python standard library.

This is a STAND-IN with SlimPajama's on-disk format, NOT SlimPajama: it lets the embedded
default quickstart run on any machine without a download. The output mirrors SlimPajama's
``chunk1/example_train_{k}.jsonl.zst`` files, each line a JSON object
``{"text": ..., "meta": {"redpajama_set_name": ...}}``.

Subsets (all read from the running interpreter's stdlib, never imported, so every CPython
install has them and the output is deterministic for a given Python build):

* ``RedPajamaGitHub``: one document per stdlib ``.py`` file (source code).
* ``RedPajamaBook``: per stdlib module, its module/class/function docstrings joined (prose),
  read with ``ast``; kept if long enough.
* ``RedPajamaWikipedia``: reference-style prose shipped with CPython itself: the ``help()``
  topics in ``pydoc_data/topics.py`` (text of the Language Reference; always installed, since
  ``help()`` needs it), the Zen of Python (``this.s``, rot13) and ``LICENSE.txt`` where present.

The corpus is built in a temporary folder beside ``--output`` and moved there when complete,
README.txt last, so an interrupted run leaves no half corpus under that name. A folder that
already holds files is refused; ``--overwrite`` replaces the corpus files in it (other files stay).

Usage: ``python tools/make_sample_corpus.py --output ./sample_corpus [--max-mb 4] [--overwrite]``
"""
import argparse
import ast
import codecs
import json
import os
import shutil
import sys
import sysconfig
import uuid
import warnings
from pathlib import Path

import zstandard

from megafp8.console import show_warnings_as_messages

GITHUB, BOOK, WIKI = "RedPajamaGitHub", "RedPajamaBook", "RedPajamaWikipedia"
SUBSETS = (GITHUB, BOOK, WIKI)
ZSTD_LEVEL = 3  # fixed: same input + same level gives identical bytes
MIN_BOOK_CHARS = 1000  # a module's docstrings must make at least this much prose
# Test suites, third-party packages and caches are not "the standard library's code".
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
SKIP_FILES = {"pydoc_data/topics.py"}  # a data file; its text goes to WIKI instead
CHUNKS = "chunk1/example_train_*.jsonl.zst"  # what --overwrite replaces, with README.txt

DESCRIPTION = (
    "Write a small corpus with SlimPajama's format (chunk1/example_train_{k}.jsonl.zst, lines "
    '{"text", "meta": {"redpajama_set_name"}}) built from the Python standard library. '
    "A stand-in for the quickstart, NOT SlimPajama."
)


def _stdlib_modules(stdlib: Path):
    """Yield (relative path, source, ast tree) for every parseable stdlib .py file, sorted."""
    paths = []
    for folder, dirs, files in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]  # prune: site-packages can be huge
        paths += [Path(folder, f) for f in files if f.endswith(".py")]
    for path in sorted(paths, key=lambda p: p.relative_to(stdlib).as_posix()):
        rel = path.relative_to(stdlib)
        if rel.as_posix() in SKIP_FILES:
            continue
        try:
            source = path.read_text(encoding="utf-8")
            with warnings.catch_warnings():  # old files may warn about escapes; irrelevant here
                warnings.simplefilter("ignore")
                tree = ast.parse(source, filename=str(path))
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        yield rel.as_posix(), source, tree


def _docstrings(tree) -> str:
    """A module's docstrings, in source order, each under the name it documents."""
    parts = []
    if doc := ast.get_docstring(tree):
        parts.append(doc)
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = sorted((n for n in ast.walk(tree) if isinstance(n, defs)), key=lambda n: (n.lineno, n.col_offset))
    for node in nodes:
        if doc := ast.get_docstring(node):
            parts.append(f"{node.name}\n\n{doc}")
    return "\n\n".join(parts)


def _wiki_documents(stdlib: Path) -> list[str]:
    """Prose that every CPython ships: help() topics, the Zen of Python, the license if present."""
    docs = []
    topics = stdlib / "pydoc_data" / "topics.py"
    if topics.is_file():
        # The file is a single `topics = {...}` literal; read it without importing.
        tree = ast.parse(topics.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "topics":
                table = ast.literal_eval(node.value)
                docs.extend(table[key] for key in sorted(table))
    this = stdlib / "this.py"
    if this.is_file():
        for node in ast.parse(this.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "s":
                docs.append(codecs.decode(ast.literal_eval(node.value), "rot13"))
    license_txt = stdlib / "LICENSE.txt"
    if license_txt.is_file():
        docs.append(license_txt.read_text(encoding="utf-8"))
    return [d.strip() for d in docs if d.strip()]


def collect(stdlib: Path) -> dict[str, list[str]]:
    """All candidate documents per subset, each list in a deterministic order."""
    subsets = {GITHUB: [], BOOK: [], WIKI: _wiki_documents(stdlib)}
    for _, source, tree in _stdlib_modules(stdlib):
        if source.strip():
            subsets[GITHUB].append(source)
        prose = _docstrings(tree)
        if len(prose) >= MIN_BOOK_CHARS:
            subsets[BOOK].append(prose)
    return subsets


def select(subsets: dict[str, list[str]], max_bytes: int) -> list[tuple[str, str]]:
    """Round-robin across subsets so each is represented; skip documents that would pass the cap."""
    chosen, total = [], 0
    longest = max(len(docs) for docs in subsets.values())
    for i in range(longest):
        for name in SUBSETS:
            if i < len(subsets[name]):
                size = len(subsets[name][i].encode("utf-8"))
                if total + size <= max_bytes:
                    chosen.append((name, subsets[name][i]))
                    total += size
    return chosen


def write(docs: list[tuple[str, str]], output: Path, docs_per_chunk: int) -> list[Path]:
    """Write the chunk files, streaming through zstd so memory stays small."""
    chunk_dir = output / "chunk1"
    chunk_dir.mkdir(parents=True, exist_ok=True)
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    files = []
    for k, start in enumerate(range(0, len(docs), docs_per_chunk)):
        path = chunk_dir / f"example_train_{k}.jsonl.zst"
        with open(path, "wb") as raw, compressor.stream_writer(raw) as out:
            for name, text in docs[start : start + docs_per_chunk]:
                line = json.dumps({"text": text, "meta": {"redpajama_set_name": name}}, ensure_ascii=False)
                out.write(line.encode("utf-8") + b"\n")
        files.append(path)
    return files


def readme(counts: dict[str, int], mb: float, n_files: int) -> str:
    # No timestamps or absolute paths, so the README is as reproducible as the chunks.
    return (
        "Sample corpus in SlimPajama's format: a stand-in, NOT SlimPajama.\n\n"
        "Built by tools/make_sample_corpus.py from the Python standard library "
        f"(Python {sys.version_info.major}.{sys.version_info.minor}) for the quickstart.\n"
        "Files: chunk1/example_train_{k}.jsonl.zst, one JSON object per line: "
        '{"text": ..., "meta": {"redpajama_set_name": ...}}.\n\n'
        "Subsets:\n"
        f"  {GITHUB}: stdlib .py source files, one per document ({counts[GITHUB]} documents)\n"
        f"  {BOOK}: per-module docstrings joined ({counts[BOOK]} documents)\n"
        f"  {WIKI}: help() topics (pydoc_data), the Zen of Python, LICENSE.txt ({counts[WIKI]} documents)\n\n"
        f"Total: {sum(counts.values())} documents, {mb:.2f} MB of text, {n_files} files.\n"
    )


def move_into(built: Path, output: Path) -> None:
    """Put the finished corpus in `built` at `output`: a rename when `output` is new, else its
    files replace the old corpus's one by one, README.txt (the sign of a finished corpus) last."""
    if not output.exists():
        os.rename(built, output)
        return
    for stale in [*output.glob(CHUNKS), output / "README.txt"]:
        stale.unlink(missing_ok=True)  # a new corpus may have fewer chunks than the old one
    (output / "chunk1").mkdir(exist_ok=True)
    for path in [*sorted(built.glob(CHUNKS)), built / "README.txt"]:
        os.replace(path, output / path.relative_to(built))
    shutil.rmtree(built)


def main(argv=None) -> int:
    show_warnings_as_messages("make_sample_corpus")
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--output", type=Path, default=Path("sample_corpus"),
                        help="output folder (default ./sample_corpus); new or empty unless --overwrite")
    parser.add_argument("--max-mb", type=float, default=4.0,
                        help="cap on the total text, in MB of UTF-8 (10^6 bytes; default 4)")
    parser.add_argument("--docs-per-chunk", type=int, default=1000,
                        help="documents per .jsonl.zst file (default 1000)")
    parser.add_argument("--overwrite", action="store_true",
                        help=f"replace the corpus files ({CHUNKS}, README.txt) in an --output "
                             "folder that holds files; other files there are kept")
    args = parser.parse_args(argv)
    if args.docs_per_chunk < 1:
        parser.error("--docs-per-chunk must be at least 1")
    output = args.output
    if output.exists() and not output.is_dir():
        parser.error(f"--output {output} is a file; give a folder")
    held = sorted(p.name + "/" * p.is_dir() for p in output.iterdir()) if output.is_dir() else []
    if held and not args.overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        # A refusal, not a usage mistake: the message alone, without the usage text.
        parser.exit(2, f"{parser.prog}: error: --output {output} already holds files ({shown}); pass "
                       f"--overwrite to replace the corpus files there ({CHUNKS}, README.txt; "
                       "other files are kept), or give a new or empty folder\n")

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = select(collect(stdlib), int(args.max_mb * 1_000_000))
    counts = {name: sum(1 for n, _ in docs if n == name) for name in SUBSETS}
    mb = sum(len(text.encode("utf-8")) for _, text in docs) / 1_000_000
    # Built beside --output, never in it (where a reader would take it for part of the corpus):
    # hidden, on the same file system so that a rename moves it, and removed if anything fails.
    where = output.resolve()  # `--output .` has no name to sit beside
    built = where.parent / f".{where.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        built.mkdir(parents=True)
        files = write(docs, built, args.docs_per_chunk)
        (built / "README.txt").write_text(readme(counts, mb, len(files)), encoding="utf-8")
        move_into(built, output)
    except OSError as error:  # a full disk, a folder we may not write: what and where, no traceback
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    finally:
        shutil.rmtree(built, ignore_errors=True)

    summary = ", ".join(f"{name} {counts[name]}" for name in SUBSETS)
    print(f"sample corpus: {summary} documents; {mb:.2f} MB of text in {len(files)} files under {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
