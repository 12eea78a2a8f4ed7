"""First-token quality of a reuse policy against `full`: prompt-size buckets, and the running record
that shadow sampling fills (rag_server/service/shadow.py) and the `auto` policy reads
(rag_server/service/auto_policy.py).

A sample's KL(full || policy) is exact over the whole vocabulary
(picrag_core.engine_report.exact_kl). Agreement: both pick the same greedy first token.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

# Upper bounds of the prompt-size buckets, in prompt tokens; the last bucket is open.
BUCKET_BOUNDS: tuple[int, ...] = (512, 1024, 2048)
DEFAULT_WINDOW = 100  # samples in the "recent" view of each (policy, bucket)


def bucket_labels(bounds: Sequence[int] = BUCKET_BOUNDS) -> list[str]:
    lower = [0, *bounds]
    labels = [f"<{bounds[0]}"] + [f"{lo}-{hi}" for lo, hi in zip(lower[1:], bounds[1:])]
    return labels + [f">={bounds[-1]}"]


def size_bucket(prompt_tokens: int, bounds: Sequence[int] = BUCKET_BOUNDS) -> str:
    """The bucket label of a prompt of `prompt_tokens` tokens: '<512', '1024-2048', '>=2048'."""
    labels = bucket_labels(bounds)
    for label, bound in zip(labels, bounds):
        if prompt_tokens < bound:
            return label
    return labels[-1]


@dataclass(frozen=True)
class Sample:
    policy: str  # canonical policy name ('legolink:16')
    prompt_tokens: int
    kl: float
    agrees: bool


@dataclass
class _Tally:
    count: int = 0
    kl_sum: float = 0.0
    agreements: int = 0

    def add(self, kl: float, agrees: bool) -> None:
        self.count += 1
        self.kl_sum += kl
        self.agreements += int(agrees)

    def as_json(self) -> dict[str, Any]:
        return {"count": self.count,
                "mean_kl": self.kl_sum / self.count if self.count else None,
                "agreement_rate": self.agreements / self.count if self.count else None}


@dataclass
class _Cell:
    """One (policy, bucket): all-time totals and the last `window` samples."""

    window: int
    all_time: _Tally = field(default_factory=_Tally)
    recent: deque = field(default_factory=deque)

    def add(self, kl: float, agrees: bool) -> None:
        self.all_time.add(kl, agrees)
        self.recent.append((kl, agrees))
        while len(self.recent) > self.window:
            self.recent.popleft()

    def recent_tally(self) -> _Tally:
        tally = _Tally()
        for kl, agrees in self.recent:
            tally.add(kl, agrees)
        return tally


@dataclass
class ShadowCost:
    """What shadow sampling spent, and what it left out."""

    sent: int = 0  # shadow pairs sent (one `full` and one policy request each)
    prefilled_tokens: int = 0  # prompt tokens the runtime computed for them
    skipped_capacity: int = 0  # sampled, but the server was busy or the shadow cap was reached
    failed: int = 0  # a shadow request the runtime refused or failed (the user's answer is untouched)


class QualityRecord:
    """First-token KL and agreement per (policy, prompt-size bucket), all-time and recent, and
    the shadow cost. Thread-safe: /picrag/quality and the metrics read while shadows write."""

    def __init__(self, window: int = DEFAULT_WINDOW, bounds: Sequence[int] = BUCKET_BOUNDS):
        self.window = window
        self.bounds = tuple(bounds)
        self.cost = ShadowCost()
        self._cells: dict[tuple[str, str], _Cell] = {}
        self._lock = threading.Lock()
        self._listeners: list = []

    def on_sample(self, listener) -> None:
        """Call `listener(sample, bucket)` for every sample recorded (the Prometheus export)."""
        self._listeners.append(listener)

    def add(self, sample: Sample) -> None:
        bucket = size_bucket(sample.prompt_tokens, self.bounds)
        with self._lock:
            cell = self._cells.setdefault((sample.policy, bucket), _Cell(self.window))
            cell.add(sample.kl, sample.agrees)
        for listener in self._listeners:
            listener(sample, bucket)

    def observed(self, policy: str, bucket: str) -> tuple[int, Optional[float]]:
        """(all-time sample count, their mean KL) of `policy` on prompts of `bucket`."""
        with self._lock:
            cell = self._cells.get((policy, bucket))
            if cell is None:
                return 0, None
            return cell.all_time.count, cell.all_time.as_json()["mean_kl"]

    def as_json(self) -> dict[str, Any]:
        with self._lock:
            policies: dict[str, dict[str, Any]] = {}
            for (policy, bucket), cell in sorted(self._cells.items()):
                policies.setdefault(policy, {})[bucket] = {
                    "all_time": cell.all_time.as_json(), "recent": cell.recent_tally().as_json()}
            return {
                "kl": "KL(full || policy) of the first token over full's top-k ids plus an 'other' "
                      "bucket: a lower bound of the exact KL",
                "agreement": "the policy's greedy first token equals full's",
                "buckets": bucket_labels(self.bounds),
                "recent_window": self.window,
                "policies": policies,
                "shadow_cost": vars(self.cost).copy(),
            }
