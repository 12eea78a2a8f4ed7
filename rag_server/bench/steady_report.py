"""`picrag bench steady`'s report: every request accounted for, and the run minute by minute.

Per system and minute (by scheduled arrival): requests answered and failed, answered per second
(by completion time), TTFT p50/p99, the share of prompt tokens served from cache, and, from the
engine's and frontend's counters sampled at each minute's end: chunks the links found stored
(`chunk_hits`, in the pool or reloaded into it), of those reloads from the host tier and from the
chunk store, chunk compiles that computed their piece, host-tier evictions and relinks. Then picrag's answered per second over each other
system's, minute by minute, and a plot of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rag_server.bench.common import fmt, render_table
from rag_server.bench.steady_client import PICRAG, Outcome
from rag_server.service.percentile import percentile

# Counter deltas reported per minute: the report's name -> the counters summed.
TIERS = {
    "chunk_hits": ("chunk_hits",),
    "host_reloads": ("host_loads",),
    "store_reloads": ("store_loads",),
    "compiled": ("compile_chunk_misses",),
    "host_evictions": ("host_evictions",),
    "relinks": ("frontend_relinks",),
}


@dataclass(frozen=True)
class Sample:
    """The counters at `at_s` from the run's start (engine's and frontend's, merged)."""

    at_s: float
    counters: dict[str, float]


def _delta(samples: Sequence[Sample], start_s: float, end_s: float, names: Sequence[str]) -> Optional[float]:
    """Counter growth between the last samples at or before `start_s` and `end_s`; None where
    unknown. The samples sum every engine's counters, and a counter only grows while its engine
    lives: a sum that fell lost an engine (killed, or restarted from zero), and that minute's
    growth cannot be told from the sums."""
    before = [s for s in samples if s.at_s <= start_s + 1e-6]
    after = [s for s in samples if s.at_s <= end_s + 1e-6]
    if not before or not after:
        return None
    grown = [after[-1].counters.get(n, 0.0) - before[-1].counters.get(n, 0.0) for n in names]
    return None if any(g < 0 for g in grown) else sum(grown)


def minute_rows(outcomes: Sequence[Outcome], samples: Sequence[Sample], minutes: int,
                bucket_s: float = 60.0) -> list[dict[str, Any]]:
    rows = []
    for minute in range(minutes):
        start, end = minute * bucket_s, (minute + 1) * bucket_s
        arrived = [o for o in outcomes if start <= o.at_s < end]
        answered = [o for o in arrived if o.answered]
        unsent = sum(not o.sent for o in arrived)
        finished = [o for o in outcomes if o.answered and o.done_s is not None and start <= o.done_s < end]
        ttfts = [o.ttft_s for o in answered]
        prompt = sum(o.prompt_tokens for o in answered)
        row = {
            "minute": minute + 1,
            "arrived": len(arrived),
            "answered": len(answered),
            "failed": len(arrived) - len(answered) - unsent,
            "unsent": unsent,
            "answered_per_s": len(finished) / bucket_s,
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
            "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
            "reused_share": sum(o.reused_tokens for o in answered) / prompt if prompt else None,
        }
        for name, counters in TIERS.items():
            row[name] = _delta(samples, start, end, counters)
        rows.append(row)
    return rows


def speedups(per_system: dict[str, list[dict[str, Any]]], over: str) -> list[Optional[float]]:
    """picrag's answered per second over `over`'s, minute by minute (None where `over` answered none):
    the throughput ratio, which shows where the arrivals outrun `over`."""
    ours, theirs = per_system.get(PICRAG, []), per_system.get(over, [])
    return [a["answered_per_s"] / b["answered_per_s"] if b["answered_per_s"] else None
            for a, b in zip(ours, theirs)]


def ttft_speedups(per_system: dict[str, list[dict[str, Any]]], over: str) -> list[Optional[float]]:
    """`over`'s TTFT p50 over picrag's, minute by minute: the ratio that shows where both keep up."""
    ours, theirs = per_system.get(PICRAG, []), per_system.get(over, [])
    return [b["ttft_p50_s"] / a["ttft_p50_s"] if a["ttft_p50_s"] and b["ttft_p50_s"] else None
            for a, b in zip(ours, theirs)]


def accounting(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Every request: answered, refused with a status (by status and reason), lost (sent, and no
    status came back), or never sent (the backlog at the run's end)."""
    refused: dict[str, int] = {}
    for outcome in outcomes:
        if not outcome.answered and outcome.status:
            key = f"{outcome.status}: {outcome.error[:80]}"
            refused[key] = refused.get(key, 0) + 1
    return {
        "requests": len(outcomes),
        "answered": sum(o.answered for o in outcomes),
        "refused": refused,
        "lost": sum(o.sent and not o.answered and not o.status for o in outcomes),
        "unsent": sum(not o.sent for o in outcomes),
    }


COLUMNS = ("system", "minute", "arrived", "answered", "failed", "unsent", "answered/s", "TTFT p50 s", "TTFT p99 s",
           "reused share", "chunk hits", "host reloads", "store reloads", "compiled", "host evictions", "relinks")


def _ratio_rows(title: str, ratios: dict[str, list[Optional[float]]]) -> list[str]:
    minutes = len(next(iter(ratios.values())))
    lines = ["", title, "", "| over | " + " | ".join(f"min {m + 1}" for m in range(minutes)) + " |",
             "|---|" + "---|" * minutes]
    for system, values in ratios.items():
        lines.append(f"| {system} | " + " | ".join(f"{fmt(v, 2)}x" if v is not None else "n/a" for v in values) + " |")
    return lines


def markdown(per_system: dict[str, list[dict[str, Any]]], ratios: dict[str, list[Optional[float]]],
             ttft_ratios: dict[str, list[Optional[float]]]) -> str:
    rows = []
    for system, minutes in per_system.items():
        for row in minutes:
            rows.append((system, str(row["minute"]), str(row["arrived"]), str(row["answered"]), str(row["failed"]),
                         str(row["unsent"]),
                         fmt(row["answered_per_s"], 3), fmt(row["ttft_p50_s"]), fmt(row["ttft_p99_s"]),
                         fmt(row["reused_share"]), *(fmt(row[name], 0) for name in TIERS)))
    table = render_table(COLUMNS, rows, [])
    if not ratios:
        return table
    lines = (_ratio_rows("picrag's answered/s over each system's, minute by minute:", ratios)
             + _ratio_rows("Each system's TTFT p50 over picrag's, minute by minute:", ttft_ratios))
    return table + "\n".join(lines) + "\n"


def plot(per_system: dict[str, list[dict[str, Any]]], ratios: dict[str, list[Optional[float]]],
         ttft_ratios: dict[str, list[Optional[float]]], path: Path, title: str) -> None:
    """Answered per second and TTFT p50 per system, and picrag's speed-ups, over the run (needs
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, (rates, ttfts, ups) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for system, minutes in per_system.items():
        rates.plot([m["minute"] for m in minutes], [m["answered_per_s"] for m in minutes], marker="o", label=system)
        points = [(m["minute"], m["ttft_p50_s"]) for m in minutes if m["ttft_p50_s"] is not None]
        if points:
            ttfts.plot(*zip(*points), marker="o", label=system)
    rates.set_ylabel("answered / s")
    rates.legend()
    rates.set_title(title)
    ttfts.set_ylabel("TTFT p50 (s)")
    ttfts.legend()
    for label, series in (("answered/s", ratios), ("TTFT p50", ttft_ratios)):
        for system, values in series.items():
            points = [(m + 1, v) for m, v in enumerate(values) if v is not None]
            if points:
                ups.plot(*zip(*points), marker="o", label=f"{label}, over {system}")
    ups.axhline(1.0, color="grey", linewidth=0.5)
    ups.set_ylabel("picrag's speed-up")
    ups.set_xlabel("minute")
    ups.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
