"""The token order of a prompt whose chunks have tokens recomputed in context.

SGLang's extend computes a contiguous suffix of a request's row after a cached prefix. Link
policies that recompute tokens *inside* the prompt (LegoLink, EPIC: the first k tokens of every
chunk; query-aware selection: the chunk tokens the question attends to most) send the prompt
reordered: ``[head][kept tokens of chunk 1]...[kept tokens of chunk n][recomputed tokens, in
prompt order][question]``. The head and the kept tokens are cached (each run of kept tokens
grafted from its stored chunk, re-positioned to its true offset), the recomputed tokens and
the question are the extend, and every token keeps its true position: the forward runs them at
those positions (sglang_patches.steps.positions) and attention masks by true position
(sglang_patches.attention.native), so the result is exactly the policy on the original prompt. The
question stays last, so decoding needs nothing special.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Span = tuple[int, int]


@dataclass(frozen=True)
class Fragment:
    """A run of a chunk's kept (grafted) tokens in the reordered prompt."""

    start: int  # reordered index of its first token
    end: int
    chunk_offset: int  # where in its chunk it begins


@dataclass(frozen=True)
class ReorderedLayout:
    order: list[int]  # reordered index -> true position in the original prompt
    head_len: int
    fragments: list[list[Fragment]]  # per chunk, its kept runs (none: the chunk is recomputed whole)

    def reorder(self, token_ids: Sequence[int]) -> list[int]:
        return [token_ids[position] for position in self.order]

    def restore(self, reordered: Sequence[int]) -> list[int]:
        original = [0] * len(reordered)
        for index, position in enumerate(self.order):
            original[position] = reordered[index]
        return original


def first_k_runs(chunks: Sequence[Span], k: int) -> list[Span]:
    """LegoLink's recomputed tokens: the first k of every chunk."""
    return [(start, min(start + k, end)) for start, end in chunks if k > 0]


def merge_runs(runs: Sequence[Span]) -> list[Span]:
    """Sorted, disjoint, non-empty runs covering the same positions."""
    merged: list[list[int]] = []
    for start, end in sorted(run for run in runs if run[0] < run[1]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def reordered_layout(prompt_len: int, chunks: Sequence[Span], recomputed: Sequence[Span]) -> ReorderedLayout:
    """Chunks back to back (LinkRequest.validate checks it for reordered families); `recomputed`
    merged runs (merge_runs), each inside a chunk."""
    head_len = chunks[0][0] if chunks else prompt_len
    recomputed_positions = {p for start, end in recomputed for p in range(start, end)}
    order = list(range(head_len))
    fragments: list[list[Fragment]] = []
    for start, end in chunks:
        kept: list[Fragment] = []
        position = start
        while position < end:
            if position in recomputed_positions:
                position += 1
                continue
            run_start = len(order)
            offset = position - start
            while position < end and position not in recomputed_positions:
                order.append(position)
                position += 1
            kept.append(Fragment(run_start, len(order), offset))
        fragments.append(kept)
    order.extend(sorted(recomputed_positions))
    order.extend(range(chunks[-1][1] if chunks else prompt_len, prompt_len))
    return ReorderedLayout(order=order, head_len=head_len, fragments=fragments)
