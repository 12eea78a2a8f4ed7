"""The one percentile picrag reports: linear interpolation between closest ranks (numpy's default
method), q in 0..100. The bench tables, `picrag bench load` and the page's TTFT panels all use it,
so a p50 means the same number everywhere."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional


def percentile(values: Iterable[float], q: float) -> Optional[float]:
    """The `q`th percentile (0 <= q <= 100) of `values`; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
