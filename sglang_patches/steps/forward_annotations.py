"""What picrag attaches to a ForwardBatch: one object under one attribute.

Built from the batch's link plans when SGLang makes the batch (sglang_patches.steps.batch_annotations)
and carried across the eager runner's copy of it; read by the attention backends
(sglang_patches.attention.masks), CacheBlend's layer hook (sglang_patches.steps.cacheblend) and the
logits processor's (sglang_patches.steps.span_report).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

ATTR = "picrag_forward"


@dataclass
class ForwardAnnotations:
    # Batch index -> the true position of every row entry of a prompt sent reordered
    # (sglang_patches.steps.positions).
    true_positions: dict[int, torch.Tensor] = field(default_factory=dict)
    # Batch index -> the positions of a request's queries once CacheBlend kept only some rows.
    query_positions: dict[int, torch.Tensor] = field(default_factory=dict)
    blend: Any = None  # sglang_patches.steps.cacheblend.BlendState of the batch's cacheblend requests
    # Batch index -> the sums of the question's attention, for links that asked for them
    # (sglang_patches.steps.context_attention.AttentionReport).
    attention: dict[int, Any] = field(default_factory=dict)
    # Batch index -> the positions whose next-token distributions a link asked for
    # (sglang_patches.plan.link_plan.SpanReport, filled by sglang_patches.steps.span_report).
    spans: dict[int, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.true_positions or self.query_positions or self.blend is not None or self.attention
                    or self.spans)


def annotations_of(forward_batch) -> Optional[ForwardAnnotations]:
    return getattr(forward_batch, ATTR, None)
