"""What changes while a linked request runs, kept apart from its plan (which never does).

The plan (sglang_patches.plan.link_plan) is what the request asked for, derived once; its state
is what happened to it: the accounting reported in meta_info, the reports it asked for as they
fill, its lease on stored chunks, CacheBlend's sources once its prefix is matched, and whether
it has been counted. Both hang on SGLang's request object (`STATE_ATTR` here, `PLAN_ATTR` there);
`state_of` reads this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from picrag_core.engine_report import LinkCounts

if TYPE_CHECKING:
    import torch

STATE_ATTR = "picrag_state"


@dataclass
class AttentionReport:
    """The question's attention over the prompt for a link that asks (sglang_patches.steps.context_attention):
    one request's running sums, kept in its state until sent."""

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
class LinkState:
    stats: LinkStats
    blend: Any = None  # sglang_patches.steps.cacheblend.BlendPlan, set when the request is matched
    # Ends the request's lease on its stored chunks (set by the chunk cache while one is held).
    end_lease: Optional[Callable[[], None]] = field(default=None, repr=False)
    # Adds the request's accounting to the engine's counters (set by the chunk cache; once).
    count: Optional[Callable[[LinkStats], None]] = field(default=None, repr=False)

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


def state_of(req) -> Optional[LinkState]:
    """The state of an admitted linked request; None for a vanilla one (or one not yet admitted)."""
    return getattr(req, STATE_ATTR, None)
