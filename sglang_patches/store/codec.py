"""What every chunk-store tier checks before a stored chunk reaches the KV pool, and the framed
value the HiCache tier stores.

A stored chunk is its K and V for every layer of one process ([layers, tokens, ...row], K at
local positions 0..n-1) plus who wrote it: the model fingerprint, the partition (rank and KV
options, sglang_patches.store.disk.partition_name) and the chunk key. A load is refused
(CorruptChunkFile) when any of those differs, when the tensors do not fit the pool (layers,
row shapes, dtypes) or when the SHA-256 of the tensor bytes does not match: a bad value is a
miss, never KV.

The HiCache frame (`encode_frame` / `decode_frame`) is one byte string per chunk: a fixed-size
JSON header, then K's bytes, then V's. Its length follows from the pool's layout and the
chunk's token count alone (`frame_bytes`), so a reader can fetch it into a buffer of exactly
that size, as SGLang's zero-copy storage backends want.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from math import prod

import torch

HEADER_BYTES = 1024  # the frame's JSON header, space-padded: room for the identity, shapes and digest


class CorruptChunkFile(ValueError):
    """A stored chunk that must not be used (corrupt, foreign, of another shape)."""


@dataclass(frozen=True)
class KVLayout:
    """The shape and dtype of one token's K and V in the pool, and the number of layers."""

    layers: int
    key_row: tuple[int, ...]
    key_dtype: torch.dtype
    value_row: tuple[int, ...]
    value_dtype: torch.dtype

    @classmethod
    def of_pool(cls, pool) -> KVLayout:
        """The layout of an SGLang KV pool (MHATokenToKVPool and kin)."""
        k_buffer, v_buffer = pool.get_key_buffer(pool.start_layer), pool.get_value_buffer(pool.start_layer)
        return cls(pool.layer_num, tuple(k_buffer.shape[1:]), k_buffer.dtype, tuple(v_buffer.shape[1:]), v_buffer.dtype)

    def key_shape(self, tokens: int) -> tuple[int, ...]:
        return (self.layers, tokens, *self.key_row)

    def value_shape(self, tokens: int) -> tuple[int, ...]:
        return (self.layers, tokens, *self.value_row)

    def tensor_bytes(self, tokens: int) -> int:
        return (prod(self.key_shape(tokens)) * self.key_dtype.itemsize
                + prod(self.value_shape(tokens)) * self.value_dtype.itemsize)


@dataclass(frozen=True)
class ChunkIdentity:
    """Who a stored chunk belongs to: what keys it in every tier."""

    fingerprint: str
    partition: str
    chunk_key: str


def tensor_digest(keys: torch.Tensor, values: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in (keys, values):
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_layout(where: object, keys: torch.Tensor, values: torch.Tensor, layout: KVLayout, tokens: int) -> None:
    for name, tensor, expected, dtype in (("keys", keys, layout.key_shape(tokens), layout.key_dtype),
                                          ("values", values, layout.value_shape(tokens), layout.value_dtype)):
        if tuple(tensor.shape) != expected or tensor.dtype != dtype:
            raise CorruptChunkFile(
                f"{where}: {name} are {tuple(tensor.shape)} {tensor.dtype}, the pool holds {expected} {dtype}"
            )


def frame_bytes(layout: KVLayout, tokens: int) -> int:
    return HEADER_BYTES + layout.tensor_bytes(tokens)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_frame(identity: ChunkIdentity, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> int:
    """Write the frame of (keys, values) into the uint8 host tensor `out` (at least as long as
    the frame); returns the frame's length."""
    keys, values = keys.detach().cpu().contiguous(), values.detach().cpu().contiguous()
    header = json.dumps({
        "fingerprint": identity.fingerprint, "partition": identity.partition, "chunk_key": identity.chunk_key,
        "k_shape": list(keys.shape), "k_dtype": _dtype_name(keys.dtype),
        "v_shape": list(values.shape), "v_dtype": _dtype_name(values.dtype),
        "sha256": tensor_digest(keys, values),
    }).encode()
    if len(header) > HEADER_BYTES:
        raise ValueError(f"chunk header of {len(header)} bytes exceeds {HEADER_BYTES}")
    k_bytes, v_bytes = keys.view(torch.uint8).reshape(-1), values.view(torch.uint8).reshape(-1)
    end = HEADER_BYTES + len(k_bytes) + len(v_bytes)
    out[:HEADER_BYTES] = torch.frombuffer(bytearray(header.ljust(HEADER_BYTES)), dtype=torch.uint8)
    out[HEADER_BYTES:HEADER_BYTES + len(k_bytes)] = k_bytes
    out[HEADER_BYTES + len(k_bytes):end] = v_bytes
    return end


def decode_frame(frame: torch.Tensor, identity: ChunkIdentity, tokens: int,
                 layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) from a frame of exactly `frame_bytes(layout, tokens)` bytes, as copies;
    CorruptChunkFile if anything about it is not this chunk's."""
    where = f"stored chunk {identity.chunk_key}"
    try:
        header = json.loads(bytes(frame[:HEADER_BYTES].numpy()).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptChunkFile(f"{where}: unreadable header ({exc})") from exc
    if not isinstance(header, dict) or (header.get("fingerprint"), header.get("partition"),
                                        header.get("chunk_key")) != (identity.fingerprint, identity.partition,
                                                                     identity.chunk_key):
        raise CorruptChunkFile(f"{where}: written for another model, process or chunk")
    if (header.get("k_shape"), header.get("k_dtype"), header.get("v_shape"), header.get("v_dtype")) != (
            list(layout.key_shape(tokens)), _dtype_name(layout.key_dtype),
            list(layout.value_shape(tokens)), _dtype_name(layout.value_dtype)):
        raise CorruptChunkFile(f"{where}: tensors are {header.get('k_shape')} {header.get('k_dtype')}, "
                               f"the pool holds {list(layout.key_shape(tokens))} {_dtype_name(layout.key_dtype)}")
    k_end = HEADER_BYTES + prod(layout.key_shape(tokens)) * layout.key_dtype.itemsize
    if frame.numel() != frame_bytes(layout, tokens):
        raise CorruptChunkFile(f"{where}: {frame.numel()} bytes, not {frame_bytes(layout, tokens)}")
    keys = frame[HEADER_BYTES:k_end].clone().view(layout.key_dtype).reshape(layout.key_shape(tokens))
    values = frame[k_end:].clone().view(layout.value_dtype).reshape(layout.value_shape(tokens))
    if header.get("sha256") != tensor_digest(keys, values):
        raise CorruptChunkFile(f"{where}: checksum mismatch")
    return keys, values
