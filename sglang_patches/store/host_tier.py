"""The chunk cache's host-memory tier: compiled chunks kept in RAM between the device pool and the
chunk store, so that a chunk evicted from the pool is reloaded from memory before the store.

`HostChunkTier` wraps a chunk store (sglang_patches.store.disk or
sglang_patches.store.hicache) and has its interface. A save keeps a host copy of the
chunk's KV (its own, made off the pool) and hands the chunk on to the store; a load looks in RAM
first (``host_loads``), then in the store (``store_loads``) and keeps what the store returned.
What it holds was checked when it entered (copied from this process's pool, or loaded through
the store's integrity checks), and it is keyed by chunk key within one process (one model
fingerprint and partition), so a RAM hit needs no check. Least recently used chunks leave first
when the tier would exceed its bound (``host_evictions``); flushing the cache empties it.

Why not SGLang's host pool (`HostKVCache`): it is a per-token slot pool fed by HiCache's
controller and moved by sgl_kernel's transfer kernels, which the CPU build lacks; a chunk here is
one object, reloaded whole into fresh device slots by the chunk cache.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from picrag_core.chunk_key import StoredChunk
from sglang_patches.store.protocol import ChunkStore
from sglang_patches.store.writer import on_host

logger = logging.getLogger(__name__)

DEFAULT_HOST_BYTES = 2 << 30


class _Counters(Protocol):
    def add(self, name: str, amount: int = 1) -> None: ...


@dataclass
class _HostCopy:
    keys: torch.Tensor
    values: torch.Tensor
    ready: Optional[torch.cuda.Event]  # set once a copy from a GPU has landed

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.keys, self.values


class HostChunkTier:
    """Runs on the scheduler's thread only (saves and loads both come from the chunk cache)."""

    def __init__(self, store: ChunkStore, max_bytes: int, counters: _Counters):
        self.store = store
        self.max_bytes = max_bytes
        self.counters = counters
        self._chunks: OrderedDict[str, _HostCopy] = OrderedDict()  # least recently used first
        self._bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def _keep(self, key: str, copy: _HostCopy) -> None:
        if copy.nbytes > self.max_bytes:
            return
        old = self._chunks.pop(key, None)
        self._bytes += copy.nbytes - (old.nbytes if old is not None else 0)
        self._chunks[key] = copy
        while self._bytes > self.max_bytes:
            _, victim = self._chunks.popitem(last=False)
            self._bytes -= victim.nbytes
            self.counters.add("host_evictions")

    def save_in_background(self, chunk: StoredChunk, keys: torch.Tensor, values: torch.Tensor, counters) -> bool:
        """Keep a host copy and queue the store's save; keys/values are the caller's own copies."""
        (host_keys, host_values), ready = on_host(keys, values)
        self._keep(chunk.digest, _HostCopy(host_keys, host_values, ready))
        return self.store.save_in_background(chunk, keys, values, counters)

    def load(self, chunk: StoredChunk, pool=None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        key = chunk.digest
        copy = self._chunks.get(key)
        if copy is not None:
            self._chunks.move_to_end(key)
            self.counters.add("host_loads")
            return copy.tensors()
        loaded = self.store.load(chunk, pool)  # raises what the store raises: the caller counts it
        if loaded is not None:
            self.counters.add("store_loads")
            self._keep(key, _HostCopy(*loaded, None))
        return loaded

    def wait_for_writes(self) -> None:
        self.store.wait_for_writes()

    def clear(self) -> None:
        self._chunks.clear()
        self._bytes = 0
