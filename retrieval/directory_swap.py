"""Replace a directory's contents as a whole, and lock it for a read-modify-write.

`replace_directory` fills a fresh directory beside the target, fsyncs it, and exchanges the two
in one `renameat2(RENAME_EXCHANGE)` call: at every moment the target path holds the complete old
contents or the complete new ones, whatever crashes when. The old contents, left at the fresh
directory's name, are then removed; a crash before that leaves them there, and the next
replacement removes them.

`directory_lock` is an exclusive `flock` on a lock file beside the directory (never replaced, so
every writer locks the same file), re-entrant within a thread. `replace_directory` takes it;
a caller that reads the directory, changes what it read and writes it back holds it throughout,
so that no other writer's change is lost.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_held = threading.local()  # lock file path -> depth, for the current thread


class DirectorySwapError(Exception):
    """The directory cannot be replaced: it holds foreign entries, or the filesystem cannot
    exchange two directories atomically."""


def _real(directory: str | Path) -> Path:
    # A symlinked directory is replaced where it really is, and the link is kept.
    return Path(os.path.realpath(directory))


def _sibling(directory: Path, kind: str) -> Path:
    return directory.parent / f".{directory.name}.{kind}"


@contextlib.contextmanager
def directory_lock(directory: str | Path) -> Iterator[None]:
    directory = _real(directory)
    lock_path = str(_sibling(directory, "lock"))
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


def replace_directory(directory: str | Path, fill: Callable[[Path], None], owned: Collection[str]) -> None:
    """Make `directory` hold exactly what `fill(path)` writes into an empty folder. Refuses a
    directory holding entries not named in `owned`: they would be deleted with the old contents."""
    directory = _real(directory)
    with directory_lock(directory):
        _remove_stale_swaps(directory)
        existing = sorted(os.listdir(directory)) if directory.is_dir() else None
        foreign = [name for name in existing or () if name not in owned]
        if foreign:
            raise DirectorySwapError(f"{directory} holds {', '.join(foreign)}, which the new contents would "
                                     "replace: move them away, or use an empty or new directory")
        fresh = _sibling(directory, f"swap-{secrets.token_hex(4)}")
        os.mkdir(fresh)
        try:
            if existing is not None:
                os.chmod(fresh, stat.S_IMODE(os.stat(directory).st_mode))
            fill(fresh)
            for name in os.listdir(fresh):
                _fsync(fresh / name)
            _fsync(fresh)
            if existing:
                _exchange(fresh, directory)
            else:
                os.rename(fresh, directory)  # onto nothing, or onto an empty directory: atomic
        except BaseException:
            shutil.rmtree(fresh, ignore_errors=True)
            raise
        _fsync(directory.parent)
        if existing:
            shutil.rmtree(fresh)  # the old contents


def _remove_stale_swaps(directory: Path) -> None:
    """Folders of replacements that crashed: their new contents never took the directory's
    place, or their old contents were not yet removed. The caller holds the lock."""
    for stale in directory.parent.glob(f".{directory.name}.swap-*"):
        logger.info("removing %s, left by an interrupted replacement of %s", stale, directory)
        shutil.rmtree(stale, ignore_errors=True)


def _exchange(a: Path, b: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None or renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE):
        code = ctypes.get_errno() if renameat2 is not None else errno.ENOSYS
        if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
            raise DirectorySwapError(
                f"the filesystem of {b} cannot exchange two directories atomically (renameat2 "
                f"RENAME_EXCHANGE: {os.strerror(code)}): write to a new directory instead")
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
