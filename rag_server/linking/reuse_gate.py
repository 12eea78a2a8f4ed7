"""Whether a server links prompts with chunk-reusing policies, after its start-up self-check.

`picrag serve` checks, once its runtime is up, that chunk reuse gives what computing the prompt
gives (rag_server/launch/selfcheck.py). When a check fails, every policy family that reuses
chunks (the `reuses_chunks` flag in picrag_core.policies) is turned away as
`--on-selfcheck-failure` says: served as `prefix` (the default: SGLang's exact prefix cache, so
answers stay right and shared prefixes are still reused), served as `full`, or refused (HTTP 400
with the reason); the policy resolver applies it (rag_server/linking/policy_resolver.py). The
gate holds the report, so /health shows what was checked and what failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"

REFUSE = "refuse"
FAILURE_ACTIONS = ("prefix", "full", REFUSE)
DEFAULT_FAILURE_ACTION = "prefix"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASSED, FAILED or SKIPPED
    detail: str  # what was compared, or why it failed or was skipped

    def as_json(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail}


@dataclass(frozen=True)
class SelfCheckReport:
    checks: tuple[Check, ...]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(check.status != FAILED for check in self.checks)

    def failures(self) -> str:
        return "; ".join(f"{check.name}: {check.detail}" for check in self.checks if check.status == FAILED)


@dataclass(frozen=True)
class ReuseGate:
    report: Optional[SelfCheckReport] = None  # None: no self-check ran (`picrag serve --no-selfcheck`)
    on_failure: str = DEFAULT_FAILURE_ACTION  # one of FAILURE_ACTIONS

    def __post_init__(self):
        if self.on_failure not in FAILURE_ACTIONS:
            raise ValueError(f"on_failure must be one of {FAILURE_ACTIONS}, not {self.on_failure!r}")

    @property
    def refusal(self) -> Optional[str]:
        """Why chunk-reusing policies are not served as asked; None when they are."""
        if self.report is None or self.report.passed:
            return None
        return f"the start-up self-check failed ({self.report.failures()})"

    def as_json(self) -> dict[str, Any]:
        if self.report is None:
            return {"status": "not run", "reuse": "as asked, unchecked"}
        if self.refusal is None:
            reuse = "as asked"
        else:
            reuse = "refused" if self.on_failure == REFUSE else f"served as {self.on_failure}"
        return {"status": PASSED if self.report.passed else FAILED, "reuse": reuse,
                "seconds": round(self.report.seconds, 2), "checks": [c.as_json() for c in self.report.checks]}
