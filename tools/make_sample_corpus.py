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

``--packages [ROOT ...]`` builds a larger corpus, for studies, from the Python packages under
those folders (with no ROOT: every site-packages folder this interpreter imports from, and its
standard library): every
top-level package or module is one *package*, whose ``.py`` files and sources in other languages
(C/C++/CUDA, stubs, Cython, ...; generated, minified and data-like files left out) are GitHub
documents, whose docstrings (per module) Book documents and whose ``.md``/``.rst``/``.txt`` files
Wikipedia-like ones; a text met twice is kept once. ``--test-suites`` adds the packages' test
suites (left out by default), which SlimPajama's GitHub subset also holds: more tokens where the
packages alone fall short. Whole packages are held out for validation
(``--validation-fraction``, chosen by a hash of their names), so nothing of a validation package
is trained on; the output has SlimPajama's split layout, ``train/chunk1/example_train_{k}.jsonl.zst`` and
``validation/chunk1/example_holdout_{k}.jsonl.zst``, each line's meta also naming its package.
Still a stand-in, NOT SlimPajama: point the same commands at SlimPajama's ``train`` and
``validation`` folders for the real thing.

The corpus is built in a temporary folder beside ``--output`` and moved there when complete,
README.txt last, so an interrupted run leaves no half corpus under that name. A folder that
already holds files is refused; ``--overwrite`` replaces the corpus files in it (other files stay).

Usage: ``python tools/make_sample_corpus.py --output ./sample_corpus [--max-mb 4] [--overwrite]``
       ``python tools/make_sample_corpus.py --output ./packages_corpus --packages [ROOT ...]
       --max-mb 800 [--test-suites] [--validation-fraction 0.02] [--workers 8]``
"""

import argparse
import ast
import codecs
import hashlib
import json
import os
import shutil
import site
import sys
import sysconfig
import uuid
import warnings
from pathlib import Path

import zstandard

from megafp8.messages import show_warnings_as_messages

GITHUB, BOOK, WIKI = "RedPajamaGitHub", "RedPajamaBook", "RedPajamaWikipedia"
SUBSETS = (GITHUB, BOOK, WIKI)
ZSTD_LEVEL = 3  # fixed: same input + same level gives identical bytes
MIN_BOOK_CHARS = 1000  # a module's docstrings must make at least this much prose
# Third-party packages and caches are not "the standard library's code"; test suites are left out
# too unless --packages --test-suites asks for them.
TEST_DIRS = {"test", "tests", "idle_test"}
SKIP_DIRS = TEST_DIRS | {"site-packages", "dist-packages", "__pycache__"}
SKIP_FILES = ("pydoc_data/topics.py",)  # a data file; its text goes to WIKI instead
CHUNKS = "chunk1/example_train_*.jsonl.zst"  # what --overwrite replaces, with README.txt
# --packages: SlimPajama's split layout, and what --overwrite replaces there.
TRAIN_CHUNKS = "train/chunk1/example_train_*.jsonl.zst"
VALIDATION_CHUNKS = "validation/chunk1/example_holdout_*.jsonl.zst"
DOC_SUFFIXES = (".md", ".markdown", ".rst", ".txt")  # a package's documentation files
MIN_DOC_CHARS = 200
# The sources a package ships in other languages are GitHub documents too: RedPajama's GitHub
# subset (the one SlimPajama keeps) took the languages of its extension whitelist (data_prep/github
# of RedPajama-Data v1), which these follow, plus CUDA and Python's stubs and Cython. Markdown and
# reStructuredText are DOC_SUFFIXES here: a package's documentation, the Wikipedia-like prose.
SOURCE_SUFFIXES = (
    ".c",
    ".h",
    ".C",
    ".H",
    ".cc",
    ".hh",
    ".cpp",
    ".hpp",
    ".cxx",
    ".c++",
    ".h++",
    ".cu",
    ".cuh",  # C, C++, CUDA
    ".pyi",
    ".pyx",
    ".pxd",
    ".cs",
    ".java",
    ".scala",
    ".go",
    ".rs",
    ".hs",
    ".jl",
    ".lua",
    ".m",
    ".vb",
    ".smali",
    ".js",
    ".ts",
    ".tsx",
    ".html",
    ".css",
    ".xml",
    ".php",
    ".php3",
    ".php4",
    ".php5",
    ".phps",
    ".phpt",
    ".sh",
    ".bash",
    ".zsh",
    ".command",
    ".bat",
    ".cmd",
    ".ps1",
    ".psd1",
    ".psm1",
    ".pl",
    ".pm",
    ".pod",
    ".perl",
    ".rb",
    ".sql",
    ".tex",
    ".asm",
    ".f",
    ".f77",
    ".f90",
    ".f95",
    ".f03",
    ".f08",
    ".for",
    ".fpp",
    ".cmake",
    ".dockerfile",
    "Dockerfile",
    "Makefile",
)
# RedPajama's GitHub filters, in spirit: generated, minified or data files are not code someone wrote.
MAX_CODE_BYTES = 1_000_000
MAX_LINE_CHARS, MAX_MEAN_LINE_CHARS, MIN_ALNUM_FRACTION = 1000, 100, 0.25

DESCRIPTION = (
    "Write a small corpus with SlimPajama's format (chunk1/example_train_{k}.jsonl.zst, lines "
    '{"text", "meta": {"redpajama_set_name"}}) built from the Python standard library. '
    "A stand-in for the quickstart, NOT SlimPajama."
)


def _skip_dirs(test_suites: bool) -> set:
    """The folder names a package walk leaves out: SKIP_DIRS, less the test suites if wanted."""
    return SKIP_DIRS - TEST_DIRS if test_suites else SKIP_DIRS


def _files(root: Path, suffixes, skip=SKIP_DIRS) -> list[Path]:
    """The files under `root` (a folder, or one file) ending in `suffixes`, in a fixed order,
    outside folders named in `skip`."""
    if root.is_file():
        return [root] if root.name.endswith(suffixes) else []
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]  # prune: site-packages can be huge
        paths += [Path(folder, f) for f in files if f.endswith(suffixes)]
    return sorted(paths, key=lambda p: p.relative_to(root).as_posix() if p != root else "")


def _stdlib_modules(stdlib: Path, skip=SKIP_DIRS):
    """Yield (relative path, source, ast tree) for every parseable .py file under `stdlib` (a
    folder, or one file) outside folders named in `skip`, sorted."""
    for path in _files(stdlib, (".py",), skip):
        rel = path.relative_to(stdlib) if path != stdlib else Path(path.name)
        if path.as_posix().endswith(SKIP_FILES):
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
    nodes = sorted(
        (n for n in ast.walk(tree) if isinstance(n, defs)), key=lambda n: (n.lineno, n.col_offset)
    )
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


def default_package_roots(stdlib: Path) -> list[Path]:
    """Every folder packages are installed to for this interpreter, in its import order, then the
    standard library: pure and platform site-packages and the site's other package folders (a
    Debian or Ubuntu Python also reads /usr/lib/python3/dist-packages, where the system's packages
    live); inside a virtual environment, then the base interpreter's folders too (the machine's
    packages, which the environment hides from imports but which are installed all the same);
    those that exist."""
    paths = sysconfig.get_paths()
    candidates = [
        Path(paths["purelib"]),
        Path(paths["platlib"]),
        *map(Path, site.getsitepackages()),
    ]
    if sys.prefix != sys.base_prefix:
        candidates += map(Path, site.getsitepackages([sys.base_prefix]))
    return [root for root in [*candidates, stdlib] if root.is_dir()]


def packages(roots: list[Path], test_suites: bool = False) -> list[tuple[str, Path]]:
    """(name, path) of every top-level package (a folder holding .py files) or module (a .py
    file) under `roots`, by name; where two roots hold one name, the first root's, as imports
    would find it. Metadata folders (*.dist-info, *.egg-info) and caches are no packages, nor are
    test suites (the standard library's `test`) unless `test_suites`."""
    skip = _skip_dirs(test_suites)
    found = {}
    for root in roots:
        for child in sorted(root.iterdir(), key=lambda p: p.name):
            name = child.name.removesuffix(".py") if child.is_file() else child.name
            if (
                name in found
                or name in skip
                or name.startswith(".")
                or "." in name
                or (child.is_file() and not child.name.endswith(".py"))
            ):
                continue
            if child.is_file() or _files(child, (".py",), skip):
                found[name] = child
    return sorted(found.items())


def source_projects(roots: list[Path], test_suites: bool = False) -> list[tuple[str, Path]]:
    """(name, path) of every project under `roots`, folders of code in other languages (the C and
    C++ headers of /usr/include): each folder in a root, and each source or documentation file
    lying in the root itself, is one project, named ROOT/CHILD (`include/linux`), in name order.
    They are held out for validation whole, like packages."""
    skip = _skip_dirs(test_suites)
    found = {}
    for root in roots:
        for child in sorted(root.iterdir(), key=lambda p: p.name):
            if child.name.startswith(".") or child.name in skip or child.is_symlink():
                continue
            if child.is_dir() or child.name.endswith(SOURCE_SUFFIXES + DOC_SUFFIXES):
                found.setdefault(f"{root.name}/{child.name}", child)
    return sorted(found.items())


def written_code(text: str) -> bool:
    """Whether a source file reads as code someone wrote: not over MAX_CODE_BYTES, no line over
    MAX_LINE_CHARS nor lines of MAX_MEAN_LINE_CHARS on average (generated or minified), at least
    MIN_ALNUM_FRACTION letters and digits (not a data table)."""
    if len(text.encode("utf-8")) > MAX_CODE_BYTES:
        return False
    lines = text.splitlines() or [""]
    if max(map(len, lines)) > MAX_LINE_CHARS or len(text) / len(lines) > MAX_MEAN_LINE_CHARS:
        return False
    return sum(c.isalnum() for c in text) >= MIN_ALNUM_FRACTION * len(text)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def package_documents(name: str, path: Path, test_suites: bool = False) -> list[tuple[str, str]]:
    """(subset, text) of every document of one package, in a fixed order: its .py files and
    their docstrings, its sources in other languages, its documentation files; those of its test
    suites (folders named test/tests) only if `test_suites`. Source files that fail
    `written_code` are dropped here (None in their place, to be counted)."""
    skip = _skip_dirs(test_suites)
    docs = []
    for _, source, tree in _stdlib_modules(path, skip):
        if source.strip():
            docs.append((GITHUB, source if written_code(source) else None))
        prose = _docstrings(tree)
        if len(prose) >= MIN_BOOK_CHARS:
            docs.append((BOOK, prose))
    for source in _files(path, SOURCE_SUFFIXES, skip):
        text = _read_text(source)
        if text and text.strip():
            docs.append((GITHUB, text if written_code(text) else None))
    for doc in _files(path, DOC_SUFFIXES, skip):
        text = (_read_text(doc) or "").strip()
        if len(text) >= MIN_DOC_CHARS:
            docs.append((WIKI, text))
    return docs


def _package_documents(item):
    return package_documents(*item)


def collect_packages(
    roots: list[Path],
    stdlib: Path,
    workers: int = 1,
    test_suites: bool = False,
    sources: list[Path] = (),
) -> tuple[list[tuple[str, str, str]], dict[str, int]]:
    """(subset, package, text) of every document of every package under `roots`, package by
    package in name order, then of every project of `sources` (`source_projects`); with the
    standard library among the roots, its reference prose too (as the package "python-docs"). A
    text met before (a header vendored by two packages) is kept once, where first met, as
    SlimPajama deduplicates; source files that fail `written_code` are left out. Also returns
    how many documents either rule left out. `workers` processes read the packages; the result
    does not depend on their number. `test_suites`: the packages' test suites too."""
    found = packages(roots, test_suites) + source_projects(list(sources), test_suites)
    items = [(name, path, test_suites) for name, path in found]
    if workers > 1 and len(found) > 1:
        import multiprocessing

        # fork where there is one: the workers need nothing but this module, already loaded
        # (also when it was loaded from its path, which a spawned worker could not import).
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with multiprocessing.get_context(method).Pool(workers) as pool:
            per_package = pool.map(_package_documents, items, chunksize=1)
    else:
        per_package = [package_documents(*item) for item in items]
    if any(root.resolve() == stdlib.resolve() for root in roots):
        found.append(("python-docs", None))
        per_package.append([(WIKI, text) for text in _wiki_documents(stdlib)])
    docs, seen = [], set()
    left_out = {"duplicates": 0, "generated or data-like sources": 0}
    for (name, _), package_docs in zip(found, per_package):
        for subset, text in package_docs:
            if text is None:
                left_out["generated or data-like sources"] += 1
                continue
            digest = hashlib.sha256(text.encode("utf-8")).digest()
            if digest in seen:
                left_out["duplicates"] += 1
            else:
                seen.add(digest)
                docs.append((subset, name, text))
    return docs, left_out


def validation_packages(names: list[str], fraction: float) -> set[str]:
    """The packages held out whole: those whose name hashes under `fraction` (stable across
    runs, machines and package sets), and at least one when `fraction` > 0 and there are two."""

    def position(name):
        return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2**64

    held = {name for name in names if position(name) < fraction}
    if fraction > 0 and not held and len(names) > 1:
        held = {min(names, key=position)}
    if len(held) == len(names) and names:
        held.discard(max(names, key=position))  # something is left to train on
    return held


def select(subsets: dict[str, list], max_bytes: int) -> list[tuple[str, object]]:
    """Round-robin across subsets so each is represented; skip documents that would pass the cap.
    A document is its text, or a (package, text) pair."""
    chosen, total = [], 0
    longest = max(len(docs) for docs in subsets.values())
    for i in range(longest):
        for name in SUBSETS:
            if i < len(subsets[name]):
                doc = subsets[name][i]
                size = len((doc if isinstance(doc, str) else doc[1]).encode("utf-8"))
                if total + size <= max_bytes:
                    chosen.append((name, doc))
                    total += size
    return chosen


def write(
    docs: list[tuple[str, object]],
    output: Path,
    docs_per_chunk: int,
    pattern: str = "chunk1/example_train_{k}.jsonl.zst",
) -> list[Path]:
    """Write the chunk files, streaming through zstd so memory stays small. A (package, text)
    document's meta also names its package."""
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    files = []
    for k, start in enumerate(range(0, len(docs), docs_per_chunk)):
        path = output / pattern.format(k=k)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as raw, compressor.stream_writer(raw) as out:
            for name, doc in docs[start : start + docs_per_chunk]:
                meta = {"redpajama_set_name": name}
                if not isinstance(doc, str):
                    meta["package"], doc = doc
                line = json.dumps({"text": doc, "meta": meta}, ensure_ascii=False)
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
    patterns = (CHUNKS, TRAIN_CHUNKS, VALIDATION_CHUNKS)
    for stale in [
        *(p for pattern in patterns for p in output.glob(pattern)),
        output / "README.txt",
    ]:
        stale.unlink(missing_ok=True)  # a new corpus may have fewer chunks than the old one
    for path in [
        *sorted(p for pattern in patterns for p in built.glob(pattern)),
        built / "README.txt",
    ]:
        target = output / path.relative_to(built)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    shutil.rmtree(built)


def packages_readme(
    roots: list[Path],
    train,
    validation,
    held: set,
    left_out: dict,
    mb: float,
    n_files: int,
    test_suites: bool = False,
    sources: list[Path] = (),
) -> str:
    def counts(docs):
        return ", ".join(f"{name} {sum(1 for n, _ in docs if n == name)}" for name in SUBSETS)

    return (
        f"Corpus in SlimPajama's layout built from Python packages{' and other code' * bool(sources)}: "
        "a stand-in, NOT SlimPajama.\n\n"
        f"Built by tools/make_sample_corpus.py --packages{' --test-suites' * test_suites}"
        f"{''.join(f' --sources {root}' for root in sources)} from "
        f"{len({d[0] for _, d in train + validation})} packages and projects: the Python packages under "
        f"{', '.join(map(str, roots))} (Python {sys.version_info.major}.{sys.version_info.minor})"
        f"{''.join(f', the projects of {root}' for root in sources)}.\n"
        "Files: train/chunk1/example_train_{k}.jsonl.zst and validation/chunk1/example_holdout_{k}.jsonl.zst, "
        'one JSON object per line: {"text": ..., "meta": {"redpajama_set_name": ..., "package": ...}}.\n'
        f"Subsets: {GITHUB} (a package's .py files and its sources in other languages: "
        f"{' '.join(SOURCE_SUFFIXES)}), {BOOK} (its docstrings, per module), {WIKI} "
        "(its .md/.rst/.txt files; the interpreter's reference prose as python-docs); "
        f"test suites {'included' if test_suites else 'left out'}.\n"
        f"Left out: {', '.join(f'{n} {what}' for what, n in left_out.items())}.\n\n"
        f"train: {counts(train)} documents\nvalidation: {counts(validation)} documents\n"
        f"Validation packages (held out whole): {', '.join(sorted(held)) or 'none'}\n\n"
        f"Total: {len(train) + len(validation)} documents, {mb:.2f} MB of text, {n_files} files.\n"
    )


def main(argv=None) -> int:
    show_warnings_as_messages("make_sample_corpus")
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("sample_corpus"),
        help="output folder (default ./sample_corpus); new or empty unless --overwrite",
    )
    parser.add_argument(
        "--max-mb",
        type=float,
        default=4.0,
        help="cap on the total text, in MB of UTF-8 (10^6 bytes; default 4)",
    )
    parser.add_argument(
        "--docs-per-chunk",
        type=int,
        default=1000,
        help="documents per .jsonl.zst file (default 1000)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace the corpus files ({CHUNKS} or the --packages splits, README.txt) "
        "in an --output folder that holds files; other files there are kept",
    )
    parser.add_argument(
        "--packages",
        nargs="*",
        type=Path,
        metavar="ROOT",
        help="build from the Python packages under these folders instead (none given: "
        "every site-packages folder of this interpreter and, in a virtual environment, of its base "
        "interpreter, and the standard library), with whole "
        "packages held out in validation/ (SlimPajama's train/validation layout)",
    )
    parser.add_argument(
        "--sources",
        nargs="+",
        type=Path,
        default=[],
        metavar="ROOT",
        help="with --packages: also the code in other languages under these folders (such as "
        "the C and C++ headers of /usr/include), each folder in them one project, held out "
        "whole like a package",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="with --packages: processes reading the packages (the output is the same for any number)",
    )
    parser.add_argument(
        "--test-suites",
        action="store_true",
        help="with --packages: the packages' test suites (test/, tests/) too: more code, "
        "as SlimPajama's GitHub subset has",
    )
    parser.add_argument(
        "--validation-fraction",
        type=float,
        default=0.02,
        help="--packages: the share of packages held out for validation (default 0.02)",
    )
    args = parser.parse_args(argv)
    if args.docs_per_chunk < 1:
        parser.error("--docs-per-chunk must be at least 1")
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: give 1 or more processes")
    if not 0 <= args.validation_fraction < 1:
        parser.error(f"--validation-fraction {args.validation_fraction}: give a share in [0, 1)")
    if args.test_suites and args.packages is None:
        parser.error(
            "--test-suites goes with --packages (the standard-library sample has no test suites)"
        )
    if args.sources and args.packages is None:
        parser.error(
            "--sources goes with --packages (the standard-library sample is the standard library alone)"
        )
    output = args.output
    if output.exists() and not output.is_dir():
        parser.error(f"--output {output} is a file; give a folder")
    held = sorted(p.name + "/" * p.is_dir() for p in output.iterdir()) if output.is_dir() else []
    if held and not args.overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        # A refusal, not a usage mistake: the message alone, without the usage text.
        parser.exit(
            2,
            f"{parser.prog}: error: --output {output} already holds files ({shown}); pass "
            f"--overwrite to replace the corpus files there ({CHUNKS}, README.txt; "
            "other files are kept), or give a new or empty folder\n",
        )

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if args.packages is not None:
        roots = list(
            dict.fromkeys(r.resolve() for r in args.packages or default_package_roots(stdlib))
        )
        sources = list(dict.fromkeys(r.resolve() for r in args.sources))
        for flag, folders in (("--packages", roots), ("--sources", sources)):
            missing = [str(r) for r in folders if not r.is_dir()]
            if missing:
                parser.exit(2, f"{parser.prog}: error: {flag}: no folder {', '.join(missing)}\n")
        found, left_out = collect_packages(roots, stdlib, args.workers, args.test_suites, sources)
        if not found:
            parser.exit(
                2,
                f"{parser.prog}: error: --packages: no Python package or module under "
                f"{', '.join(map(str, roots))}\n",
            )
        docs = select(
            {name: [(p, text) for n, p, text in found if n == name] for name in SUBSETS},
            int(args.max_mb * 1_000_000),
        )
        held = validation_packages(
            sorted({package for _, (package, _) in docs}), args.validation_fraction
        )
        train = [doc for doc in docs if doc[1][0] not in held]
        validation = [doc for doc in docs if doc[1][0] in held]
        mb = sum(len(text.encode("utf-8")) for _, (_, text) in docs) / 1_000_000
    else:
        docs = select(collect(stdlib), int(args.max_mb * 1_000_000))
        counts = {name: sum(1 for n, _ in docs if n == name) for name in SUBSETS}
        mb = sum(len(text.encode("utf-8")) for _, text in docs) / 1_000_000
    # Built beside --output, never in it (where a reader would take it for part of the corpus):
    # hidden, on the same file system so that a rename moves it, and removed if anything fails.
    where = output.resolve()  # `--output .` has no name to sit beside
    built = where.parent / f".{where.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        built.mkdir(parents=True)
        if args.packages is not None:
            files = write(
                train, built, args.docs_per_chunk, "train/chunk1/example_train_{k}.jsonl.zst"
            )
            files += write(
                validation,
                built,
                args.docs_per_chunk,
                "validation/chunk1/example_holdout_{k}.jsonl.zst",
            )
            text = packages_readme(
                roots, train, validation, held, left_out, mb, len(files), args.test_suites, sources
            )
        else:
            files = write(docs, built, args.docs_per_chunk)
            text = readme(counts, mb, len(files))
        (built / "README.txt").write_text(text, encoding="utf-8")
        move_into(built, output)
    except OSError as error:  # a full disk, a folder we may not write: what and where, no traceback
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    finally:
        shutil.rmtree(built, ignore_errors=True)

    if args.packages is not None:
        print(
            f"packages corpus: {len(train)} training documents, {len(validation)} validation documents "
            f"({len(held)} packages held out); {mb:.2f} MB of text in {len(files)} files under {output}"
        )
        return 0
    summary = ", ".join(f"{name} {counts[name]}" for name in SUBSETS)
    print(
        f"sample corpus: {summary} documents; {mb:.2f} MB of text in {len(files)} files under {output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
