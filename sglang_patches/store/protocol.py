"""What the chunk cache asks of the tier below its pool, whichever it is: a directory
(sglang_patches.store.disk), Mooncake through SGLang's HiCache storage interface
(sglang_patches.store.hicache), or either behind the host-memory tier
(sglang_patches.store.host_tier)."""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from picrag_core.chunk_key import StoredChunk


class ChunkStore(Protocol):
    def load(self, chunk: StoredChunk, pool=None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The chunk's (keys, values), or None if absent; CorruptChunkFile for a value that does
        not belong (another model, partition or chunk, a bad digest, a shape `pool` cannot hold)."""

    def save_in_background(self, chunk: StoredChunk, keys: torch.Tensor, values: torch.Tensor, counters) -> bool:
        """Queue a save of copies the caller no longer writes; False when dropped."""

    def wait_for_writes(self) -> None:
        """Block until every queued save is done (tests, shutdown)."""

    def clear(self) -> None:
        """What a flush of the tree drops here: copies in memory; a store that persists keeps them."""
