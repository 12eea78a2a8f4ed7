"""The chunk store on SGLang's HiCache storage interface: compiled chunks in a distributed KV store
(Mooncake), shared by every engine that reaches it.

The backend is the one SGLang's HiCache uses: `StorageBackendFactory.create_backend("mooncake",
HiCacheStorageConfig, ...)` builds `MooncakeStore` (sglang/srt/mem_cache/storage/mooncake_store),
and picrag calls its key-value methods (`exists`, `set`, `get`). A chunk is one value under
``picrag/<model fingerprint>/<partition>/<chunk key>``, framed by sglang_patches.store.codec
(header with the identity, shapes and SHA-256, then K and V), so every load checks identity,
shape and digest and a bad value is a counted reject, never KV. The frame's length follows from
the pool's layout and the chunk's length, so it is read straight into a buffer of that size:
MooncakeStore's `set`/`get` are zero copy from and into buffers registered with the store
(`register_buffer`), one per direction, grown when a longer chunk comes.

Failure is a miss. Every store call runs on a `TimedLane` (sglang_patches.store.calls) with a
timeout, and a store past its timeout is skipped for BACKOFF_S; a down, slow or full store
raises StoreUnavailable, which the chunk cache counts (``store_failures``) before computing the
chunk, and a failed save is a counted write failure.
The engine connects in the background: it waits CONNECT_WAIT_S for the store at start, then
serves without it (every lookup a counted failure) and keeps retrying every RECONNECT_S.
Loads run on the scheduler's thread, saves on the chunk writer's (sglang_patches.store.writer).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from picrag_core.chunk_key import StoredChunk
from sglang_patches.store.codec import ChunkIdentity, CorruptChunkFile, KVLayout, decode_frame, encode_frame, frame_bytes
from picrag_core.chunk_store_spec import MooncakeSpec
from sglang_patches.store.writer import ChunkStoreWriter
from sglang_patches.store.calls import StoreUnavailable, TimedLane

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0  # per store call: a chunk store that answers slower than this is no faster than recompute
BACKOFF_S = 30.0  # after a call past its timeout, the store is skipped (counted misses) this long
CONNECT_WAIT_S = 60.0
RECONNECT_S = 5.0
MIN_STAGING_BYTES = 16 << 20


def mooncake_backend(spec: MooncakeSpec, ranks: dict[str, tuple[int, int]]) -> Any:
    """SGLang's MooncakeStore for `spec`, built by SGLang's storage backend factory."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    (tp_rank, tp_size), (pp_rank, pp_size) = ranks["tp"], ranks["pp"]
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=None,  # picrag's keys name the model (its fingerprint) themselves
        extra_config=spec.extra_config(),
    )
    # No host pool: picrag registers its own staging buffers (standalone_storage is off).
    return StorageBackendFactory.create_backend("mooncake", config, None)


class _Staging:
    """A host buffer registered with the backend for zero-copy transfers, grown on demand. Used
    only inside its lane's calls, so never by two transfers at once."""

    def __init__(self, backend: Any):
        self._backend = backend
        self._buffer: Optional[torch.Tensor] = None

    def at_least(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            old = self._buffer
            size = max(nbytes, MIN_STAGING_BYTES, 2 * old.numel() if old is not None else 0)
            self._buffer = torch.empty(size, dtype=torch.uint8)
            self._backend.register_buffer(self._buffer)
            if old is not None:
                self._backend.store.unregister_buffer(old.data_ptr())
        return self._buffer[:nbytes]


class HiCacheChunkStore:
    def __init__(self, connect: Callable[[], Any], fingerprint: str, partition: str,
                 timeout_s: float = DEFAULT_TIMEOUT_S, connect_wait_s: float = CONNECT_WAIT_S,
                 reconnect_s: float = RECONNECT_S, backoff_s: float = BACKOFF_S, name: str = "store"):
        """`connect` builds the HiCacheStorage backend (it may block or raise while the store is
        down: it is retried off the caller's thread)."""
        self.fingerprint = fingerprint
        self.partition = partition
        self.name = name
        self._reads = TimedLane(f"{name}-reads", timeout_s, answers=(CorruptChunkFile,), backoff_s=backoff_s)
        self._writes = TimedLane(f"{name}-writes", timeout_s, backoff_s=backoff_s)
        self._backend: Any = None
        self._staging: dict[str, _Staging] = {}
        self._connected = threading.Event()
        self._writer = ChunkStoreWriter(self)
        threading.Thread(target=self._connect, args=(connect, reconnect_s), name="picrag-store-connect",
                         daemon=True).start()
        if not self._connected.wait(connect_wait_s):
            logger.error("chunk store %s not reachable after %.0f s: serving without it (misses, counted) "
                         "while connecting", name, connect_wait_s)

    def _connect(self, connect: Callable[[], Any], reconnect_s: float) -> None:
        while True:
            try:
                backend = connect()
            except Exception as exc:  # the store is down or misconfigured: retry, the engine serves meanwhile
                logger.warning("chunk store %s: cannot connect (%s: %s); retrying in %.0f s",
                               self.name, type(exc).__name__, exc, reconnect_s)
                time.sleep(reconnect_s)
                continue
            self._staging = {"reads": _Staging(backend), "writes": _Staging(backend)}
            self._backend = backend
            self._connected.set()
            logger.info("chunk store %s connected (%s)", self.name, type(backend).__name__)
            return

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def _identity(self, chunk: StoredChunk) -> ChunkIdentity:
        return ChunkIdentity(self.fingerprint, self.partition, chunk.digest)

    def storage_key(self, identity: ChunkIdentity) -> str:
        return f"picrag/{identity.fingerprint}/{identity.partition}/{identity.chunk_key}"

    def _backend_or_raise(self) -> Any:
        if not self._connected.is_set():
            raise StoreUnavailable(f"chunk store {self.name}: not connected")
        return self._backend

    def load(self, chunk: StoredChunk, pool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The chunk's (keys, values) for `pool`, or None if the store has none; CorruptChunkFile
        for a value that is not this chunk's, StoreUnavailable when the store did not answer."""
        backend = self._backend_or_raise()
        identity = self._identity(chunk)
        key, tokens, layout = self.storage_key(identity), len(chunk), KVLayout.of_pool(pool)

        def fetch() -> Optional[torch.Tensor]:
            if not backend.exists(key):
                return None
            nbytes = frame_bytes(layout, tokens)
            frame = self._staging["reads"].at_least(nbytes)
            if not backend.get(key, target_location=frame.data_ptr(), target_sizes=nbytes):
                raise StoreUnavailable(f"chunk store {self.name}: get of {key} failed")
            return decode_frame(frame, identity, tokens, layout)  # copies out of the staging buffer

        return self._reads.call(fetch)

    def save(self, chunk: StoredChunk, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Store the chunk (a no-op when the store has it); raises when the store refused it or
        did not answer. Returns the evictions it caused: none the engine sees (the store evicts
        on its own)."""
        backend = self._backend_or_raise()
        identity = self._identity(chunk)
        key = self.storage_key(identity)

        def put() -> None:
            if backend.exists(key):
                return
            nbytes = frame_bytes(KVLayout(keys.shape[0], tuple(keys.shape[2:]), keys.dtype,
                                          tuple(values.shape[2:]), values.dtype), len(chunk))
            frame = self._staging["writes"].at_least(nbytes)
            encode_frame(identity, keys, values, frame)
            if not backend.set(key, target_location=frame.data_ptr(), target_sizes=nbytes):
                raise OSError(f"chunk store {self.name} refused {nbytes} bytes for {key} (full?)")

        self._writes.call(put)
        return 0

    def save_in_background(self, chunk: StoredChunk, keys: torch.Tensor, values: torch.Tensor, counters) -> bool:
        return self._writer.submit(chunk, keys, values, counters)

    def wait_for_writes(self) -> None:
        self._writer.wait_idle()

    def clear(self) -> None:
        """A flush keeps what Mooncake holds: the store is shared with other engines."""
