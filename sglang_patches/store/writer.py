"""Chunk saves off the scheduler's thread: decoding never waits on a disk.

`submit` takes a copy of a chunk's KV made off the pool (moved asynchronously into pinned host
memory when it is on a GPU) and queues it for one background thread, which writes it through
the store. The bytes waiting are bounded: a save that does not fit is dropped (its chunk stays
cached in memory and is recomputed after a restart), never waited for. A failed write (a full
disk, an I/O error) is logged and dropped; the thread goes on.

Outcomes are counted in the counters the submitting cache passes: ``disk_saves_dropped`` by the
submitting thread; ``disk_saves``, ``disk_write_failures`` and ``disk_evictions`` by the writer
thread. Each counter has one writing thread, so no increment is lost.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from picrag_core.chunk_key import StoredChunk

logger = logging.getLogger(__name__)

# Host memory that queued saves may hold: a few chunks of a large model.
DEFAULT_MAX_PENDING_BYTES = 256 << 20


class _Store(Protocol):
    def save(self, chunk: StoredChunk, keys: torch.Tensor, values: torch.Tensor) -> int: ...


class _Counters(Protocol):
    def add(self, name: str, amount: int = 1) -> None: ...


@dataclass
class _Job:
    chunk: StoredChunk
    keys: torch.Tensor
    values: torch.Tensor
    ready: Optional[torch.cuda.Event]  # set once the device-to-host copies are done
    counters: _Counters

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def on_host(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], Optional[torch.cuda.Event]]:
    """`tensors` in host memory: as they are on the host; from a GPU, pinned copies queued on the
    current stream, whose end the event marks."""
    if not any(t.is_cuda for t in tensors):
        return list(tensors), None
    copies = []
    for tensor in tensors:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        copies.append(host)
    ready = torch.cuda.Event()
    ready.record()
    return copies, ready


class ChunkStoreWriter:
    def __init__(self, store: _Store, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES):
        self._store = store
        self.max_pending_bytes = max_pending_bytes
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def submit(self, chunk: StoredChunk, keys: torch.Tensor, values: torch.Tensor, counters: _Counters) -> bool:
        """Queue a save; False if it was dropped. keys/values must be the caller's own copies
        (not views of the pool): the writer reads them later, while the pool changes."""
        nbytes = keys.nbytes + values.nbytes
        with self._pending_lock:
            # One save always fits an empty queue, however large its chunk.
            if self._pending_bytes and self._pending_bytes + nbytes > self.max_pending_bytes:
                counters.add("disk_saves_dropped")
                logger.warning("chunk save of %d bytes dropped: %d bytes of saves already queued",
                               nbytes, self._pending_bytes)
                return False
            self._pending_bytes += nbytes
        try:
            (keys, values), ready = on_host(keys, values)
        except BaseException:
            with self._pending_lock:
                self._pending_bytes -= nbytes
            raise
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="picrag-chunk-writer", daemon=True)
            self._thread.start()
        self._queue.put(_Job(chunk, keys, values, ready, counters))
        return True

    def wait_idle(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                self._write(job)
            except Exception:  # the one writer thread must outlive any job
                logger.exception("chunk writer: unexpected error")
            finally:
                with self._pending_lock:
                    self._pending_bytes -= job.nbytes
                self._queue.task_done()

    def _write(self, job: _Job) -> None:
        try:
            if job.ready is not None:
                job.ready.synchronize()
            evicted = self._store.save(job.chunk, job.keys, job.values)
        except Exception as exc:  # a full disk raises SafetensorError or OSError; any failure only costs the file
            logger.warning("could not persist chunk of %d tokens: %s: %s", len(job.chunk), type(exc).__name__, exc)
            job.counters.add("disk_write_failures")
            return
        job.counters.add("disk_saves")
        if evicted:
            job.counters.add("disk_evictions", evicted)
