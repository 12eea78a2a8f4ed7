"""The open-loop schedule of `picrag bench steady`: who asks what, when, by which route.

Questions arrive as a Poisson process at `rate` per second. A share `novel` of them are
questions asked once, whose passages no earlier request held; the others are drawn from a pool of
`pool` questions by a Zipf law of exponent `zipf` (the question of rank r with weight 1 / r^s), so
a few questions' passages come back often and most rarely, as retrieval over a real corpus
does. Every request carries its question's first `passages` passages in an order drawn anew
(retrieval ranks the same passages differently for related questions), so SGLang's prefix cache
matches at most up to the first passage that moved, while a chunk store finds every passage.
Each request also draws its route (`/rag/query` with the passages inline, the OpenAI chat route
with picrag's `documents`, or `/generate` with `kv_hints`) and its policy (the server's default,
`auto`, `naive`) from the given mixes.

The schedule is a pure function of its settings and seed: every system a run compares (picrag,
prefix-only, stock SGLang) is sent the very same requests at the very same offsets.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from retrieval.prompt_layout import PromptPassage
from retrieval.qa_rows import QARow

RAG, CHAT, GENERATE = "rag", "chat", "generate"
ROUTES = (RAG, CHAT, GENERATE)
DEFAULT_POLICY = "default"  # the request names no policy: the server's default serves it
POLICY_MIX = (DEFAULT_POLICY, "auto", "naive")


@dataclass(frozen=True)
class ScheduleSettings:
    minutes: float
    rate: float  # arrivals per second
    zipf: float  # exponent of the popular questions' Zipf law
    novel: float  # share of requests whose question (and passages) is asked once
    pool: int  # popular questions
    passages: int  # passages per request
    routes: tuple[str, ...] = ROUTES
    policies: tuple[str, ...] = POLICY_MIX
    seed: int = 0


@dataclass(frozen=True)
class Scheduled:
    index: int
    at_s: float  # offset from the run's start
    question: str
    passages: tuple[PromptPassage, ...]
    route: str
    policy: str  # a policy name, or DEFAULT_POLICY
    novel: bool
    topic: str  # the question's id: requests of one topic share their passages


def zipf_weights(count: int, exponent: float) -> list[float]:
    weights = [1.0 / (rank ** exponent) for rank in range(1, count + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def expected_repeat_share(settings: ScheduleSettings, requests: int) -> float:
    """The share of requests whose passages an earlier request already held, expected from the
    Zipf law: a popular request at position i repeats with probability sum_r p_r (1 - (1 - p_r)^k),
    k the popular requests before it; novel requests never repeat."""
    weights = zipf_weights(settings.pool, settings.zipf)
    popular = max(0.0, 1.0 - settings.novel)
    total = 0.0
    for position in range(requests):
        before = position * popular
        total += popular * sum(p * (1.0 - (1.0 - p) ** before) for p in weights)
    return total / requests if requests else 0.0


def build_schedule(rows: Sequence[QARow], settings: ScheduleSettings) -> list[Scheduled]:
    """The run's requests in arrival order. `rows`: every question available, each with at least
    `settings.passages` passages; the first `pool` (after a seeded shuffle) are the popular ones,
    the rest are asked once each when a novel request needs one."""
    usable = [row for row in rows if len(row.passages) >= settings.passages]
    rng = random.Random(settings.seed)
    rng.shuffle(usable)
    popular, reserve = usable[: settings.pool], usable[settings.pool:]
    if len(popular) < settings.pool:
        raise ValueError(f"{len(usable)} questions with {settings.passages} passages; the pool needs {settings.pool}")
    weights = zipf_weights(len(popular), settings.zipf)
    schedule: list[Scheduled] = []
    clock = rng.expovariate(settings.rate)
    end = settings.minutes * 60.0
    while clock < end:
        novel = bool(reserve) and rng.random() < settings.novel
        row = reserve.pop() if novel else rng.choices(popular, weights)[0]
        passages = list(row.passages[: settings.passages])
        rng.shuffle(passages)
        schedule.append(Scheduled(
            index=len(schedule), at_s=clock, question=row.question, passages=tuple(passages),
            route=rng.choice(settings.routes), policy=rng.choice(settings.policies), novel=novel, topic=row.id,
        ))
        clock += rng.expovariate(settings.rate)
    return schedule


def repeat_share(schedule: Sequence[Scheduled]) -> float:
    """The share of the schedule's requests whose topic an earlier request already asked."""
    seen: set[str] = set()
    repeats = 0
    for request in schedule:
        repeats += request.topic in seen
        seen.add(request.topic)
    return repeats / len(schedule) if schedule else 0.0
