"""The serving half of CacheRepair: a learned residual added to grafted chunk KV.

A ``cacherepair`` request is grafted like ``naive`` (each chunk's stored keys rotated to the
chunk's offset, values copied into fresh slots). Then the request's chunks go through the
repair network in one pass: every chunk's stored K is rotated back to RoPE-free coordinates
(stored at local positions 0..n-1), the network predicts a RoPE-free residual for every token,
layer, K and V, and the grafted slots receive ``K + R(p) residual_K`` and ``V + residual_V``
where p is the token's position in the prompt. ``R(p)(K_free + res) = shift(K_stored) +
R(p) res``, so a zero residual leaves exactly naive's KV. Chunks already on the prompt's path
(an earlier request with the same head and chunks repaired them) are context for the network
but are not written again.

The network's per-token part reads only the token's own chunk (picrag_core.repair.network's
ChunkInputs): it is computed for each stored chunk alone from its stored KV and kept with the
chunk in the tree (sglang_patches.tree.chunk_cache), so a chunk linked again skips reading its
KV over every layer, the rotation and the compression; the request pays for the blocks that
mix its chunks and for the head.

``cacherepair+legolink`` repairs the same way, with the prompt in LegoLink's order: only the
chunks' rests are grafted and written, while the network still sees every chunk whole (a chunk
that k covers entirely is context only), so the rests get exactly cacherepair's KV and the first
k tokens of every chunk are then recomputed in the forward.

The checkpoint comes from ``PICRAG_REPAIR_CHECKPOINT`` (`picrag serve --repair-checkpoint`);
it is refused at start-up if it was trained for another model.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from picrag_core.repair.network import ChunkInputs, chunk_ids_for

logger = logging.getLogger(__name__)

REPAIR_CHECKPOINT_ENV = "PICRAG_REPAIR_CHECKPOINT"


def load_engine_repairer(model_path: Path):
    """The KVRepairer named by PICRAG_REPAIR_CHECKPOINT, or None when none is configured."""
    directory = os.environ.get(REPAIR_CHECKPOINT_ENV)
    if not directory:
        return None
    from picrag_core.repair.checkpoint import load_repairer
    from picrag_core.repair.config import read_token_embedding
    from picrag_core.model_fingerprint import model_fingerprint

    # Repairers are trained on fp32 KV; the fingerprint names the weights, not the serving dtype.
    repairer = load_repairer(
        Path(directory), read_token_embedding(model_path), model_fingerprint(model_path, torch.float32)
    )
    logger.info("CacheRepair checkpoint %s loaded (%d parameters)", directory,
                repairer.network.trainable_parameters())
    return repairer


@dataclass
class RepairPart:
    """A grafted run of a chunk: its tokens [first, first + count)."""

    first: int
    count: int
    new_slots: Optional[torch.Tensor] = None  # where the run lives


@dataclass
class RepairSpan:
    """One chunk of the request as the repair network sees it."""

    stored_slots: torch.Tensor  # the stored chunk's slots (positions 0..n-1)
    token_ids: list[int]
    position: int  # prompt position of the chunk's first token
    # Its grafted runs, written with the repaired KV (none: context only, e.g. already on the
    # prompt's path; several where a reordered layout recomputes tokens between them).
    parts: list[RepairPart] = field(default_factory=list)
    inputs: Optional[ChunkInputs] = None  # the network's inputs for the chunk, if kept from an earlier link


def chunk_inputs(repairer, kv_pool, shifter, span: RepairSpan) -> ChunkInputs:
    """The network's inputs for one stored chunk: its keys over every layer rotated back to
    RoPE-free coordinates (stored at local positions 0..n-1), its values, its tokens."""
    layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)
    first_keys = kv_pool.get_key_buffer(kv_pool.start_layer)
    slots = span.stored_slots.to(first_keys.device, torch.int64)
    # Whole-tensor ops over [n, L, H, D]: one rotation for all layers, not one per layer.
    cos, sin = shifter.rotation(-torch.arange(len(slots)), first_keys)
    stale_k = shifter.rotate(torch.stack([kv_pool.get_key_buffer(layer).index_select(0, slots) for layer in layers],
                                         dim=1), (cos.unsqueeze(1), sin.unsqueeze(1)))
    stale_v = torch.stack([kv_pool.get_value_buffer(layer).index_select(0, slots) for layer in layers], dim=1)
    return repairer.chunk_inputs(stale_k, stale_v, torch.tensor(span.token_ids, dtype=torch.int64))


@torch.no_grad()
def repair_spans(repairer, kv_pool, shifter, spans: list[RepairSpan]) -> int:
    """Add the network's residual to the grafted parts of `spans`; returns tokens repaired.
    A span without inputs gets them computed (and set, for the caller to keep)."""
    if not any(span.parts for span in spans):
        return 0
    layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)
    first_keys = kv_pool.get_key_buffer(kv_pool.start_layer)
    for span in spans:
        if span.inputs is None:
            span.inputs = chunk_inputs(repairer, kv_pool, shifter, span)
    chunk_ids = chunk_ids_for([len(span.stored_slots) for span in spans])
    res_k, res_v = repairer.residual_from([span.inputs for span in spans], chunk_ids)

    rows, dst, positions = [], [], []
    start = 0
    for span in spans:
        for part in span.parts:
            rows.append(torch.arange(start + part.first, start + part.first + part.count))
            dst.append(part.new_slots.to(torch.int64))
            positions.append(torch.arange(span.position + part.first, span.position + part.first + part.count))
        start += len(span.stored_slots)
    rows_t = torch.cat(rows).to(res_k.device)
    dst_t = torch.cat(dst).to(first_keys.device)
    if len(rows_t) < len(res_k):  # some tokens are context only (otherwise rows_t is every row, in order)
        res_k, res_v = res_k.index_select(0, rows_t), res_v.index_select(0, rows_t)
    res_k = res_k.float()  # rotated in float32, like the stored keys
    cos, sin = shifter.rotation(torch.cat(positions), res_k)
    rotated = shifter.rotate(res_k, (cos.unsqueeze(1), sin.unsqueeze(1))).to(first_keys.device)
    values = res_v.to(first_keys.device)
    for index, layer in enumerate(layers):
        for buffer, residual in ((kv_pool.get_key_buffer(layer), rotated[:, index]),
                                 (kv_pool.get_value_buffer(layer), values[:, index])):
            repaired = buffer.index_select(0, dst_t).float() + residual.float()
            buffer.index_copy_(0, dst_t, repaired.to(buffer.dtype))
    return len(rows_t)
