"""Run a reordered (LegoLink) prompt's extend tokens at their true positions.

SGLang numbers extend tokens prefix_len, prefix_len + 1, ... For a prompt sent in LegoLink's
order (picrag_core.reordered_layout) the tokens carry their true positions instead; the
attention backend gets the true position of every row entry so that a query attends exactly
to the tokens before it in the original prompt. `true_positions_of` rewrites the batch's
positions for such requests only, when the batch is made (sglang_patches.steps.batch_annotations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from sglang_patches.plan.link_plan import LinkPlan


def true_positions(order: Sequence[int], length: int) -> list[int]:
    # Output tokens (after a retraction, say) follow the prompt in both orders.
    return list(order[:length]) + list(range(len(order), length))


def true_positions_of(forward_batch, plans: list[Optional[LinkPlan]]) -> dict[int, torch.Tensor]:
    """Rewrite the positions of the batch's reordered prompts; returns, per batch index, the true
    position of every row entry of each."""
    by_request: dict[int, torch.Tensor] = {}
    starts = forward_batch.extend_start_loc.tolist()
    for index, plan in enumerate(plans):
        if plan is None or plan.order is None:
            continue
        prefix = forward_batch.extend_prefix_lens_cpu[index]
        length = prefix + forward_batch.extend_seq_lens_cpu[index]
        row = torch.tensor(true_positions(plan.order, length), dtype=torch.int64, device=forward_batch.positions.device)
        forward_batch.positions[starts[index] : starts[index] + length - prefix] = row[prefix:].to(
            forward_batch.positions.dtype
        )
        by_request[index] = row
    return by_request
