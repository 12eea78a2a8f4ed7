"""The engine's report on each request: picrag's fields in SGLang's response `meta_info`.

SGLang ships a per-request dict of cache details with every response
(`meta_info.cached_tokens_details`); the engine adds its fields there (sglang_patches.steps.meta_info):
the link's accounting (`LinkCounts.as_meta`), and, when the link asked for them, the first answer
token's log-probabilities over the whole vocabulary (sglang_patches.steps.first_token_report), the
next token's after each of the prompt's last K positions (sglang_patches.steps.span_report, K rows
of the vocabulary one after the other) and the question's attention over every prompt position
(sglang_patches.steps.context_attention), each as
base64 of little-endian float32 (`encode_floats`). Everything that reads a response decodes it
with `EngineReport.of`, here, next to the schema it writes.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np

DETAILS_KEY = "cached_tokens_details"
FIELD_PREFIX = "picrag_"
FIRST_TOKEN_KEY = FIELD_PREFIX + "first_token_logprobs"
ATTENTION_KEY = FIELD_PREFIX + "context_attention"
SPAN_KEY = FIELD_PREFIX + "span_logprobs"
# The engine's start-up self-check result in /get_server_info's internal states.
SERVER_INFO_KEY = "picrag_rope_check"


def encode_floats(values: Any) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


def decode_floats(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


@dataclass(frozen=True)
class LinkCounts:
    """A linked request's accounting, as the engine reports it (`picrag_<field>`; what each
    counts: sglang_patches.plan.link_plan.LinkStats)."""

    policy: str  # the family served (or "compile")
    chunk_hits: int = 0
    chunk_misses: int = 0
    chunks_cut: int = 0  # of the misses, those the request's own shape caused
    reused_tokens: int = 0
    computed_tokens: int = 0

    def as_meta(self) -> dict[str, int | str]:
        return {FIELD_PREFIX + f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def of(cls, details: Mapping[str, Any]) -> Optional[LinkCounts]:
        """The counts in `details`; None where the engine linked nothing (no picrag field)."""
        names = [f.name for f in fields(cls)]
        if not any(FIELD_PREFIX + name in details for name in names):
            return None
        counts = {name: int(details.get(FIELD_PREFIX + name) or 0) for name in names[1:]}
        return cls(str(details.get(FIELD_PREFIX + "policy") or ""), **counts)

    @property
    def relinkable_misses(self) -> int:
        """Misses a new compile can mend: those the request's own shape did not cause."""
        return self.chunk_misses - self.chunks_cut


@dataclass(frozen=True)
class EngineReport:
    """One response's `meta_info`, decoded."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # SGLang's own prefix-cache hits
    link: Optional[LinkCounts] = None  # None: not a linked request
    first_token_logprobs: Optional[np.ndarray] = None  # one per vocabulary id, when asked for
    context_attention: Optional[np.ndarray] = None  # one per prompt position, when asked for
    # [K, vocabulary]: after each of the prompt's last K positions, when asked for (flat until
    # `span_rows` shapes it: the vocabulary's size is the reader's to know).
    span_logprobs: Optional[np.ndarray] = None

    @classmethod
    def of(cls, meta_info: Optional[Mapping[str, Any]], prompt_tokens: int = 0) -> EngineReport:
        """`meta_info` of a /generate answer or stream event; `prompt_tokens`: the prompt's length
        where meta_info does not say."""
        meta = meta_info or {}
        details = meta.get(DETAILS_KEY) or {}
        first_token, attention, span = (details.get(key) for key in (FIRST_TOKEN_KEY, ATTENTION_KEY, SPAN_KEY))
        return cls(
            prompt_tokens=int(meta.get("prompt_tokens", prompt_tokens)),
            completion_tokens=int(meta.get("completion_tokens", 0)),
            cached_tokens=int(meta.get("cached_tokens", 0) or 0),
            link=LinkCounts.of(details),
            first_token_logprobs=None if first_token is None else decode_floats(first_token),
            context_attention=None if attention is None else decode_floats(attention),
            span_logprobs=None if span is None else decode_floats(span),
        )

    def span_rows(self, positions: int) -> Optional[np.ndarray]:
        """The reported span as [positions, vocabulary]; None when none came back, ValueError
        when it does not hold `positions` whole rows."""
        if self.span_logprobs is None:
            return None
        if positions < 1 or len(self.span_logprobs) % positions:
            raise ValueError(f"{len(self.span_logprobs)} span values are not {positions} rows")
        return self.span_logprobs.reshape(positions, -1)

    @property
    def reused_tokens(self) -> int:
        # Requests without chunk accounting (full, prefix, vanilla) still report SGLang's own prefix hits.
        return self.cached_tokens if self.link is None else self.link.reused_tokens

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens if self.link is None else self.link.computed_tokens

    @property
    def chunk_hits(self) -> int:
        return 0 if self.link is None else self.link.chunk_hits

    @property
    def chunk_misses(self) -> int:
        return 0 if self.link is None else self.link.chunk_misses

    @property
    def relinkable_misses(self) -> int:
        return 0 if self.link is None else self.link.relinkable_misses


def exact_kl(reference: np.ndarray, measured: np.ndarray) -> float:
    """KL(reference || measured) over the whole vocabulary, from two reported first-token
    log-probability vectors."""
    if reference.shape != measured.shape:
        raise ValueError(f"distributions over {reference.shape} and {measured.shape} ids")
    p_log = reference.astype(np.float64)
    q_log = measured.astype(np.float64)
    p = np.exp(p_log)
    # Tokens the reference gives no mass to contribute nothing, whatever the other side says.
    support = p > 0
    return float(np.sum(p[support] * (p_log[support] - q_log[support])))
