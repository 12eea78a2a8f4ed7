"""The chunk cache's host tier: compiled chunk KV persisted on disk, reloaded on demand.

One safetensors file per chunk under ``<root>/<model fingerprint>/<chunk key>.safetensors``
with the chunk's K and V for every layer (K at local positions 0..n-1, as in the pool). Its
metadata repeats the fingerprint and the chunk key and carries a SHA-256 of the tensor bytes,
so a truncated, corrupted or foreign file is detected, reported and ignored (the chunk is
recomputed and the file rewritten), never used. Writes go to a temporary file and are renamed.

The fingerprint covers everything that changes a chunk's KV: the model config (architecture,
sizes, rope), the weights (sizes and the SHA-256 of the first and last MiB of each weight
file), the tokenizer files and the KV dtype.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from array import array
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

STORE_DIR_ENV = "PICRAG_CHUNK_STORE_DIR"
_EDGE_BYTES = 1 << 20


def chunk_key(token_ids) -> str:
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()


def model_fingerprint(model_path: Path, kv_dtype: torch.dtype) -> str:
    digest = hashlib.sha256(str(kv_dtype).encode())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        path = model_path / name
        if path.is_file():
            digest.update(name.encode() + path.read_bytes())
    for path in sorted(model_path.glob("*.safetensors")) + sorted(model_path.glob("*.bin")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(_EDGE_BYTES))
            f.seek(max(0, size - _EDGE_BYTES))
            digest.update(f.read(_EDGE_BYTES))
    return digest.hexdigest()[:32]


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
