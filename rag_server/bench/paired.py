"""Paired comparisons of two policies on the same questions, and one policy's figures, each with a
bootstrap 95% interval (questions resampled with replacement, a fixed seed, so a stored run
reproduces its intervals): the mean per-question difference, the ratio of two means (a policy's
F1 as a share of full's, full's TTFT over a policy's), and a plain mean (agreement)."""

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
    means = differences[_resampled(len(shared))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return PairedDifference(len(shared), float(differences.mean()), float(low), float(high))


@dataclass(frozen=True)
class Estimate:
    questions: int
    value: float
    low: float  # the bootstrap 95% interval
    high: float

    def as_json(self) -> dict[str, float | int | list[float]]:
        return {"questions": self.questions, "value": self.value, "ci95": [self.low, self.high]}


def _resampled(count: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, count, size=(RESAMPLES, count))


def ratio_of_means(numerator: Mapping[str, float], denominator: Mapping[str, float]) -> Estimate | None:
    """mean(numerator) / mean(denominator) over the questions both measured, paired (the same
    questions drawn for both); None where they share none or the denominator's mean is 0."""
    shared = sorted(set(numerator) & set(denominator))
    top = np.array([numerator[q] for q in shared], dtype=np.float64)
    bottom = np.array([denominator[q] for q in shared], dtype=np.float64)
    if not shared or bottom.mean() == 0:
        return None
    draws = _resampled(len(shared))
    tops, bottoms = top[draws].mean(axis=1), bottom[draws].mean(axis=1)
    ratios = np.divide(tops, bottoms, out=np.full_like(tops, np.nan), where=bottoms != 0)
    low, high = np.nanpercentile(ratios, [2.5, 97.5])
    return Estimate(len(shared), float(top.mean() / bottom.mean()), float(low), float(high))


def mean_of(values: Mapping[str, float]) -> Estimate | None:
    """The mean over questions, with its interval; None for no question."""
    if not values:
        return None
    array_ = np.array(list(values.values()), dtype=np.float64)
    means = array_[_resampled(len(array_))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return Estimate(len(array_), float(array_.mean()), float(low), float(high))


def by_question(rows: Sequence[object], value: str, scale: float = 1.0) -> dict[str, float]:
    """Question id -> `value` of each row (a QuestionResult's field) times `scale`, where measured."""
    return {row.id: scale * float(getattr(row, value)) for row in rows if getattr(row, value) is not None}
