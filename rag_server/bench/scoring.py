"""QA scoring as the papers picrag compares with compute it.

SQuAD normalisation (lower-case, no punctuation, no articles, single spaces), exact match and
token F1, each the maximum over the gold aliases, computed on the first line of the answer
only: small models keep talking after the answer, and that tail must not dilute F1.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def first_line(answer: str) -> str:
    """The first non-empty line: models often open with a newline before answering."""
    for line in answer.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    predicted = normalize_answer(prediction).split()
    expected = normalize_answer(gold).split()
    if not predicted or not expected:
        # SQuAD's rule: two empty answers agree, one empty answer scores zero.
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision = common / len(predicted)
    recall = common / len(expected)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True)
class Score:
    em: float
    f1: float


def score_answer(answer: str, golds: Sequence[str]) -> Score:
    """EM and F1 of an answer's first line, each maximised over the gold aliases."""
    if not golds:
        raise ValueError("no gold answers to score against")
    prediction = first_line(answer)
    return Score(
        em=max(exact_match(prediction, gold) for gold in golds),
        f1=max(token_f1(prediction, gold) for gold in golds),
    )


def mean_scores(scores: Iterable[Score]) -> Score:
    scores = list(scores)
    if not scores:
        raise ValueError("no scores to average")
    return Score(em=sum(s.em for s in scores) / len(scores), f1=sum(s.f1 for s in scores) / len(scores))
