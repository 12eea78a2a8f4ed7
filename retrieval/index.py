"""A FAISS index of passages, persisted to a directory and verified when loaded.

Directory layout: `index.faiss` (row i is the vector of passage i), `passages.jsonl` (one
passage a line, in row order) and `manifest.json` (embedding model, kind, count and the
SHA-256 of both data files). A save replaces the directory's contents as a whole
(retrieval.directory_swap): a failed or interrupted save leaves the previous index as it was,
and a reader sees the old index or the new one, never a mix. A read-modify-write (`picrag index
add`) holds `index_lock` throughout, so concurrent writers wait for each other instead of
overwriting each other's passages.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from picrag_core.directory_lock import directory_lock
from retrieval.directory_swap import DirectorySwapError, replace_directory
from retrieval.model_info import EmbeddingModelInfo
from retrieval.passage import Passage
from picrag_core.file_digest import file_sha256

logger = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
PASSAGES_FILE = "passages.jsonl"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
INDEX_KINDS = ("flat", "hnsw")
_MANIFEST_KEYS = frozenset({"kind", "count", "embedding_model", "hnsw", "sha256"})


class RetrievalIndexError(Exception):
    """An index directory that cannot be used as asked: missing, corrupt, or built with a
    different embedding model."""


@dataclasses.dataclass(frozen=True)
class HnswSettings:
    """Graph degree and search breadths; recall rises with `ef_search` at some latency."""

    m: int = 32
    ef_construction: int = 200
    ef_search: int = 128


class PassageIndex:
    """Passages and their vectors; inner product of unit vectors, i.e. cosine similarity."""

    def __init__(self, embedding: EmbeddingModelInfo, kind: str = "flat",
                 hnsw: HnswSettings | None = None) -> None:
        if kind not in INDEX_KINDS:
            raise ValueError(f"unknown index kind {kind!r}: expected one of {INDEX_KINDS}")
        self.embedding = embedding
        self.kind = kind
        self.hnsw = (hnsw or HnswSettings()) if kind == "hnsw" else None
        self._faiss = self._new_faiss_index()
        self._passages: list[Passage] = []
        self._rows: dict[str, int] = {}

    def _new_faiss_index(self) -> faiss.Index:
        if self.hnsw is None:
            return faiss.IndexFlatIP(self.embedding.dimension)
        index = faiss.IndexHNSWFlat(self.embedding.dimension, self.hnsw.m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = self.hnsw.ef_construction
        return index

    def __len__(self) -> int:
        return len(self._passages)

    def __contains__(self, passage_id: object) -> bool:
        return passage_id in self._rows

    @property
    def passages(self) -> Sequence[Passage]:
        return tuple(self._passages)

    def new_passages(self, passages: Iterable[Passage]) -> list[Passage]:
        """The passages whose ids are neither in the index nor earlier in `passages`."""
        seen = set(self._rows)
        fresh = []
        for passage in passages:
            if passage.id not in seen:
                seen.add(passage.id)
                fresh.append(passage)
        return fresh

    def add(self, passages: Sequence[Passage], vectors: np.ndarray) -> int:
        """Add passages with their vectors (row i for passage i); ids already present are skipped.
        Returns the number added."""
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.shape != (len(passages), self.embedding.dimension):
            raise ValueError(f"expected vectors of shape ({len(passages)}, {self.embedding.dimension}), "
                             f"got {vectors.shape}")
        rows: list[int] = []
        taken: set[str] = set()
        for row, passage in enumerate(passages):
            if passage.id not in self._rows and passage.id not in taken:
                taken.add(passage.id)
                rows.append(row)
        if rows:
            self._faiss.add(np.ascontiguousarray(vectors[rows]))
        for row in rows:
            self._rows[passages[row].id] = len(self._passages)
            self._passages.append(passages[row])
        return len(rows)

    def search(self, vectors: np.ndarray, k: int) -> list[list[Passage]]:
        """The `k` best passages for each query vector, best first, with their scores."""
        vectors = np.ascontiguousarray(np.atleast_2d(vectors), dtype=np.float32)
        k = min(k, len(self._passages))
        if k <= 0:
            return [[] for _ in vectors]
        # Per-call parameters rather than the index's own efSearch: safe under concurrent searches.
        params = faiss.SearchParametersHNSW(efSearch=max(self.hnsw.ef_search, k)) if self.hnsw else None
        scores, rows = self._faiss.search(vectors, k, params=params)
        return [[self._passages[row].with_score(float(score)) for score, row in zip(query_scores, query_rows) if row >= 0]
                for query_scores, query_rows in zip(scores, rows)]

    def save(self, directory: str | Path) -> None:
        """Write the index to `directory`, replacing whatever index it held as a whole."""
        try:
            replace_directory(directory, self._write_files, owned=(INDEX_FILE, PASSAGES_FILE, MANIFEST_FILE))
        except DirectorySwapError as error:
            raise RetrievalIndexError(f"cannot save the index: {error}") from None
        logger.info("saved %s index of %d passages to %s", self.kind, len(self), directory)

    def _write_files(self, directory: Path) -> None:
        faiss.write_index(self._faiss, str(directory / INDEX_FILE))
        with (directory / PASSAGES_FILE).open("w", encoding="utf-8") as stream:
            for passage in self._passages:
                stream.write(json.dumps(passage.to_json(), ensure_ascii=False) + "\n")
        manifest = self._manifest({name: file_sha256(directory / name) for name in (INDEX_FILE, PASSAGES_FILE)})
        (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")

    def _manifest(self, checksums: dict[str, str]) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "count": len(self._passages),
            "dimension": self.embedding.dimension,
            "embedding_model": self.embedding.to_json(),
            "hnsw": dataclasses.asdict(self.hnsw) if self.hnsw else None,
            "sha256": checksums,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }

    @classmethod
    def load(cls, directory: str | Path, embedding: EmbeddingModelInfo | None = None) -> PassageIndex:
        """Load and verify an index; with `embedding`, refuse one built with another model."""
        directory = Path(directory)
        manifest = read_manifest(directory)
        built_with = EmbeddingModelInfo.from_json(manifest["embedding_model"])
        if embedding is not None and embedding != built_with:
            raise RetrievalIndexError(
                f"index {directory} was built with embedding model {built_with.describe()}, "
                f"not with {embedding.describe()}: use the same model (--embedding-model) or build a new index")
        for name in (INDEX_FILE, PASSAGES_FILE):
            path = directory / name
            if not path.is_file():
                raise RetrievalIndexError(f"index {directory} is incomplete: {name} is missing")
            if file_sha256(path) != manifest["sha256"][name]:
                raise RetrievalIndexError(
                    f"{path} is corrupt or was changed after the index was saved: its SHA-256 differs "
                    f"from the one in {MANIFEST_FILE}; rebuild the index")
        index = cls(built_with, manifest["kind"],
                    HnswSettings(**manifest["hnsw"]) if manifest["hnsw"] else None)
        index._faiss = faiss.read_index(str(directory / INDEX_FILE))
        with (directory / PASSAGES_FILE).open(encoding="utf-8") as stream:
            index._passages = [Passage.from_json(json.loads(line)) for line in stream]
        index._rows = {passage.id: row for row, passage in enumerate(index._passages)}
        counts = {"manifest": manifest["count"], "faiss": index._faiss.ntotal,
                  "passages": len(index._passages), "distinct ids": len(index._rows)}
        if len(set(counts.values())) != 1 or index._faiss.d != built_with.dimension:
            raise RetrievalIndexError(f"index {directory} is inconsistent: counts {counts}, "
                                      f"vector dimension {index._faiss.d} vs {built_with.dimension}")
        logger.info("loaded %s index of %d passages from %s", index.kind, len(index), directory)
        return index


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise RetrievalIndexError(f"no index at {directory}: {MANIFEST_FILE} is missing")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RetrievalIndexError(f"{path} is corrupt: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise RetrievalIndexError(f"{path} is not a version {FORMAT_VERSION} picrag index manifest")
    missing = _MANIFEST_KEYS - manifest.keys()
    if missing:
        raise RetrievalIndexError(f"{path} is corrupt: it lacks {sorted(missing)}")
    return manifest


def index_exists(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST_FILE).is_file()


def index_lock(directory: str | Path) -> AbstractContextManager[None]:
    """Exclusive across processes: hold it from reading an index to saving its successor, so
    that another writer's passages are never overwritten. `save` takes it too (re-entrant)."""
    return directory_lock(directory)


