"""A differential fuzzer for cache transparency: no answer may depend on what other requests did.

For every request that answers (a victim), the answer it gets after a sequence of other
requests must equal the one it gets on a flushed cache: the same status, the same output ids
(text on the RAG routes), and first-token log-probabilities within `tolerance`. Sharing that is
right by design (a causal chunk prefix reused from a longer stored chunk, a prompt prefix reused
from another request) moves them by rounding only; the tolerance is measured and stated with
each run (the report's `deviation` section).

A run is a list of seeded episodes (rag_server.bench.transparency_requests). Each is played
serially on a flushed cache; then every victim is compared with its reference, the same request
alone on a flushed cache (memoized per distinct request), which is what the same request gets
from a fresh server. `auto` is compared under the policy it resolved to, since calibration
changing its pick is by design. Two cross checks work on references only:

* form: each prompt of a batch (input_ids a list of lists, kv_hints a list) gets what it gets
  alone, or the batch is refused; a batch served where its single form is refused is a violation;
* route: a frontend `/generate` link answers like the same policy computed independently on the
  runtime (its pieces compiled with picrag.compile, then linked in the runtime's own format),
  where the runtime answers that at all. Not for the selecting families, whose frontend first
  measures what to recompute (tests/test_select.py compares that with a link naming the same
  positions).

A violation keeps the requests before it in its episode; `shrink` replays subsets of them to
find a minimal sequence of attackers that still moves the victim.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

from rag_server.bench.transparency_requests import (AUTO, ENGINE, GENERATE, VANILLA, Generator, GeneratorSettings,
                                                    Request)
from rag_server.bench.transparency_cases import likely_case
from rag_server.bench.transparency_wire import Difference, Observation, Wire, compare
from picrag_core.policies import parse_policy

logger = logging.getLogger(__name__)
# Log-probability rounding allowed between two answers of the same request. Measured on
# SmolLM2 (CPU, fp32): legitimate sharing (a stored causal chunk prefix, a prompt prefix of
# another request) moved first-token log-probabilities by at most 4.2e-5 over the whole
# vocabulary in 5,000 requests (docs/security.md); the smallest violation seen moved them by
# 1.1e-3, most by 1e-2 and more. The report's `deviation` section shows both sides of every run.
TOLERANCE = 1e-4
SHRINK_TRIALS = 12  # replays spent on making one violation's attacker sequence minimal


@dataclass(frozen=True)
class FuzzConfig:
    seed: int = 0
    requests: int = 200
    tolerance: float = TOLERANCE
    generator: GeneratorSettings = GeneratorSettings()
    cross_checks: bool = True  # the form and route checks (they cost references of their own)
    shrink_per_signature: int = 2  # violations of one (check, route, family, kind) made minimal
    max_reported: int = 200  # violations kept in the report (all are counted)
    # Seconds after which no new episode starts and nothing more is shrunk (None: play them all);
    # the episodes played are then the first ones of the seed's list.
    time_budget_s: Optional[float] = None
    # Play only episodes shard[0], shard[0] + shard[1], ... of the seed's list: one seeded run
    # split over servers of the same build (episodes are independent: each starts on a flush).
    shard: tuple[int, int] = (0, 1)


@dataclass
class Violation:
    check: str  # "transparency", "form" or "route"
    victim: Request
    difference: Difference
    preceding: list[Request] = field(default_factory=list)
    minimal: Optional[list[Request]] = None  # None: not shrunk
    reference_reuse: dict[str, Any] = field(default_factory=dict)
    observed_reuse: dict[str, Any] = field(default_factory=dict)
    episode: int = -1

    @property
    def signature(self) -> tuple[str, str, str, str]:
        return self.check, self.victim.route, family_of(self.victim.policy), self.difference.kind

    def as_json(self) -> dict[str, Any]:
        return {
            "check": self.check, "kind": self.difference.kind, "max_abs": self.difference.max_abs,
            "detail": self.difference.detail, "episode": self.episode,
            "likely_case": likely_case(self.check, self.victim, self.preceding, self.minimal),
            "victim": self.victim.describe(), "reference_reuse": self.reference_reuse,
            "observed_reuse": self.observed_reuse,
            "minimal_attackers": None if self.minimal is None else [r.describe() for r in self.minimal],
            "preceding": [r.describe() for r in self.preceding],
        }


def family_of(policy: str) -> str:
    return policy if policy in (AUTO, VANILLA, "compile") else parse_policy(policy).family.name


def _decade(value: float) -> str:
    if value == 0:
        return "0"
    exponent = math.floor(math.log10(value))
    return f"1e{exponent}" if exponent < 0 else ">=1"


@dataclass
class Deviations:
    """Largest and smallest first-token deviations seen, by what the victim shared."""

    fresh_max: float = 0.0  # victims played first in their episode: run-to-run rounding
    shared_max: float = 0.0  # passing victims that reused more than their reference: legitimate sharing
    pass_max: float = 0.0
    violation_min: Optional[float] = None  # smallest deviation of a violation that moved log-probabilities
    histogram: Counter = field(default_factory=Counter)

    def add(self, difference: Difference, fresh: bool, shared: bool) -> None:
        self.histogram[_decade(difference.max_abs)] += 1
        if difference.kind in ("logprobs", "tokens"):
            if difference.max_abs > 0:
                self.violation_min = min(self.violation_min or math.inf, difference.max_abs)
            return
        if difference.kind:
            return
        self.pass_max = max(self.pass_max, difference.max_abs)
        if fresh:
            self.fresh_max = max(self.fresh_max, difference.max_abs)
        if shared:
            self.shared_max = max(self.shared_max, difference.max_abs)

    def as_json(self) -> dict[str, Any]:
        return {"fresh_max": self.fresh_max, "legitimate_sharing_max": self.shared_max, "pass_max": self.pass_max,
                "violation_min": self.violation_min,
                "histogram": dict(sorted(self.histogram.items(), key=lambda kv: _order(kv[0])))}


def _order(bucket: str) -> float:
    return -math.inf if bucket == "0" else math.inf if bucket == ">=1" else float(bucket)


@dataclass
class Report:
    seed: int
    tolerance: float
    requests: int = 0  # played in episodes (references and shrink replays not counted)
    episodes: int = 0
    victims: int = 0
    references: int = 0
    counts: dict[str, Counter] = field(default_factory=lambda: {
        k: Counter() for k in ("policy", "route", "form", "logprobs", "extra_key", "client_layout", "served")})
    deviations: Deviations = field(default_factory=Deviations)
    violations: list[Violation] = field(default_factory=list)
    violation_counts: Counter = field(default_factory=Counter)
    wall_s: float = 0.0
    max_reported: int = 200
    # The server stopped answering (a crash is the one violation that ends a run): the error and
    # the request it was answering.
    stopped: Optional[dict[str, Any]] = None

    def count(self, request: Request) -> None:
        self.requests += 1
        self.counts["policy"][request.policy] += 1
        self.counts["route"][request.route] += 1
        self.counts["form"]["batch" if request.batch else "single"] += 1
        logprobs = request.logprobs
        mode = ("span" if logprobs.span else "full_first_token" if logprobs.full_first_token else "start_len" if logprobs.start_len is not None
                else "top" if logprobs.top else "return_logprob" if logprobs.return_logprob else "none")
        self.counts["logprobs"][mode] += 1
        self.counts["extra_key"]["set" if request.extra_key else "none"] += 1
        self.counts["client_layout"][str(request.client_layout).lower()] += 1

    def record(self, violation: Violation) -> None:
        self.violation_counts["/".join(violation.signature)] += 1
        if len(self.violations) < self.max_reported:
            self.violations.append(violation)

    @property
    def passed(self) -> bool:
        return not self.violation_counts and self.stopped is None

    def as_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed, "tolerance": self.tolerance, "passed": self.passed, "requests": self.requests,
            "episodes": self.episodes, "victims": self.victims, "references": self.references,
            "wall_s": round(self.wall_s, 1),
            "counts": {name: dict(sorted(c.items())) for name, c in self.counts.items()},
            "deviation": self.deviations.as_json(),
            "violation_counts": dict(sorted(self.violation_counts.items())),
            "stopped": self.stopped,
            "violations": [v.as_json() for v in self.violations],
        }


class Fuzzer:
    """Plays requests through `wire`; `flush` empties the server's caches once it is idle."""

    def __init__(self, wire: Wire, flush: Callable[[], None], config: FuzzConfig = FuzzConfig()):
        self.wire = wire
        self.flush = flush
        self.config = config
        self._references: dict[Request, Observation] = {}
        self._cross_checked: set[Request] = set()
        # The last requests sent: a runtime that died answering one refuses the next connection.
        self._last_sent: deque[Request] = deque(maxlen=3)

    def send(self, request: Request) -> Observation:
        self._last_sent.append(request)
        return self.wire.send(request)

    # ---- references ------------------------------------------------------------------

    def reference(self, request: Request) -> Observation:
        """`request` alone on a flushed cache: what a fresh server answers."""
        if request not in self._references:
            self.flush()
            self._references[request] = self.send(request)
        return self._references[request]

    def judge(self, victim: Request, observed: Observation) -> tuple[Difference, Observation]:
        """`observed` against the reference of the request as served (`auto`: its resolved policy)."""
        served = victim
        if victim.policy == AUTO and observed.resolved_policy:
            served = victim.with_policy(observed.resolved_policy)
        reference = self.reference(served)
        return compare(reference, observed, self.config.tolerance), reference

    def play(self, requests: Iterable[Request]) -> list[Observation]:
        self.flush()
        return [self.send(request) for request in requests]

    # ---- the run ---------------------------------------------------------------------

    def run(self, episodes: list[list[Request]], report: Optional[Report] = None) -> Report:
        report = report or Report(self.config.seed, self.config.tolerance, max_reported=self.config.max_reported)
        started = time.perf_counter()
        budget = self.config.time_budget_s

        def over_budget() -> bool:
            return budget is not None and time.perf_counter() - started > budget

        try:
            self._run(episodes, report, over_budget)
        except httpx.HTTPError as exc:
            report.stopped = {"error": f"{type(exc).__name__}: {exc}", "episode": report.episodes - 1,
                              "last_requests": [r.describe() for r in self._last_sent]}
        report.references = len(self._references)
        report.wall_s += time.perf_counter() - started
        return report

    def _run(self, episodes: list[list[Request]], report: Report, over_budget: Callable[[], bool]) -> None:
        shrunk: Counter = Counter()
        for number, episode in enumerate(episodes):
            if over_budget():
                break
            if number and number % 50 == 0:
                logger.info("%d episodes, %d requests, %d violation(s)", number, report.requests,
                            sum(report.violation_counts.values()))
            report.episodes += 1
            observations = self.play(episode)
            for index, (request, observed) in enumerate(zip(episode, observations)):
                report.count(request)
                if not request.victim:
                    continue
                report.victims += 1
                difference, reference = self.judge(request, observed)
                report.counts["served"][observed.resolved_policy or f"status {observed.status}"] += 1
                shared = any(seen.reused_tokens > ref.reused_tokens
                             for ref, seen in zip(reference.answers, observed.answers))
                report.deviations.add(difference, fresh=index == 0, shared=shared)
                if difference.kind:
                    violation = Violation("transparency", request, difference, list(episode[:index]),
                                          reference_reuse=_reuse(reference), observed_reuse=_reuse(observed),
                                          episode=number)
                    if shrunk[violation.signature] < self.config.shrink_per_signature and not over_budget():
                        shrunk[violation.signature] += 1
                        violation.minimal = self.shrink(violation.preceding, request)
                    report.record(violation)
            if self.config.cross_checks:
                for request in episode:
                    for violation in self.cross_check(request):
                        violation.episode = number
                        report.record(violation)

    # ---- cross checks on references --------------------------------------------------

    def cross_check(self, request: Request) -> list[Violation]:
        if request in self._cross_checked or not request.victim or request.route not in (GENERATE, ENGINE):
            return []
        self._cross_checked.add(request)
        found = []
        if request.batch:
            found += self._form_check(request)
        elif (request.route == GENERATE and self.wire.engine is not None and request.policy != VANILLA
              and not request.client_layout and not _selects(request.policy)):
            twin = dataclasses.replace(request, route=ENGINE)
            # The runtime may refuse a hint only picrag's frontend may send; the frontend must then
            # still answer, so only two answers are compared.
            difference = compare(self.reference(twin), self.reference(request), self.config.tolerance)
            if self.reference(twin).ok and difference.kind:
                found.append(Violation("route", request, difference, [twin],
                                       reference_reuse=_reuse(self.reference(twin)),
                                       observed_reuse=_reuse(self.reference(request))))
        return found

    def _form_check(self, batch: Request) -> list[Violation]:
        whole = self.reference(batch)
        found = []
        for index, single in enumerate(batch.singles()):
            alone = self.reference(single)
            if not whole.ok:
                continue  # a batch form may be refused as a whole
            if not alone.ok:
                difference = Difference("status", 0.0, f"the single form answers {alone.status} "
                                        f"({alone.error[:150]}); the batch form serves it")
            else:
                mine = Observation(200, (whole.answers[index],))
                difference = compare(alone, mine, self.config.tolerance)
            if difference.kind:
                found.append(Violation("form", batch, difference, [single], reference_reuse=_reuse(alone),
                                       observed_reuse=_reuse(whole)))
        return found

    # ---- shrinking -------------------------------------------------------------------

    def _moves(self, attackers: list[Request], victim: Request) -> bool:
        observed = self.play([*attackers, victim])[-1]
        return bool(self.judge(victim, observed)[0].kind)

    def shrink(self, preceding: list[Request], victim: Request) -> Optional[list[Request]]:
        """A minimal list of the requests in `preceding` after which `victim` still differs from
        its reference ([]: it differs alone; None: no replay reproduced it within the budget)."""
        trials = SHRINK_TRIALS
        if self._moves([], victim):
            return []
        trials -= 1
        # Most violations have one cause: try each attacker alone, the nearest first.
        for attacker in reversed(preceding):
            if trials == 0:
                return None
            trials -= 1
            if self._moves([attacker], victim):
                return [attacker]
        if trials == 0 or not self._moves(preceding, victim):
            return None
        kept = list(preceding)
        for index in reversed(range(len(kept))):
            if trials == 0:
                break
            trials -= 1
            candidate = kept[:index] + kept[index + 1:]
            if self._moves(candidate, victim):
                kept = candidate
        return kept


def _reuse(observation: Observation) -> dict[str, Any]:
    return {"status": observation.status, "answers": [a.reuse for a in observation.answers]}


def fuzz(wire: Wire, flush: Callable[[], None], config: FuzzConfig) -> Report:
    """One seeded run of `config.requests` requests (its shard of them)."""
    generator = Generator(wire.words, config.seed, dataclasses.replace(config.generator, bos=wire.bos))
    index, count = config.shard
    return Fuzzer(wire, flush, config).run(generator.episodes(config.requests)[index::count])


def _selects(policy: str) -> bool:
    return policy != AUTO and parse_policy(policy).family.scored_as is not None
