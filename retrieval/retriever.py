"""The retrieval API the frontend uses: question in, best passages with scores out."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from retrieval.embedder import Embedder
from retrieval.model_info import default_model_path
from retrieval.index import HnswSettings, PassageIndex, RetrievalIndexError, read_manifest
from retrieval.passage import Passage

logger = logging.getLogger(__name__)


class Retriever:
    """A passage index with the embedding model that built it."""

    def __init__(self, index: PassageIndex, embedder: Embedder) -> None:
        if embedder.info != index.embedding:
            raise RetrievalIndexError(f"index was built with embedding model {index.embedding.describe()}, "
                                      f"not with {embedder.info.describe()}")
        self.index = index
        self.embedder = embedder

    @classmethod
    def create(cls, embedder: Embedder | None = None, kind: str = "flat",
               hnsw: HnswSettings | None = None) -> Retriever:
        """An empty in-memory retriever."""
        embedder = embedder or Embedder()
        return cls(PassageIndex(embedder.info, kind, hnsw), embedder)

    @classmethod
    def open(cls, index_dir: str | Path, embedder: Embedder | None = None) -> Retriever:
        """Load a saved index. Without `embedder`, the model recorded in the index is loaded
        (the default model if that folder is gone); either way it must be the model that built
        the index."""
        if embedder is None:
            recorded = Path(read_manifest(index_dir)["embedding_model"].get("path") or default_model_path())
            embedder = Embedder(recorded if recorded.is_dir() else default_model_path())
        return cls(PassageIndex.load(index_dir, embedder.info), embedder)

    def __len__(self) -> int:
        return len(self.index)

    def add(self, passages: Iterable[Passage], *, progress: bool = False) -> int:
        """Embed and add the passages not yet in the index; returns how many were added."""
        fresh = self.index.new_passages(passages)
        if not fresh:
            return 0
        vectors = self.embedder.embed_documents([passage.embedding_text() for passage in fresh], progress=progress)
        return self.index.add(fresh, vectors)

    def save(self, index_dir: str | Path) -> None:
        self.index.save(index_dir)

    def search(self, question: str, k: int = 5) -> list[Passage]:
        """The `k` passages most similar to `question`, best first, each with its score."""
        started = time.perf_counter()
        results = self.index.search(self.embedder.embed_query(question), k)[0]
        logger.debug("retrieved %d passages in %.1f ms", len(results), 1e3 * (time.perf_counter() - started))
        return results

    def search_many(self, questions: Sequence[str], k: int = 5) -> list[list[Passage]]:
        """`search` for many questions, embedded as one batch."""
        return self.index.search(self.embedder.embed_queries(questions), k)
