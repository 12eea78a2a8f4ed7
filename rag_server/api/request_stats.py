"""What the frontend has answered: RAG requests per policy and their time to first token.

Kept in memory by the frontend process (`app.state.request_stats`), for the page's live panels
(`GET /picrag/stats`, rag_server/api/page.py). The runtime's own counters (chunk hits, disk store)
are Prometheus metrics on its /metrics; these are the numbers only the frontend sees: which
policy served each request and how long its first token took, compiling included.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from fastapi import Request

from rag_server.service.percentile import percentile
from picrag_core.policies import PolicyError, parse_policy

# TTFT samples kept per policy for its percentiles, and requests kept for the recent-TTFT chart.
TTFT_WINDOW = 500
RECENT_REQUESTS = 60


@dataclass
class PolicyStats:
    requests: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    ttft_ms: deque[float] = field(default_factory=lambda: deque(maxlen=TTFT_WINDOW))

    def summary(self) -> dict:
        samples = list(self.ttft_ms)
        return {
            "requests": self.requests,
            "reused_tokens": self.reused_tokens,
            "computed_tokens": self.computed_tokens,
            "ttft_p50_ms": percentile(samples, 50),
            "ttft_p90_ms": percentile(samples, 90),
        }


@dataclass(frozen=True)
class Answered:
    policy: str
    ttft_ms: float
    reused_tokens: int
    computed_tokens: int


def _family(policy: str) -> str:
    """Requests are counted per policy family: a client picks parameters freely, and a key per
    name ('legolink:1', 'legolink:2', ...) would grow without bound."""
    try:
        return parse_policy(policy).family.name
    except PolicyError:
        return policy  # `auto`


class RequestStats:
    def __init__(self) -> None:
        self._policies: dict[str, PolicyStats] = {}
        self._recent: deque[Answered] = deque(maxlen=RECENT_REQUESTS)

    def record(self, answered: Answered) -> None:
        stats = self._policies.setdefault(_family(answered.policy), PolicyStats())
        stats.requests += 1
        stats.reused_tokens += answered.reused_tokens
        stats.computed_tokens += answered.computed_tokens
        stats.ttft_ms.append(answered.ttft_ms)
        self._recent.append(answered)

    def summary(self) -> dict:
        """Per policy (as the answers named it): requests, tokens and TTFT p50/p90 over the last
        TTFT_WINDOW; overall p50/p90 of the same samples; the last RECENT_REQUESTS, oldest first."""
        samples = [ms for stats in self._policies.values() for ms in stats.ttft_ms]
        return {
            "requests": sum(stats.requests for stats in self._policies.values()),
            "ttft_p50_ms": percentile(samples, 50),
            "ttft_p90_ms": percentile(samples, 90),
            "policies": {name: stats.summary() for name, stats in sorted(self._policies.items())},
            "recent": [asdict(answered) for answered in self._recent],
        }


def request_stats(request: Request) -> RequestStats:
    return request.app.state.request_stats
