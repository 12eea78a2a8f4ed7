"""The chunk cache's host tier: compiled chunk KV persisted on disk, reloaded on demand.

One safetensors file per chunk under ``<root>/<model fingerprint>/<chunk key>.safetensors``
with the chunk's K and V for every layer (K at local positions 0..n-1, as in the pool). Its
metadata repeats the fingerprint and the chunk key and carries a SHA-256 of the tensor bytes,
so a truncated, corrupted or foreign file is detected, reported and ignored (the chunk is
recomputed and the file rewritten), never used. Writes go to a temporary file and are renamed.

The fingerprint (sglang_patches.model_fingerprint) names everything that changes a chunk's KV.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sglang_patches.chunk_key import chunk_key

logger = logging.getLogger(__name__)

STORE_DIR_ENV = "PICRAG_CHUNK_STORE_DIR"


def _tensor_digest(keys: torch.Tensor, values: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in (keys, values):
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class DiskChunkStore:
    def __init__(self, root: Path, fingerprint: str):
        self.fingerprint = fingerprint
        self.directory = Path(root) / fingerprint
        self.directory.mkdir(parents=True, exist_ok=True)

    def path_of(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def save(self, token_ids, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [layers, tokens, kv_heads, head_dim] for the chunk `token_ids`."""
        key = chunk_key(token_ids)
        keys, values = keys.detach().cpu().contiguous(), values.detach().cpu().contiguous()
        metadata = {
            "fingerprint": self.fingerprint,
            "chunk_key": key,
            "tokens": str(len(token_ids)),
            "sha256": _tensor_digest(keys, values),
        }
        target = self.path_of(key)
        tmp = target.with_suffix(f".tmp-{os.getpid()}")
        save_file({"k": keys, "v": values}, str(tmp), metadata=metadata)
        os.replace(tmp, target)

    def load(self, token_ids) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The chunk's (keys, values), or None if absent; a bad file is reported and ignored."""
        key = chunk_key(token_ids)
        path = self.path_of(key)
        if not path.is_file():
            return None
        try:
            tensors = load_file(str(path))
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                metadata = json.loads(f.read(header_len)).get("__metadata__", {})
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptChunkFile(f"{path}: unreadable ({exc})") from exc
        keys, values = tensors.get("k"), tensors.get("v")
        if metadata.get("fingerprint") != self.fingerprint or metadata.get("chunk_key") != key:
            raise CorruptChunkFile(f"{path}: written for another model or chunk")
        if keys is None or values is None or keys.shape[1] != len(token_ids) or keys.shape != values.shape:
            raise CorruptChunkFile(f"{path}: tensors do not match the chunk")
        if metadata.get("sha256") != _tensor_digest(keys, values):
            raise CorruptChunkFile(f"{path}: checksum mismatch")
        return keys, values


class CorruptChunkFile(ValueError):
    pass
