"""examples/prepare_sample_data.sh: a fresh folder, a re-run, and a half-finished corpus."""

import os
import subprocess
import sys
from pathlib import Path

from megafp8.data.indexed_dataset import IndexedDataset
from megafp8.data.tokenizers import build_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "prepare_sample_data.sh"


def prepare(cwd, workdir, vocab="512"):
    # `python` in the script must be this interpreter (the one with megafp8 installed).
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    return subprocess.run(
        ["bash", str(SCRIPT), workdir, vocab], cwd=cwd, env=env, capture_output=True, text=True
    )


def snapshot(folder):
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()}


def test_fresh_folder_then_a_rerun_that_keeps_everything(tmp_path):
    done = prepare(tmp_path, "work")  # relative to where it is called from, not the repository
    assert done.returncode == 0, done.stderr
    work = tmp_path / "work"
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=work / "tokenizer")
    assert tokenizer.vocab_size == 512
    data = IndexedDataset(work / "data" / "sample_text_document")
    assert len(data) > 100 and int(data[0][-1]) == tokenizer.eod
    before = snapshot(work)

    again = prepare(tmp_path, str(work))
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("prepare_sample_data: kept ") == 3, again.stdout
    assert snapshot(work) == before


def test_a_half_finished_corpus_is_not_used(tmp_path):
    chunk = tmp_path / "work" / "corpus" / "chunk1" / "example_train_0.jsonl.zst"
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(b"cut short")  # no README.txt: the corpus was never finished
    done = prepare(tmp_path, "work")
    assert done.returncode != 0
    assert "already holds files (chunk1/); pass --overwrite" in done.stderr, done.stderr
    assert chunk.read_bytes() == b"cut short"
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["corpus"]  # no later step ran
