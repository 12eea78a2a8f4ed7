"""The fingerprint of a served model: what the chunk store and repair checkpoints are keyed by.

A chunk's KV is a function of its token ids, the weights, the configuration that shapes the
forward pass and the dtype the KV is kept in, so the fingerprint hashes exactly those:

- every weight tensor (name, dtype, shape, bytes) in sorted name order, wherever it is stored:
  sharding, file order, tensor order inside a file and file metadata do not count;
- the config.json fields that change the forward pass (`KV_CONFIG_FIELDS`), with the spellings
  that differ between transformers versions reduced to one;
- the KV dtype.

What cannot change a KV is left out: config.json's formatting and bookkeeping fields, the
tokenizer files (the KV is keyed by token ids) and generation settings. Two conversions of one
preset that produce the same tensors therefore get one fingerprint on any install.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# Fields absent from a config are hashed as null, so adding one here changes every fingerprint.
KV_CONFIG_FIELDS = (
    "architectures", "model_type", "dtype",
    "num_hidden_layers", "hidden_size", "intermediate_size", "hidden_act",
    "num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias", "mlp_bias",
    "rms_norm_eps", "layer_norm_eps", "vocab_size", "tie_word_embeddings",
    "rope_theta", "rope_scaling", "partial_rotary_factor", "max_position_embeddings",
    "sliding_window", "max_window_layers", "layer_types",
)

_BLOCK = 16 << 20  # tensor bytes are hashed through one buffer of this size


def model_fingerprint(model_path: Path, kv_dtype: torch.dtype) -> str:
    model_path = Path(model_path)
    digest = hashlib.sha256(f"kv_dtype={kv_dtype}\n".encode())
    config = _read_config(model_path)
    digest.update(json.dumps(_kv_config(config), sort_keys=True).encode() + b"\n")
    # A tied output head is the embedding by definition: loaders skip it, converters may or may not write it.
    skip = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    _hash_weights(model_path, skip, digest)
    return digest.hexdigest()[:32]


def _read_config(model_path: Path) -> dict[str, Any]:
    path = model_path / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _kv_config(config: dict[str, Any]) -> dict[str, Any]:
    """The KV-relevant fields of a config.json, one spelling per fact."""
    config = dict(config)
    config.setdefault("dtype", config.get("torch_dtype"))
    # transformers >= 5 nests rope_theta and the scaling in rope_parameters; older versions write
    # top-level rope_theta and rope_scaling (with "type" for "rope_type").
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    theta = rope.pop("rope_theta", None)
    config.setdefault("rope_theta", theta)
    config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" and len(rope) <= 1 else rope
    if config.get("use_sliding_window") is False:  # the window fields are then inert
        config["sliding_window"] = config["max_window_layers"] = None
    if set(config.get("layer_types") or ()) <= {"full_attention"}:
        config["layer_types"] = None
    return {name: config.get(name) for name in KV_CONFIG_FIELDS}


def _hash_weights(model_path: Path, skip: set[str], digest: Any) -> None:
    files = sorted(model_path.glob("*.safetensors"))
    if files:
        tensors = {name: (path, entry) for path in files for name, entry in _safetensors_header(path)}
        buffer = bytearray(_BLOCK)
        for name in sorted(tensors.keys() - skip):
            path, (dtype, shape, start, end) = tensors[name]
            digest.update(json.dumps([name, dtype, shape]).encode() + b"\n")
            _hash_range(path, start, end, buffer, digest)
        return
    # PyTorch pickles: memory-mapped, so one tensor at a time is read.
    state: dict[str, torch.Tensor] = {}
    for path in sorted(model_path.glob("*.bin")):
        state.update(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    for name in sorted(state.keys() - skip):
        tensor = state[name]
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode() + b"\n")
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _safetensors_header(path: Path) -> Iterator[tuple[str, tuple[str, list[int], int, int]]]:
    """(name, (dtype, shape, first byte, end byte)) per tensor, from the format's JSON header:
    an 8-byte little-endian length, the header, then the data its offsets point into."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    base = 8 + length
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        yield name, (entry["dtype"], entry["shape"], base + start, base + end)


def _hash_range(path: Path, start: int, end: int, buffer: bytearray, digest: Any) -> None:
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        f.seek(start)
        left = end - start
        while left:
            read = f.readinto(view[: min(left, len(buffer))])
            if not read:
                raise ValueError(f"{path} ends inside a tensor (truncated weights file)")
            digest.update(view[:read])
            left -= read
