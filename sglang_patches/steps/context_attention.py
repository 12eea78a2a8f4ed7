"""The attention a link's question pays to every prompt position, for links that ask.

Query-aware selection (the `select` families) recomputes the chunk tokens the question attends
to most. The frontend measures that first: it links the prompt as the family's base policy
(naive's or cacherepair's KV) with ``"context_attention": true``, and reads back, in meta_info
(picrag_core.engine_report), the attention weight the question's tokens give to each prompt
position, summed over layers, heads and question tokens, one per position in the original
prompt order. Both attention backends add each layer's weights as they attend
(`accumulate`), computed apart from the attention kernel from the same queries, keys and mask.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from picrag_core.engine_report import encode_floats
from sglang_patches.plan.link_state import AttentionReport


def accumulate(report: AttentionReport, query: torch.Tensor, key: torch.Tensor, scale: float,
               mask: Optional[torch.Tensor], query_rows: torch.Tensor) -> None:
    """Add one layer's attention weights of the question's queries. `query` [heads, q_len, dim]
    and `key` [kv_len, kv heads, dim] are one request's; `mask` [q_len, kv_len] (True: attend),
    or None for queries that see every row entry up to their own; `query_rows` [q_len]: each
    query's row entry."""
    chosen = (query_rows >= report.question_start).nonzero().squeeze(1)
    if not len(chosen):
        return
    heads, kv_heads = query.shape[0], key.shape[1]
    keys = key.movedim(0, 1).float().repeat_interleave(heads // kv_heads, dim=0)  # [heads, kv_len, dim]
    logits = query[:, chosen].float() @ keys.transpose(1, 2) * scale  # [heads, chosen, kv_len]
    visible = (mask[chosen] if mask is not None else
               torch.arange(key.shape[0], device=key.device)[None, :] <= query_rows[chosen][:, None])
    weights = logits.masked_fill(~visible, float("-inf")).softmax(-1).sum(dim=(0, 1)).double().cpu()
    if report.sums is None or len(report.sums) < len(weights):
        grown = torch.zeros(len(weights), dtype=torch.float64)
        if report.sums is not None:
            grown[: len(report.sums)] = report.sums
        report.sums = grown
    report.sums[: len(weights)] += weights


def encode(report: AttentionReport, prompt_len: int, order: Optional[list[int]]) -> str:
    """The sums per prompt position in the original order (`order`: sent index -> position)."""
    sums = np.zeros(prompt_len, dtype="<f4")
    if report.sums is not None:
        values = report.sums[:prompt_len].numpy()
        positions = np.asarray(order[: len(values)] if order is not None else range(len(values)))
        sums[positions] = values
    return encode_floats(sums)
