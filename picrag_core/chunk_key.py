"""The content key of a chunk: one hash of its token ids, used wherever a chunk is named (the
frontend's record of compiled pieces, the disk tier's file names)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chunk_key(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()
