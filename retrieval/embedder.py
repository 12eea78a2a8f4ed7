"""Sentence-transformers embeddings: normalised vectors for inner-product search."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from retrieval.model_info import EmbeddingModelInfo, default_model_path, embedding_model_fingerprint, model_name

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 64


class Embedder:
    """A sentence-transformers model on one device.

    Batches (indexing) run on torch's thread pool as configured (`batch_threads`); a single
    query runs on `query_threads` threads (1 by default) so that embedding a question does not
    take cores from an LLM serving on the same machine.
    """

    def __init__(self, model_path: str | Path | None = None, *, device: str = "cpu",
                 batch_size: int = DEFAULT_BATCH_SIZE, query_threads: int = 1,
                 batch_threads: int | None = None) -> None:
        from sentence_transformers import SentenceTransformer

        self.model_path = Path(model_path) if model_path is not None else default_model_path()
        if not (self.model_path / "config.json").is_file() and not (self.model_path / "modules.json").is_file():
            raise FileNotFoundError(f"not a sentence-transformers model folder: {self.model_path}")
        started = time.perf_counter()
        self.model = SentenceTransformer(str(self.model_path), device=device)
        self.batch_size = batch_size
        self.query_threads = query_threads
        self.batch_threads = batch_threads
        self._thread_lock = threading.Lock()
        logger.info("loaded embedding model %s (%d dimensions) from %s in %.1f s", self.name,
                    self.dimension, self.model_path, time.perf_counter() - started)

    @functools.cached_property
    def name(self) -> str:
        return model_name(self.model_path)

    @property
    def dimension(self) -> int:
        return int(self.model.get_embedding_dimension())

    @functools.cached_property
    def info(self) -> EmbeddingModelInfo:
        return EmbeddingModelInfo(name=self.name, dimension=self.dimension,
                                  fingerprint=embedding_model_fingerprint(self.model_path), path=str(self.model_path))

    def embed_documents(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        """Unit-length float32 vectors, one row per text."""
        started = time.perf_counter()
        with self._threads(self.batch_threads):
            vectors = self._encode(texts, progress=progress, as_query=False)
        elapsed = time.perf_counter() - started
        logger.info("embedded %d passages in %.1f s (%.0f passages/s)", len(texts), elapsed,
                    len(texts) / elapsed if elapsed > 0 else float("inf"))
        return vectors

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        """Many queries at once on the batch thread pool (evaluation, benchmarks)."""
        with self._threads(self.batch_threads):
            return self._encode(texts, progress=False, as_query=True)

    def embed_query(self, text: str) -> np.ndarray:
        """One unit-length float32 vector, computed on `query_threads` threads."""
        with self._threads(self.query_threads):
            return self._encode([text], progress=False, as_query=True)[0]

    def _encode(self, texts: Sequence[str], *, progress: bool, as_query: bool) -> np.ndarray:
        # encode_query/encode_document apply the model's own query/document prompts, if any.
        encode = self.model.encode_query if as_query else self.model.encode_document
        vectors = encode(list(texts), batch_size=self.batch_size, show_progress_bar=progress,
                         convert_to_numpy=True, normalize_embeddings=True)
        return np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(texts), self.dimension)

    @contextlib.contextmanager
    def _threads(self, count: int | None) -> Iterator[None]:
        """Run with torch's intra-op pool at `count` threads, restoring the setting after.

        The setting is process-wide, so callers of this embedder take turns.
        """
        with self._thread_lock:
            previous = torch.get_num_threads()
            if count is None or count == previous:
                yield
                return
            torch.set_num_threads(count)
            try:
                yield
            finally:
                torch.set_num_threads(previous)
