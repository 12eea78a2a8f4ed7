"""The chunk cache's host tier: compiled chunk KV persisted on disk, reloaded on demand.

One safetensors file per chunk under ``<root>/<model fingerprint>/<partition>/<chunk key>.safetensors``
with the chunk's K and V for every layer this process holds (K at local positions 0..n-1, as in
the pool). The fingerprint (picrag_core.model_fingerprint) names the model; the partition
(`partition_name`) names what makes one process's KV differ from another's serving the same
model: its tensor/pipeline/context-parallel rank and the server options that change KV. The
file's metadata repeats fingerprint, partition and chunk key and carries a SHA-256 of the tensor
bytes, so a truncated, corrupted or foreign file is detected, reported and ignored (the chunk is
recomputed and the file rewritten), never used.

A write goes to a temporary file that is fsynced before it is renamed, and the directory is
fsynced after, so a crash never leaves part of a file under a final name; temporaries whose
writer is gone are removed when a store opens. The store's files are kept under a size bound,
least recently used (saved or loaded) evicted first; a load touches the file's mtime so that
the order survives a restart. Saves run on a background thread (`save_in_background`,
sglang_patches.store.writer) so that the scheduler never waits on the disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as serialize_tensors

from picrag_core.chunk_key import StoredChunk
from sglang_patches.store.codec import CorruptChunkFile, KVLayout, check_layout, tensor_digest
from sglang_patches.store.writer import ChunkStoreWriter

logger = logging.getLogger(__name__)

# Without a bound: this fraction of the filesystem's free space (plus what the store holds).
DEFAULT_FREE_SPACE_FRACTION = 0.10
# SGLang server options that change what KV a model computes or how it is kept.
KV_SERVER_OPTIONS = ("dtype", "kv_cache_dtype", "quantization", "quantization_param_path",
                     "json_model_override_args", "load_format", "revision")
_SUFFIX = ".safetensors"
_TEMPORARY = ".tmp-"


def partition_name(ranks: dict[str, tuple[int, int]], kv_options: dict[str, object]) -> str:
    """A directory name for one process's share of a model's KV: its (rank, size) per parallel
    dimension, and a digest of the server options that change KV (dtypes, quantisation, config
    overrides)."""
    parts = [f"{name}{rank}of{size}" for name, (rank, size) in sorted(ranks.items())]
    options = json.dumps(kv_options, sort_keys=True, default=str)
    parts.append("kv" + hashlib.sha256(options.encode()).hexdigest()[:12])
    return "-".join(parts)


def _write_durably(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:  # os.write may write less than asked (a filling disk) without raising
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskChunkStore:
    def __init__(self, root: Path, fingerprint: str, partition: str = "",
                 max_bytes: Optional[int] = None, processes: int = 1):
        """`max_bytes` bounds the chunk files of the `processes` stores of one server (each keeps
        its share); None: DEFAULT_FREE_SPACE_FRACTION of the free space at start."""
        self.fingerprint = fingerprint
        self.partition = partition
        self.directory = Path(root) / fingerprint / partition
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # chunk key -> file bytes, least recently used first; guarded by _lock (the writer
        # thread saves and evicts, the scheduler's thread loads).
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._remove_stale_temporaries()
        self._index_files()
        if max_bytes is None:
            max_bytes = int(DEFAULT_FREE_SPACE_FRACTION * (shutil.disk_usage(self.directory).free + self._bytes * processes))
        self.max_bytes = max_bytes // processes
        evicted = self._evict_over_budget()
        if evicted:
            logger.info("chunk store %s: evicted %d files to fit %d bytes", self.directory, evicted, self.max_bytes)
        self._writer = ChunkStoreWriter(self)

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def path_of(self, key: str) -> Path:
        return self.directory / f"{key}{_SUFFIX}"

    def _remove_stale_temporaries(self) -> None:
        # Every temporary a writer makes holds _TEMPORARY followed by its pid, wherever in the name.
        for path in self.directory.glob(f"*{_TEMPORARY}*"):
            pid = path.name.rpartition(_TEMPORARY)[2]
            if not pid.isdigit() or not _process_alive(int(pid)):
                path.unlink(missing_ok=True)
                logger.info("removed stale temporary chunk file %s", path)

    def _index_files(self) -> None:
        files = []
        for path in self.directory.glob(f"*{_SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            files.append((stat.st_mtime_ns, path.name, stat.st_size))
        for _, name, size in sorted(files):
            self._sizes[name.removesuffix(_SUFFIX)] = size
            self._bytes += size

    def _evict_over_budget(self, key: str | None = None, size: int = 0) -> int:
        """Record `key` (if given) as most recently used with `size` bytes, then remove least
        recently used files until the store fits; returns the files removed. The files are
        picked under _lock and deleted after it, so a load on the scheduler's thread never
        waits on the writer's deletes."""
        with self._lock:
            if key is not None:
                self._bytes += size - self._sizes.pop(key, 0)
                self._sizes[key] = size
            victims = []
            while self._bytes > self.max_bytes and self._sizes:
                victim, victim_size = self._sizes.popitem(last=False)
                self._bytes -= victim_size
                victims.append(self.path_of(victim))
        for path in victims:
            path.unlink(missing_ok=True)
        return len(victims)

    def save(self, chunk: StoredChunk, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Write `chunk` (keys/values [layers, tokens, kv_heads, head_dim], on the
        host) and return how many files were evicted to stay within the bound. Raises on a failed
        write (OSError, SafetensorError), leaving no file of it behind."""
        key = chunk.digest
        keys, values = keys.detach().cpu().contiguous(), values.detach().cpu().contiguous()
        metadata = {
            "fingerprint": self.fingerprint,
            "partition": self.partition,
            "chunk_key": key,
            "tokens": str(len(chunk)),
            "sha256": tensor_digest(keys, values),
        }
        data = serialize_tensors({"k": keys, "v": values}, metadata=metadata)
        target = self.path_of(key)
        temporary = target.with_name(f"{target.name}{_TEMPORARY}{os.getpid()}")
        try:
            _write_durably(temporary, data)
            os.replace(temporary, target)
        finally:
            temporary.unlink(missing_ok=True)
        _fsync_directory(self.directory)
        return self._evict_over_budget(key, len(data))

    def save_in_background(self, chunk: StoredChunk, keys: torch.Tensor, values: torch.Tensor, counters) -> bool:
        """Queue a save and return at once; False, counted as ``disk_saves_dropped``, when the
        writer's queue is full. keys/values (host or device) must be copies the caller no longer
        writes, not views of the pool."""
        return self._writer.submit(chunk, keys, values, counters)

    def wait_for_writes(self) -> None:
        """Block until every queued save is done (tests, shutdown)."""
        self._writer.wait_idle()

    def clear(self) -> None:
        """A flush keeps the files: they are the store, shared with other engines."""

    def load(self, chunk: StoredChunk, pool=None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The chunk's (keys, values), or None if absent; a bad file, or one whose tensors do not
        fit `pool` (layers, KV heads, head dims, dtypes), raises CorruptChunkFile."""
        key = chunk.digest
        path = self.path_of(key)
        try:
            # One read: an eviction racing this load cannot leave it half a file.
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CorruptChunkFile(f"{path}: unreadable ({exc})") from exc
        try:
            tensors = load_tensors(data)
            header_len = int.from_bytes(data[:8], "little")
            metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
        except (SafetensorError, ValueError, AttributeError) as exc:
            raise CorruptChunkFile(f"{path}: unreadable ({exc})") from exc
        keys, values = tensors.get("k"), tensors.get("v")
        if (metadata.get("fingerprint") != self.fingerprint or metadata.get("chunk_key") != key
                or metadata.get("partition", "") != self.partition):
            raise CorruptChunkFile(f"{path}: written for another model, process or chunk")
        if keys is None or values is None or keys.dim() < 2 or keys.shape[:2] != values.shape[:2] \
                or keys.shape[1] != len(chunk):
            raise CorruptChunkFile(f"{path}: tensors do not match the chunk")
        if pool is not None:
            check_layout(path, keys, values, KVLayout.of_pool(pool), len(chunk))
        if metadata.get("sha256") != tensor_digest(keys, values):
            raise CorruptChunkFile(f"{path}: checksum mismatch")
        self._evict_over_budget(key, len(data))
        try:
            os.utime(path)
        except OSError:
            pass  # evicted meanwhile, or a read-only store: the order is only kept in memory
        return keys, values
