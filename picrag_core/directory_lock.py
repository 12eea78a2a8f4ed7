"""An exclusive lock on a directory across processes, for a read-modify-write or a first build.

An `flock` on a lock file beside the directory (never replaced, so every writer locks the same
file; a symlinked directory is locked where it really is), re-entrant within a thread. Closing
the file releases it, so a writer that dies never leaves it held.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

_held = threading.local()  # lock file path -> depth, for the current thread


def real_directory(directory: str | Path) -> Path:
    return Path(os.path.realpath(directory))


def sibling(directory: Path, kind: str) -> Path:
    """`.<name>.<kind>` beside `directory`."""
    return directory.parent / f".{directory.name}.{kind}"


@contextlib.contextmanager
def directory_lock(directory: str | Path) -> Iterator[None]:
    directory = real_directory(directory)
    lock_path = str(sibling(directory, "lock"))
    depths: dict[str, int] = _held.__dict__.setdefault("depths", {})
    if lock_path in depths:
        depths[lock_path] += 1
        try:
            yield
        finally:
            depths[lock_path] -= 1
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another writer of %s to finish", directory)
            fcntl.flock(fd, fcntl.LOCK_EX)
        depths[lock_path] = 1
        try:
            yield
        finally:
            del depths[lock_path]
    finally:
        os.close(fd)  # releases the lock
