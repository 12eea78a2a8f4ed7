"""One typed plan per linked request, built once when the engine admits it.

Everything the engine does with a linked request reads its plan: the tree namespace and key
(sglang_patches.plan.keys), the chunks grafted and repaired (sglang_patches.tree.chunk_cache), the
stored chunks leased on arrival, the true positions of a prompt sent reordered
(sglang_patches.steps.positions), CacheBlend's sources (sglang_patches.steps.cacheblend), the first-token
report and the accounting in meta_info. It hangs on SGLang's request object under one
attribute (`PLAN_ATTR`); `plan_of` reads it. Building it is pure: the same request always gets
the same plan, whatever the cache holds.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from picrag_core.engine_report import LinkCounts
from picrag_core.reordered_layout import reordered_layout
from picrag_core.link_hints import REORDERED_LAYOUT, LinkRequest
from picrag_core.policies import PolicyFamily
from sglang_patches.plan.keys import namespace_of, prompt_key, store_key
from sglang_patches.plan.segments import HEAD, Segment

if TYPE_CHECKING:
    import torch

PLAN_ATTR = "picrag_plan"


@dataclass
class AttentionReport:
    """The question's attention over the prompt for a link that asks (sglang_patches.steps.context_attention):
    one request's running sums, kept in its link stats until sent."""

    question_start: int  # row index (order sent) of the question's first token
    sums: Optional[torch.Tensor] = None  # [row entries] float64, summed over layers, heads and question tokens


@dataclass
class SpanReport:
    """A link's reported positions (sglang_patches.steps.span_report): the next token's
    log-probabilities after each, collected as the forward computes them, in position order."""

    first_position: int  # the first reported prompt position (prompt length - K)
    rows: list[torch.Tensor] = field(default_factory=list)  # [n, vocab] float32, on CPU

    def encode(self) -> str:
        import torch

        from picrag_core.engine_report import encode_floats

        return encode_floats(torch.cat(self.rows).numpy() if self.rows else [])


@dataclass
class LinkStats:
    """Per-request accounting, reported in meta_info and summed into the counters."""

    policy: str
    chunk_hits: int = 0
    # Chunks not served from the store: missing there, or cut (below).
    chunk_misses: int = 0
    # Of the misses, chunks the request's own shape kept from being grafted (logprob_start_len,
    # the last prompt token that is always computed, tokens between chunks): linking it again
    # would cut them again.
    chunks_cut: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    grafted_tokens: int = 0
    # sglang_patches.steps.first_token_report: the first answer token's log-probabilities, when asked for.
    first_token_logprobs: Optional[str] = None
    # sglang_patches.steps.context_attention: the question's attention over the prompt, when asked for.
    context_attention: Optional[AttentionReport] = None
    # sglang_patches.steps.span_report: the last positions' distributions, when asked for.
    span: Optional[SpanReport] = None

    def as_meta(self) -> dict[str, int | str]:
        """The accounting in meta_info (picrag_core.engine_report, where it is read back)."""
        return LinkCounts(self.policy, self.chunk_hits, self.chunk_misses, self.chunks_cut, self.reused_tokens,
                          self.computed_tokens).as_meta()


@dataclass
class LinkPlan:
    link: LinkRequest
    prompt: tuple[int, ...]  # as sent
    segments: tuple[Segment, ...]  # head and chunks that can be grafted, in the order sent
    # The stored chunks the request reads (as stored), for its lease: grafted ones, or a blend's.
    stored_chunks: tuple[tuple[int, ...], ...]
    namespace: Optional[str]  # the tree namespace of a chunk-reusing family's prompts
    tree_key: Optional[array]  # the prompt's tree key; None: its plain tokens
    order: Optional[list[int]]  # a reordered prompt: sent index -> true position
    repairs: bool  # grafted chunk KV goes through the repair network
    stats: LinkStats
    blend: Any = None  # sglang_patches.steps.cacheblend.BlendPlan, set when the request is matched
    # Ends the request's lease on its stored chunks (set by the chunk cache while one is held).
    end_lease: Optional[Callable[[], None]] = field(default=None, repr=False)
    # Adds the request's accounting to the engine's counters (set by the chunk cache; once).
    count: Optional[Callable[[LinkStats], None]] = field(default=None, repr=False)

    @property
    def family(self) -> PolicyFamily:
        return self.link.family

    def answered(self) -> None:
        """The request's last output is being built: it is counted now, before its client can
        read the counters (at the release of its KV, which follows, a client could be first)."""
        count, self.count = self.count, None
        if count is not None:
            count(self.stats)

    def release_lease(self) -> None:
        end, self.end_lease = self.end_lease, None
        if end is not None:
            end()


def plan_of(req) -> Optional[LinkPlan]:
    """The plan of an admitted linked request; None for a vanilla one (or one not yet admitted)."""
    return getattr(req, PLAN_ATTR, None)


def _segments(prompt: list[int], link: LinkRequest) -> list[Segment]:
    if not (link.family.reuses_chunks and link.chunks):
        return []
    head_end = link.chunks[0][0]
    if link.layout == REORDERED_LAYOUT:
        layout = reordered_layout(len(prompt), link.chunks, link.recomputed_runs)
        original = layout.restore(prompt)
        spans = []
        position = layout.head_len
        stored = link.stored_chunks(original)
        for index, ((s, e), fragments, tokens) in enumerate(zip(link.chunks, layout.fragments, stored)):
            # A chunk recomputed whole stays as an empty segment: see recomputed_whole.
            for fragment in fragments or [None]:
                start, end, offset = (position, position, e - s) if fragment is None else (
                    fragment.start, fragment.end, fragment.chunk_offset)
                spans.append((start, end, tokens, offset, s, index))
                position = end
    elif link.family.blends_chunks:
        # Only the head is grafted: the chunks are extend tokens, their cached KV is placed in
        # the forward (sglang_patches.steps.cacheblend).
        original, spans = prompt, []
    else:
        original = prompt
        # legolink0 chunks are stored behind sink tokens: skip them, shift by their count.
        sinks = link.family.sink_tokens
        spans = [(s, e, tokens, sinks, s - sinks, index)
                 for index, ((s, e), tokens) in enumerate(zip(link.chunks, link.stored_chunks(prompt)))]
    # The head (system prompt) is a true prefix: compiled at position 0 it is exact KV, so it is
    # grafted from the chunk store unshifted, but it is not a chunk (never counted, never
    # recomputed by a link step).
    head = [Segment(0, head_end, tuple(original[:head_end]), 0, 0, HEAD)] if head_end > 0 else []
    return head + [Segment(*span) for span in spans]


def build_plan(prompt: list[int], link: LinkRequest, repair_digest: Optional[str]) -> LinkPlan:
    """The plan of an admitted link over `prompt` (as sent). `repair_digest`: the engine's repair
    checkpoint, None when it has none (then a repairing family is served as its unrepaired
    counterpart before this is called)."""
    family = link.family
    stats = LinkStats(policy="compile" if link.compile else link.policy)
    if link.report_attention:
        # The question follows the last chunk in either order.
        stats.context_attention = AttentionReport(question_start=link.chunks[-1][1] if link.chunks else 0)
    if link.report_span:
        stats.span = SpanReport(first_position=len(prompt) - link.report_span)
    if link.compile:
        # The whole prompt is one chunk, filed under the store's key.
        return LinkPlan(link, tuple(prompt), (), (), None, store_key(prompt), None, False, stats)
    if not family.reuses_chunks:
        return LinkPlan(link, tuple(prompt), (), (), None, None, None, False, stats)
    segments = tuple(_segments(prompt, link))
    reordered = link.layout == REORDERED_LAYOUT
    runs = link.recomputed_runs if reordered else None
    namespace = namespace_of(
        family.name, sink_token=link.sink_token if family.sink_tokens else None,
        chunks=link.chunks, recomputed=runs, repair_digest=repair_digest if family.repairs else None,
    )
    if family.blends_chunks:
        stored = tuple(link.stored_chunks(prompt))
    else:
        # Each chunk once, however many runs of it are grafted.
        stored = tuple({seg.chunk: seg.chunk_tokens for seg in segments
                        if seg.is_chunk and not seg.recomputed_whole}.values())
    return LinkPlan(
        link, tuple(prompt), segments, stored, namespace,
        tree_key=prompt_key(prompt, segments, repaired=family.repairs) if link.chunks else None,
        order=reordered_layout(len(prompt), link.chunks, runs).order if reordered else None,
        repairs=family.repairs, stats=stats,
    )
