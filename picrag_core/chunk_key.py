"""The content key of a chunk: one hash of its token ids, used wherever a chunk is named (the
frontend's record of compiled pieces, the engine's chunk store and its tiers, file names).

`StoredChunk` is a chunk with its key, hashed once where a request's plan is built and carried
to every step that names the chunk after it (lease, graft, repair, CacheBlend, tier loads and
saves). Every hash is told to the listeners registered with `on_digest` (the engine counts them
as `picrag_chunk_digests_total`), so a test can hold the rule: one hash per chunk per request.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_listeners: list[Callable[[], None]] = []


def on_digest(listener: Callable[[], None]) -> None:
    """Call `listener` on every chunk key this process computes from now on."""
    _listeners.append(listener)


def chunk_key(token_ids: Sequence[int]) -> str:
    for listener in _listeners:
        listener()
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()


@dataclass(frozen=True)
class StoredChunk:
    """A chunk as the store holds it (behind its sinks, with its tail) and its content key."""

    tokens: tuple[int, ...]
    digest: str  # chunk_key(tokens)

    @classmethod
    def of(cls, tokens: Sequence[int]) -> StoredChunk:
        tokens = tuple(tokens)
        return cls(tokens, chunk_key(tokens))

    def __len__(self) -> int:
        return len(self.tokens)
