"""One typed plan per linked request, built once when the engine admits it, and never changed.

Everything the engine does with a linked request reads its plan: the tree namespace and key
(sglang_patches.plan.keys), the chunks grafted and repaired (sglang_patches.tree.chunk_cache), the
stored chunks leased on arrival, the true positions of a prompt sent reordered
(sglang_patches.steps.positions), CacheBlend's sources (sglang_patches.steps.cacheblend), the reports
it asked for and the accounting in meta_info. Each stored chunk is hashed here, once
(picrag_core.chunk_key.StoredChunk), and the reordered layout is built here, once; every later
step reads them from the plan. What changes while the request runs is its state
(sglang_patches.plan.link_state). The plan hangs on SGLang's request object under one attribute
(`PLAN_ATTR`); `plan_of` reads it. Building it is pure: the same request always gets the same
plan, whatever the cache holds.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Optional

from picrag_core.chunk_key import StoredChunk
from picrag_core.link_hints import REORDERED_LAYOUT, LinkRequest
from picrag_core.policies import PolicyFamily
from picrag_core.reordered_layout import ReorderedLayout, reordered_layout
from sglang_patches.plan.keys import namespace_of, prompt_key, store_key
from sglang_patches.plan.link_state import AttentionReport, LinkState, LinkStats, SpanReport
from sglang_patches.plan.segments import HEAD, ChunkSpan, Segment

PLAN_ATTR = "picrag_plan"


@dataclass(frozen=True)
class LinkPlan:
    link: LinkRequest
    prompt: tuple[int, ...]  # as sent
    segments: tuple[Segment, ...]  # head and chunks that can be grafted, in the order sent
    # The stored chunks the request reads, for its lease: grafted ones, or a blend's.
    stored_chunks: tuple[StoredChunk, ...]
    namespace: Optional[str]  # the tree namespace of a chunk-reusing family's prompts
    tree_key: Optional[array]  # the prompt's tree key; None: its plain tokens
    order: Optional[tuple[int, ...]]  # a reordered prompt: sent index -> true position
    repairs: bool  # grafted chunk KV goes through the repair network
    compiled: Optional[StoredChunk] = None  # a compile: the whole prompt, as it is stored
    # Families that blend: every chunk's span of the prompt and its stored chunk, in order.
    blend_sources: tuple[ChunkSpan, ...] = ()

    @property
    def family(self) -> PolicyFamily:
        return self.link.family


def plan_of(req) -> Optional[LinkPlan]:
    """The plan of an admitted linked request; None for a vanilla one (or one not yet admitted)."""
    return getattr(req, PLAN_ATTR, None)


def _segments(prompt: list[int], original: list[int], link: LinkRequest, stored: list[StoredChunk],
              layout: Optional[ReorderedLayout]) -> list[Segment]:
    """`original`: the prompt in its original order; `stored`: every chunk of the link as stored,
    in that order; `layout`: the prompt's reordered layout (families that reorder)."""
    head_end = link.chunks[0][0]
    if layout is not None:
        spans = []
        position = layout.head_len
        for index, ((s, e), fragments, chunk) in enumerate(zip(link.chunks, layout.fragments, stored)):
            # A chunk recomputed whole stays as an empty segment: see recomputed_whole.
            for fragment in fragments or [None]:
                start, end, offset = (position, position, e - s) if fragment is None else (
                    fragment.start, fragment.end, fragment.chunk_offset)
                spans.append((start, end, chunk, offset, s, index))
                position = end
    elif link.family.blends_chunks:
        # Only the head is grafted: the chunks are extend tokens, their cached KV is placed in
        # the forward (sglang_patches.steps.cacheblend).
        spans = []
    else:
        # legolink0 chunks are stored behind sink tokens: skip them, shift by their count.
        sinks = link.family.sink_tokens
        spans = [(s, e, chunk, sinks, s - sinks, index) for index, ((s, e), chunk) in enumerate(zip(link.chunks, stored))]
    # The head (system prompt) is a true prefix: compiled at position 0 it is exact KV, so it is
    # grafted from the chunk store unshifted, but it is not a chunk (never counted, never
    # recomputed by a link step).
    head = [Segment(0, head_end, StoredChunk.of(original[:head_end]), 0, 0, HEAD)] if head_end > 0 else []
    return head + [Segment(*span) for span in spans]


def _state(link: LinkRequest, prompt_len: int) -> LinkState:
    stats = LinkStats(policy="compile" if link.compile else link.policy)
    if link.report_attention:
        # The question follows the last chunk in either order.
        stats.context_attention = AttentionReport(question_start=link.chunks[-1][1] if link.chunks else 0)
    if link.report_span:
        stats.span = SpanReport(first_position=prompt_len - link.report_span)
    return LinkState(stats)


def build_plan(prompt: list[int], link: LinkRequest, repair_digest: Optional[str]) -> tuple[LinkPlan, LinkState]:
    """The plan of an admitted link over `prompt` (as sent), and its state before it runs.
    `repair_digest`: the engine's repair checkpoint, None when it has none (then a repairing
    family is served as its unrepaired counterpart before this is called)."""
    family = link.family
    state = _state(link, len(prompt))
    if link.compile:
        # The whole prompt is one chunk, filed under the store's key.
        compiled = StoredChunk.of(prompt)
        return LinkPlan(link, tuple(prompt), (), (), None, store_key(compiled), None, False, compiled), state
    if not family.reuses_chunks:
        return LinkPlan(link, tuple(prompt), (), (), None, None, None, False), state
    runs = link.recomputed_runs if link.layout == REORDERED_LAYOUT else None
    namespace = namespace_of(
        family.name, sink_token=link.sink_token if family.sink_tokens else None,
        chunks=link.chunks, recomputed=runs, repair_digest=repair_digest if family.repairs else None,
    )
    if not link.chunks:
        return LinkPlan(link, tuple(prompt), (), (), namespace, None, None, False), state
    layout = None if runs is None else reordered_layout(len(prompt), link.chunks, runs)
    original = prompt if layout is None else layout.restore(prompt)
    chunks = [StoredChunk.of(tokens) for tokens in link.stored_chunks(original)]
    segments = tuple(_segments(prompt, original, link, chunks, layout))
    blend_sources = ()
    if family.blends_chunks:
        blend_sources = tuple(ChunkSpan(s, e, chunk) for (s, e), chunk in zip(link.chunks, chunks))
        stored = tuple(chunks)
    else:
        # Each chunk once, however many runs of it are grafted.
        stored = tuple({seg.chunk: seg.stored for seg in segments if seg.is_chunk and not seg.recomputed_whole}.values())
    plan = LinkPlan(
        link, tuple(prompt), segments, stored, namespace,
        tree_key=prompt_key(prompt, segments, repaired=family.repairs),
        order=None if layout is None else tuple(layout.order), repairs=family.repairs, blend_sources=blend_sources,
    )
    return plan, state
