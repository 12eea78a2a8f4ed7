"""Query-aware selection: which chunk tokens a selecting link recomputes.

A `select:R[,K]` link (and `cacherepair+select`) recomputes, besides the first K tokens of
every chunk, the fraction R of all chunk tokens that the question attends to most over the
base policy's linked KV (naive's, or cacherepair's repaired KV). The pipeline measures that
attention with one prefill-only link of the base policy that asks for it
(sglang_patches.steps.context_attention: summed over layers, heads and question tokens), then sends
the link with the chosen positions (`LinkRequest.recompute`), so the engine recomputes them at
their true positions in the same extend as the question. R = 1 recomputes every chunk token
(full prefill); R = 0 is the base policy with LegoLink's first K.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from picrag_core.reordered_layout import first_k_runs, merge_runs

Span = tuple[int, int]


def selected_runs(scores: np.ndarray, chunks: Sequence[Span], k: int, ratio: float) -> tuple[Span, ...]:
    """The runs recomputed besides the first k of every chunk: the ceil(ratio * chunk tokens)
    chunk positions outside those with the highest scores (ties: the earlier position)."""
    always = {p for start, end in first_k_runs(chunks, k) for p in range(start, end)}
    candidates = np.array([p for start, end in chunks for p in range(start, end) if p not in always], dtype=np.int64)
    wanted = min(len(candidates), math.ceil(ratio * sum(end - start for start, end in chunks)))
    if wanted == 0:
        return ()
    # Stable sort of the negated scores: equal scores keep position order.
    top = {int(p) for p in candidates[np.argsort(-scores[candidates].astype(np.float64), kind="stable")[:wanted]]}
    # Merged within each chunk: a run never crosses a chunk boundary (chunks are back to back).
    return tuple(run for start, end in chunks
                 for run in merge_runs([(p, p + 1) for p in range(start, end) if p in top]))
