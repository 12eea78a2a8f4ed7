"""Attention masks of requests whose KV rows are not in position order, shared by picrag's backends.

Two annotations on a ForwardBatch (sglang_patches.steps.forward_annotations) change which row entries a query may see:
* true positions (sglang_patches.steps.positions): a reordered LegoLink prompt, whose row holds the
  link tokens after every cached chunk although they sit inside the prompt;
* query positions (sglang_patches.steps.cacheblend): CacheBlend's kept rows, scattered through the row.
Both backends (`picrag_native` on CPU, `picrag_flashinfer` on CUDA) build the mask here, so the
two can only differ in the attention kernel.
"""

from __future__ import annotations

from typing import Optional

import torch


def true_position_mask(row_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """Each query sees the row entries whose true position is not after its own."""
    return row_positions.unsqueeze(0) <= query_positions.unsqueeze(1)


def position_mask(
    q_len: int,
    kv_len: int,
    true_positions: Optional[torch.Tensor],
    query_positions: Optional[torch.Tensor],
    device: torch.device,
) -> Optional[torch.Tensor]:
    """[q_len, kv_len] bool mask (True: attend) of an annotated request; None when the request's
    queries are simply the last q_len row entries in position order (plain causal)."""
    if query_positions is not None:
        row = torch.arange(kv_len, device=device) if true_positions is None else true_positions[:kv_len]
        return true_position_mask(row, query_positions)
    if true_positions is not None:
        row = true_positions[:kv_len]
        return true_position_mask(row, row[-q_len:])
    return None
