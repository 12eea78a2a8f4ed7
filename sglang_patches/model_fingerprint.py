"""The fingerprint of a served model: what the chunk store and repair checkpoints are keyed by.

It covers everything that changes a chunk's KV: the model config (architecture, sizes, rope),
the weights (sizes and the SHA-256 of the first and last MiB of each weight file), the
tokenizer files and the KV dtype.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

_EDGE_BYTES = 1 << 20


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
