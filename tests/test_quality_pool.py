"""`picrag bench pool`: quality runs of several sets read as one, with intervals."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from rag_server.bench.common import BenchError
from rag_server.bench.paired import mean_of, ratio_of_means
from rag_server.bench.quality import QuestionResult
from rag_server.bench.quality_pool import markdown, pool


def _row(question: str, policy: str, f1: float, span_kl: float, ttft: float, agrees: bool = True) -> QuestionResult:
    return QuestionResult(question, policy, "x", f1, f1, agrees, span_kl / 2, ttft, 100, 0, 100, 0, 0, span_kl, 4)


def _run(folder: Path, dataset: str, rows: list[QuestionResult]) -> Path:
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({
        "dataset": f"../data/{dataset}.dev.jsonl", "command": f"picrag bench quality --dataset {dataset}",
        "per_question": [asdict(r) for r in rows]}))
    return folder


def test_ratio_and_mean_intervals():
    assert ratio_of_means({"a": 2.0, "b": 4.0}, {"a": 1.0, "b": 2.0}).value == pytest.approx(2.0)
    constant = ratio_of_means({"a": 2.0, "b": 4.0}, {"a": 1.0, "b": 2.0})
    assert constant.low == pytest.approx(2.0) and constant.high == pytest.approx(2.0)  # every draw is 2
    assert ratio_of_means({"a": 1.0}, {"a": 0.0}) is None and ratio_of_means({"a": 1.0}, {"b": 1.0}) is None
    spread = mean_of({str(i): float(i % 2) for i in range(40)})
    assert spread.value == 0.5 and 0.3 < spread.low < 0.5 < spread.high < 0.7
    assert mean_of({}) is None


def test_sets_are_kept_apart_and_pooled(tmp_path: Path):
    # Set a: two questions, naive loses; set b: one question, answered by full and naive only
    # for q9 (cacherepair failed it: the question leaves set b's figures).
    a = _run(tmp_path / "a", "hotpotqa", [
        _row("q1", "full", 1.0, 0.0, 4.0), _row("q1", "naive", 0.5, 0.8, 1.0, agrees=False),
        _row("q1", "cacherepair", 1.0, 0.2, 2.0),
        _row("q2", "full", 0.5, 0.0, 4.0), _row("q2", "naive", 0.5, 0.6, 1.0),
        _row("q2", "cacherepair", 0.5, 0.2, 2.0)])
    b = _run(tmp_path / "b", "musique", [
        _row("q1", "full", 1.0, 0.0, 2.0), _row("q1", "naive", 0.0, 1.0, 1.0, agrees=False),
        _row("q1", "cacherepair", 1.0, 0.4, 1.0),
        _row("q9", "full", 1.0, 0.0, 2.0), _row("q9", "naive", 1.0, 1.0, 1.0)])
    report = pool([a, b], "naive")
    assert report["policies"] == ["full", "naive", "cacherepair"]
    pooled, sets = report["pooled"], report["sets"]
    assert sets["hotpotqa"]["full"]["questions"] == 2 and sets["musique"]["full"]["questions"] == 1
    assert pooled["cacherepair"]["questions"] == 3  # q1 of each set is its own question
    assert pooled["naive"]["f1_share_of_full"]["value"] == pytest.approx(1.0 / 2.5)
    assert pooled["cacherepair"]["ttft_speedup_vs_full"]["value"] == pytest.approx(10.0 / 5.0)
    paired = pooled["cacherepair"]["paired_vs_naive"]["answer_span_kl"]
    assert paired["mean"] == pytest.approx((-0.6 - 0.4 - 0.6) / 3) and paired["ci95"][1] < 0
    assert pooled["naive"]["agreement_with_full"]["value"] == pytest.approx(100 / 3)
    assert "paired_vs_naive" not in pooled["naive"] and "paired_vs_naive" not in pooled["full"]
    table = markdown(report)
    assert "### pooled (3 questions)" in table and "### musique (1 questions)" in table
    with pytest.raises(BenchError, match="two runs of one set"):
        pool([a, a], "naive")
    with pytest.raises(BenchError, match="baseline select"):
        pool([a], "select")


def test_two_sides_compare_question_by_question(tmp_path: Path):
    """`picrag bench compare`: B minus A per question, per set and pooled, on the questions both
    sides answered under each policy."""
    from rag_server.bench.quality_compare import compare, markdown as compare_markdown

    shipped = _run(tmp_path / "shipped", "hotpotqa", [
        _row("q1", "full", 1.0, 0.0, 4.0), _row("q1", "cacherepair", 1.0, 0.4, 2.0),
        _row("q2", "full", 0.5, 0.0, 4.0), _row("q2", "cacherepair", 0.5, 0.6, 2.0),
        _row("q3", "full", 0.5, 0.0, 4.0), _row("q3", "cacherepair", 0.5, 0.5, 2.0)])
    retrained = _run(tmp_path / "retrained", "hotpotqa", [
        _row("q1", "full", 1.0, 0.0, 4.0), _row("q1", "cacherepair", 1.0, 0.1, 2.0),
        _row("q2", "full", 0.5, 0.0, 4.0), _row("q2", "cacherepair", 0.0, 0.2, 2.0),
        _row("q4", "full", 0.5, 0.0, 4.0), _row("q4", "cacherepair", 0.5, 0.0, 2.0)])
    other_set = _run(tmp_path / "musique", "musique", [_row("q1", "full", 1.0, 0.0, 2.0)])
    report = compare([shipped, other_set], [retrained])
    assert list(report["sets"]) == ["hotpotqa"] and report["policies"] == ["full", "cacherepair"]
    repair = report["pooled"]["cacherepair"]
    assert repair["questions"] == 2  # q3 and q4 were answered by one side only
    span = repair["answer_span_kl"]
    assert span["a"]["value"] == pytest.approx(0.5) and span["b"]["value"] == pytest.approx(0.15)
    assert span["b_minus_a"]["mean"] == pytest.approx(-0.35) and span["b_minus_a"]["ci95"][1] < 0
    assert repair["f1"]["b_minus_a"]["mean"] == pytest.approx(-25.0)
    assert "| cacherepair | 2 | 0.500 | 0.150 | -0.350" in compare_markdown(report)
    with pytest.raises(BenchError, match="share no dev set"):
        compare([other_set], [retrained])
    with pytest.raises(BenchError, match="two runs of one set"):
        compare([shipped, shipped], [retrained])
