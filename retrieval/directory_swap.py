"""Replace a directory's contents as a whole, and lock it for a read-modify-write.

`replace_directory` fills a fresh directory beside the target, fsyncs it, and exchanges the two
in one `renameat2(RENAME_EXCHANGE)` call: at every moment the target path holds the complete old
contents or the complete new ones, whatever crashes when. The old contents, left at the fresh
directory's name, are then removed; a crash before that leaves them there, and the next
replacement removes them.

`replace_directory` takes `directory_lock` (picrag_core.directory_lock); a caller that reads the
directory, changes what it read and writes it back holds it throughout, so that no other
writer's change is lost.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Collection
from pathlib import Path

from picrag_core.directory_lock import directory_lock, real_directory, sibling

logger = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class DirectorySwapError(Exception):
    """The directory cannot be replaced: it holds foreign entries, or the filesystem cannot
    exchange two directories atomically."""


def replace_directory(directory: str | Path, fill: Callable[[Path], None], owned: Collection[str]) -> None:
    """Make `directory` hold exactly what `fill(path)` writes into an empty folder. Refuses a
    directory holding entries not named in `owned`: they would be deleted with the old contents."""
    directory = real_directory(directory)  # a symlinked directory is replaced where it is; the link stays
    with directory_lock(directory):
        _remove_stale_swaps(directory)
        existing = sorted(os.listdir(directory)) if directory.is_dir() else None
        foreign = [name for name in existing or () if name not in owned]
        if foreign:
            raise DirectorySwapError(f"{directory} holds {', '.join(foreign)}, which the new contents would "
                                     "replace: move them away, or use an empty or new directory")
        fresh = sibling(directory, f"swap-{secrets.token_hex(4)}")
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
