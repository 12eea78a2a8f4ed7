"""`picrag bench steady`: its schedule, its per-minute report, and a short run against a server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rag_server.bench.steady_client import PICRAG, PREFIX, VANILLA, Outcome
from rag_server.bench.steady_report import Sample, accounting, minute_rows, speedups, ttft_speedups
from rag_server.bench.steady_schedule import (ScheduleSettings, build_schedule, expected_repeat_share,
                                              repeat_share, zipf_weights)
from retrieval.prompt_layout import PromptPassage
from retrieval.qa_rows import QARow


def rows(count: int, passages: int = 5) -> list[QARow]:
    return [QARow(f"q{i}", f"question {i}?", ("a",),
                  tuple(PromptPassage(f"t{i}.{j}", f"passage {i}.{j}") for j in range(passages))) for i in range(count)]


SETTINGS = ScheduleSettings(minutes=30, rate=1.0, zipf=1.1, novel=0.2, pool=50, passages=3, seed=3)


def test_the_schedule_is_seeded_poisson_zipf_and_novel_once():
    schedule = build_schedule(rows(600), SETTINGS)
    assert schedule == build_schedule(rows(600), SETTINGS)  # every system gets the very same requests
    gaps = [b.at_s - a.at_s for a, b in zip(schedule, schedule[1:])]
    assert abs(len(schedule) - 1800) < 150 and abs(sum(gaps) / len(gaps) - 1.0) < 0.1
    novel = [r for r in schedule if r.novel]
    assert abs(len(novel) / len(schedule) - 0.2) < 0.04
    assert len({r.topic for r in novel}) == len(novel)  # a novel question is asked once
    popular = [r.topic for r in schedule if not r.novel]
    counts = sorted((popular.count(t) for t in set(popular)), reverse=True)
    assert counts[0] > 5 * counts[len(counts) // 2]  # a few topics come back often, most rarely
    assert {r.route for r in schedule} == {"rag", "chat", "generate"}
    assert all(len(r.passages) == 3 for r in schedule)
    # The same topic comes back with its passages in another order (the prefix cache's loss).
    first = {}
    moved = 0
    for r in schedule:
        moved += r.topic in first and first[r.topic] != r.passages
        first.setdefault(r.topic, r.passages)
    assert moved > 0


def test_the_expected_repeat_share_follows_the_zipf_law():
    assert zipf_weights(3, 0.0) == pytest.approx([1 / 3] * 3)
    schedule = build_schedule(rows(2000), SETTINGS)
    expected = expected_repeat_share(SETTINGS, len(schedule))
    assert abs(repeat_share(schedule) - expected) < 0.03 and 0.7 < expected < 0.8
    assert expected_repeat_share(ScheduleSettings(1, 1, 1.1, 1.0, 50, 3), 100) == 0.0  # all novel


def _outcome(system: str, index: int, at: float, ttft: float | None, status: int = 200, reused: int = 50,
             error: str = "") -> Outcome:
    return Outcome(index, system, "rag", "naive", at, status, at, ttft, at + (ttft or 0) + 1, 100, reused, error)


def test_minutes_account_for_every_request_and_divide_systems():
    ours = [_outcome(PICRAG, i, 10.0 * i, 1.0) for i in range(12)]  # 6 a minute, all answered
    theirs = [_outcome(VANILLA, i, 10.0 * i, 5.0 if i % 2 else None, status=200 if i % 2 else 0,
                       error="" if i % 2 else "ReadTimeout") for i in range(12)]
    theirs[2] = _outcome(VANILLA, 2, 20.0, None, status=400, error="bad")
    samples = [Sample(0, {"chunk_hits": 0}), Sample(60, {"chunk_hits": 4}), Sample(120, {"chunk_hits": 10})]
    per_system = {PICRAG: minute_rows(ours, samples, 2), VANILLA: minute_rows(theirs, [], 2)}
    first = per_system[PICRAG][0]
    assert (first["arrived"], first["answered"], first["failed"]) == (6, 6, 0)
    assert first["reused_share"] == 0.5 and first["chunk_hits"] == 4 and per_system[PICRAG][1]["chunk_hits"] == 6
    assert per_system[VANILLA][0]["answered"] == 3 and per_system[VANILLA][0]["chunk_hits"] is None
    assert speedups(per_system, VANILLA)[0] == pytest.approx(first["answered_per_s"] / per_system[VANILLA][0]["answered_per_s"])
    assert ttft_speedups(per_system, VANILLA) == [pytest.approx(5.0), pytest.approx(5.0)]  # 5 s against 1 s
    counted = accounting(theirs)
    assert counted["requests"] == 12 and counted["answered"] == 6 and counted["lost"] == 5
    assert counted["refused"] == {"400: bad": 1}


def test_a_minute_whose_counter_sums_fell_reports_no_growth():
    """An engine killed mid-run takes its counters out of the merged sums: that minute's growth is
    unknown (a soak reported -690 chunk hits in the minute it killed an engine), not negative."""
    ours = [_outcome(PICRAG, i, 30.0 * i, 1.0) for i in range(6)]
    samples = [Sample(0, {"chunk_hits": 0, "host_loads": 0}), Sample(60, {"chunk_hits": 700, "host_loads": 80}),
               Sample(120, {"chunk_hits": 10, "host_loads": 85}), Sample(180, {"chunk_hits": 40, "host_loads": 90})]
    rows = minute_rows(ours, samples, 3)
    assert [r["chunk_hits"] for r in rows] == [700, None, 30]
    assert [r["host_reloads"] for r in rows] == [80, 5, 5]


@pytest.mark.server
def test_a_short_steady_run_answers_every_request_on_each_system(picrag_server, shared_qa: Path, tmp_path: Path):
    from rag_server.bench.steady import SteadyOptions, run_steady

    options = SteadyOptions(
        datasets=(shared_qa / "hotpotqa.dev.jsonl",), out=tmp_path / "steady",
        schedule=ScheduleSettings(minutes=0.5, rate=0.4, zipf=1.1, novel=0.2, pool=4, passages=2, seed=1),
        # More clients than requests: none is left unsent at the end, however slow the machine.
        systems=(PICRAG, PREFIX), clients=32, max_tokens=2, bucket_s=15.0, url=picrag_server.url)
    report = run_steady(options, progress=False)
    for system in (PICRAG, PREFIX):
        counted = report["accounting"][system]
        assert options.clients >= counted["requests"] == report["settings"]["requests"] > 3
        assert counted["answered"] == counted["requests"] and counted["lost"] == 0, counted
        assert [m["minute"] for m in report["minutes"][system]] == [1, 2]
    picrag_requests = report["requests"][PICRAG]
    assert {r["route"] for r in picrag_requests} >= {"rag", "generate"}
    # A topic asked again reuses its passages under picrag's policies, never under prefix-only's
    # (its passages moved): reuse beyond the system prompt.
    reused = {system: sum(r["reused_tokens"] for r in report["requests"][system]) for system in (PICRAG, PREFIX)}
    assert reused[PICRAG] > reused[PREFIX]
    assert len(report["speedup_over"][PREFIX]) == len(report["ttft_speedup_over"][PREFIX]) == 2
    assert json.loads((tmp_path / "steady" / "steady.json").read_text())["settings"]["rate"] == 0.4
    assert "picrag's answered/s over each system's" in (tmp_path / "steady" / "steady.md").read_text()
