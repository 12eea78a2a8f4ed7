"""Paired comparisons of two policies on the same questions: the mean per-question difference and
its bootstrap 95% interval (questions resampled with replacement, a fixed seed, so a stored run
reproduces its intervals)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
SEED = 0


@dataclass(frozen=True)
class PairedDifference:
    questions: int
    mean: float  # of policy minus baseline, per question
    low: float  # the bootstrap 95% interval of the mean
    high: float

    def as_json(self) -> dict[str, float | int | list[float]]:
        return {"questions": self.questions, "mean": self.mean, "ci95": [self.low, self.high]}


def paired_difference(policy: Mapping[str, float], baseline: Mapping[str, float]) -> PairedDifference | None:
    """`policy` minus `baseline` over the questions both measured (question id -> value); None
    where they share no question."""
    shared = sorted(set(policy) & set(baseline))
    if not shared:
        return None
    differences = np.array([policy[q] - baseline[q] for q in shared], dtype=np.float64)
    rng = np.random.default_rng(SEED)
    means = differences[rng.integers(0, len(shared), size=(RESAMPLES, len(shared)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return PairedDifference(len(shared), float(differences.mean()), float(low), float(high))


def by_question(rows: Sequence[object], value: str, scale: float = 1.0) -> dict[str, float]:
    """Question id -> `value` of each row (a QuestionResult's field) times `scale`, where measured."""
    return {row.id: scale * float(getattr(row, value)) for row in rows if getattr(row, value) is not None}
