"""`picrag bench quality` / `picrag bench load` end to end on the shared server (tiny runs), plus
the pieces that need no server: policy parsing, split-GGUF assembly."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from rag_server.bench.common import (BenchError, parse_policies, read_rows, with_first_sentences,
                                     with_unrelated_distractors)
from rag_server.bench.load import LoadOptions, run_load
from rag_server.bench.quality import QualityOptions, run_quality
from picrag_core.model_store import PRESETS, ModelStoreError


def test_unknown_policies_are_reported_not_dropped():
    choices = {c.name: c for c in parse_policies("full,naive,cacheblend:0.15,cacherepair,bogus,naive")}
    assert list(choices) == ["full", "naive", "cacheblend:0.15", "cacherepair", "bogus"]
    assert all(choices[name].available for name in ("full", "naive", "cacheblend:0.15", "cacherepair"))
    assert "unknown policy 'bogus'" in choices["bogus"].reason
    assert "0 <= R <= 1" in parse_policies("cacheblend:2")[0].reason
    assert "whole number" in parse_policies("legolink:x")[0].reason


def test_unrelated_distractors_keep_the_supporting_passages_in_place(shared_qa: Path):
    rows = read_rows(shared_qa / "hotpotqa.dev.jsonl", 6, None)
    mixed = with_unrelated_distractors(rows)
    assert with_unrelated_distractors(rows) == mixed  # seeded
    for index, (row, new) in enumerate(zip(rows, mixed)):
        assert new.question == row.question and len(new.passages) == len(row.passages) and any(row.supporting)
        others = {p for j, other in enumerate(rows) if j != index for p in other.passages}
        for old, passage, supporting in zip(row.passages, new.passages, row.supporting):
            assert passage == old if supporting else passage in others


def test_cut_passages_keep_their_first_sentences_and_nothing_else():
    from retrieval.prompt_layout import PromptPassage
    from retrieval.qa_rows import QARow

    row = QARow("q1", "Where is Big Ben?", ("London",), (
        PromptPassage("Big Ben", "Big Ben is a bell in London. It weighs 13.7 tonnes! Is it \"Great\"? Yes."),
        PromptPassage("St. Paul", "Born 1900 in St. Paul, Minnesota. Died 1980."),
        PromptPassage("One", "One sentence with no end")), (True, False, False))
    one, two = with_first_sentences([row], 1)[0], with_first_sentences([row], 2)[0]
    assert [p.text for p in one.passages] == ["Big Ben is a bell in London.", "Born 1900 in St.",
                                              "One sentence with no end"]
    assert two.passages[0].text == "Big Ben is a bell in London. It weighs 13.7 tonnes!"
    assert [p.title for p in one.passages] == [p.title for p in row.passages]
    assert (one.id, one.question, one.answers, one.supporting) == (row.id, row.question, row.answers, row.supporting)


def test_a_run_on_other_prompts_is_named_apart():
    from rag_server.bench.quality import prompts_of

    dataset = "../shared/data/qa/hotpotqa.dev.jsonl"
    assert prompts_of({"dataset": dataset, "settings": {"distractors": "dataset"}}) == "hotpotqa.dev.jsonl"
    assert prompts_of({"dataset": dataset, "settings": {"distractors": "unrelated", "passage_sentences": 1}}) == (
        "hotpotqa.dev.jsonl, unrelated distractors, passages cut to their first 1 sentence")
    assert prompts_of({"dataset": dataset, "settings": {"distractors": "dataset", "passage_sentences": 2}}) == (
        "hotpotqa.dev.jsonl, passages cut to their first 2 sentences")


def test_passage_bos_layout_starts_every_chunk_with_bos_and_changes_nothing_else(tokenizer, shared_qa: Path):
    from retrieval.prompt_layout import PromptLayout, PromptLayoutError

    row = read_rows(shared_qa / "hotpotqa.dev.jsonl", 1, 3)[0]
    plain = PromptLayout(tokenizer).build(row.question, row.passages)
    bos = PromptLayout(tokenizer, passage_bos=True).build(row.question, row.passages)
    assert [bos.input_ids[start] for start, _ in bos.chunks] == [tokenizer.bos_token_id] * 3
    # Take the BOS tokens out again and the standard layout's prompt and chunks come back.
    assert [t for i, t in enumerate(bos.input_ids) if i not in {s for s, _ in bos.chunks}] == plain.input_ids
    assert [(s - i, e - i - 1) for i, (s, e) in enumerate(bos.chunks)] == plain.chunks

    class NoBos:
        bos_token_id = None

        def apply_chat_template(self, messages, **kwargs):
            return "".join(m["content"] for m in messages)

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    with pytest.raises(PromptLayoutError, match="no BOS token"):
        PromptLayout(NoBos(), passage_bos=True)


def test_paired_differences_and_their_interval():
    from rag_server.bench.paired import paired_difference

    baseline = {f"q{i}": 1.0 for i in range(10)}
    better = {f"q{i}": 1.0 - 0.1 * (i % 3) for i in range(10)} | {"other": 5.0}  # only shared questions count
    difference = paired_difference(better, baseline)
    assert difference.questions == 10 and difference.mean == pytest.approx(-0.09)
    assert difference.low < difference.mean < difference.high < 0 and difference.low >= -0.2
    assert paired_difference(better, baseline) == difference  # seeded: a stored run reproduces its intervals
    same = paired_difference(baseline, baseline)
    assert (same.mean, same.low, same.high) == (0, 0, 0)
    assert paired_difference({"a": 1.0}, {"b": 1.0}) is None


def test_a_quality_run_resumes_only_with_its_own_settings(tmp_path: Path):
    from rag_server.bench.quality import QuestionResult, RunProgress

    def row(question: str, policy: str) -> QuestionResult:
        return QuestionResult(question, policy, "x", 0.0, 0.5, True, 0.1, 0.2, 10, 5, 5, 1, 0, 0.2, 3)

    path = tmp_path / "progress.jsonl"
    run = RunProgress.open(path, {"max_tokens": 4})
    run.finish("q1", [row("q1", "full"), row("q1", "naive"), row("q1", "select")])
    run.fail("select", "failed on question q2: boom")
    run.finish("q2", [row("q2", "full"), row("q2", "naive")])
    again = RunProgress.open(path, {"max_tokens": 4})
    assert again.done == {"q1", "q2"} and again.failed == {"select": "failed on question q2: boom"}
    assert again.results == [row("q1", "full"), row("q1", "naive"), row("q2", "full"), row("q2", "naive")]
    with pytest.raises(BenchError, match="other settings"):
        RunProgress.open(path, {"max_tokens": 5})


def test_split_gguf_is_assembled_in_order_and_hash_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("PICRAG_HOME", str(tmp_path / "home"))
    parts = {f"pkg{i}": tmp_path / f"part0{i}.bin" for i in (1, 2, 3)}
    for i, path in enumerate(parts.values()):
        path.write_bytes(bytes([i]) * 1000)
    whole = b"".join(p.read_bytes() for p in parts.values())
    preset = replace(PRESETS["qwen2.5-coder-0.5b"], part_packages=tuple(parts),
                     sha256=hashlib.sha256(whole).hexdigest())
    monkeypatch.setattr(type(preset), "_part_file", lambda self, package: parts[package])
    assert preset.gguf_path().read_bytes() == whole

    monkeypatch.setenv("PICRAG_HOME", str(tmp_path / "other"))
    with pytest.raises(ModelStoreError, match="SHA-256"):
        replace(preset, sha256="0" * 64).gguf_path()
    assert not list((tmp_path / "other" / "models").iterdir())  # nothing half-checked left behind


def test_bench_quality_smoke(picrag_server, shared_qa: Path, tmp_path: Path):
    out = tmp_path / "quality"
    options = QualityOptions(
        dataset=shared_qa / "hotpotqa.dev.jsonl", policies="naive,prefix,nosuchpolicy", out=out, limit=2,
        max_passages=2, max_tokens=4, url=picrag_server.url,
    )
    run_quality(options, progress=False)
    report = json.loads((out / "results.json").read_text())
    assert set(report["policies"]) == {"full", "naive", "prefix"}  # full joins as the reference
    for name, summary in report["policies"].items():
        assert summary["questions"] == 2
        for key in ("f1", "em", "agreement_with_full", "first_token_kl_mean", "ttft_p50_s", "ttft_p90_s",
                    "computed_tokens_mean", "reused_tokens_mean", "chunk_hit_rate", "ttft_speedup_vs_full",
                    "naive_kl_closed", "answer_span_kl_mean", "answer_span_tokens_mean"):
            assert key in summary, (name, key)
    full, naive, prefix = (report["policies"][name] for name in ("full", "naive", "prefix"))
    assert full["agreement_with_full"] == 100 and full["reused_tokens_mean"] == 0
    assert naive["reused_tokens_mean"] > 0 and naive["chunk_hit_rate"] is not None
    # Exact over the whole vocabulary: reuse moves the first token's distribution at least a little.
    assert naive["first_token_kl_questions"] == 2 and naive["first_token_kl_mean"] > 0
    assert full["first_token_kl_mean"] == 0 and full["naive_kl_closed"] == 100 and naive["naive_kl_closed"] == 0
    # The span: full's answer positions (at most max_tokens), the same count for every policy.
    spans = {(r["id"], r["policy"]): r["answer_span_tokens"] for r in report["per_question"]}
    assert all(1 <= n <= 4 for n in spans.values()) and any(n > 1 for n in spans.values())
    assert spans[(report["per_question"][0]["id"], "naive")] == spans[(report["per_question"][0]["id"], "full")]
    assert full["answer_span_kl_mean"] == 0 and naive["answer_span_kl_mean"] > 0
    # prefix is full's prefill from its own radix tree: teacher-forced too, it stays full's to float noise.
    assert prefix["answer_span_kl_mean"] < 1e-3
    paired = prefix["paired_vs_naive"]["answer_span_kl"]
    assert paired["questions"] == 2 and paired["ci95"][0] <= paired["mean"] <= paired["ci95"][1] < 0
    assert "paired_vs_naive" not in naive and "paired_vs_naive" not in full
    assert [u["policy"] for u in report["unavailable"]] == ["nosuchpolicy"]
    assert "unknown policy" in report["unavailable"][0]["reason"]
    table = (out / "results.md").read_text()
    assert "| naive |" in table and "nosuchpolicy | unavailable" in table and "Paired against naive" in table
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resumed with one more question: the two measured are kept as they were, one is added.
    run_quality(replace(options, limit=3), progress=False)
    resumed = json.loads((out / "results.json").read_text())
    assert resumed["questions"] == 3
    assert [r for r in resumed["per_question"] if r["id"] in {q for q, _ in spans}] == report["per_question"]
    with pytest.raises(BenchError, match="other settings"):
        run_quality(replace(options, max_tokens=5), progress=False)


def test_teacher_forcing_predicts_fulls_own_greedy_answer(picrag_server, layout, shared_qa: Path):
    import httpx

    from picrag_core.engine_report import exact_kl
    from rag_server.bench.common import measure, span_logprobs

    row = read_rows(shared_qa / "hotpotqa.dev.jsonl", 1, 2)[0]
    prompt = layout.build(row.question, row.passages)
    with httpx.Client(base_url=picrag_server.url, timeout=600) as client:
        answer = measure(client, prompt, "full", 4, first_token_distribution=True).output_ids
        assert 1 < len(answer) <= 4
        rows = span_logprobs(client, prompt, "full", answer)
        # Through the frontend, a selecting link forced on the answer selects from the question alone.
        selected = span_logprobs(client, prompt, "select:0.15,2", answer)
        unforced = measure(client, prompt, "select:0.15,2", 1, first_token_distribution=True).first_logprobs
    assert [int(r.argmax()) for r in rows] == list(answer)
    assert selected.shape == rows.shape and exact_kl(unforced, selected[0]) < 1e-5


def test_bench_load_smoke(picrag_server, shared_qa: Path, tmp_path: Path):
    out = tmp_path / "load"
    run_load(LoadOptions(
        dataset=shared_qa / "hotpotqa.dev.jsonl", policies="prefix,naive,vanilla,nosuchpolicy", concurrency=(1, 2),
        requests=4, out=out, max_passages=2, max_tokens=4, url=picrag_server.url,
    ), progress=False)
    report = json.loads((out / "load.json").read_text())
    assert report["settings"]["pool"] == 1  # a quarter of the requests: each passage recurs 4 times
    cells = {(c["policy"], c["concurrency"]): c for c in report["cells"]}
    assert set(cells) == {(p, c) for p in ("prefix", "naive", "vanilla") for c in (1, 2)}
    for cell in cells.values():
        assert cell["requests"] == 4 and cell["requests_per_s"] > 0 and cell["output_tokens_per_s"] > 0
        assert cell["ttft_p50_s"] is not None and cell["ttft_p99_s"] >= cell["ttft_p50_s"]
    # The pool holds the working set: no link was refused or sent again.
    assert cells[("naive", 2)]["relinks"] == 0 and cells[("naive", 2)]["link_refusals"] == 0
    # The shared server samples no shadows; the bench reads its rate.
    assert cells[("naive", 2)]["shadow_rate"] == 0 and cells[("naive", 2)]["shadow_pairs"] == 0
    # Stock SGLang: no picrag counters, no relinks.
    vanilla = cells[("vanilla", 1)]
    assert vanilla["store_hit_rate"] is None and vanilla["relinks"] is None
    # One question asked 4 times: naive reuses its passages in any order.
    assert cells[("naive", 1)]["reused_token_fraction"] > 0.5
    assert cells[("prefix", 1)]["link_hit_rate"] is None
    assert [u["policy"] for u in report["unavailable"]] == ["nosuchpolicy"]
    assert "| naive | 2 | 0.00 | 4 |" in (out / "load.md").read_text()


def test_bench_load_warm_up_stores_every_passage_before_the_clock(picrag_server, shared_qa: Path, tmp_path: Path):
    out = tmp_path / "load-warm"
    run_load(LoadOptions(
        dataset=shared_qa / "hotpotqa.dev.jsonl", policies="naive,prefix", concurrency=(2,),
        requests=4, out=out, max_passages=2, max_tokens=4, url=picrag_server.url, warm_up=True,
    ), progress=False)
    report = json.loads((out / "load.json").read_text())
    assert report["settings"]["warm_up"] is True and "off the clock" in report["method"]
    cells = {c["policy"]: c for c in report["cells"]}
    assert cells["naive"]["requests"] == cells["prefix"]["requests"] == 4  # the warm-up is not counted
    # Without the warm-up the first request compiles its passages (a store miss); with it, every
    # compile the timed requests send finds its piece stored, or none is sent at all.
    assert cells["naive"]["store_hit_rate"] in (1.0, None)
    assert cells["naive"]["relinks"] == 0


def test_the_vanilla_baseline_loads_no_sglang_plugin(tmp_path: Path):
    from importlib.metadata import entry_points

    from rag_server.launch.runtime import RuntimeConfig

    env = RuntimeConfig(model_path=tmp_path, plugins=False).env()
    assert env["SGLANG_PLUGINS"] not in {ep.name for ep in entry_points(group="sglang.srt.plugins")}


def test_bench_discovery_smoke(picrag_server, tmp_path: Path):
    from rag_server.bench.discovery import FORMS, DiscoveryOptions, run_discovery

    out = tmp_path / "discovery"
    report = run_discovery(DiscoveryOptions(("identical",), out, requests=2, max_tokens=2, url=picrag_server.url))
    rows = {row["form"]: row for row in report["rows"]}
    assert set(rows) == set(FORMS) and all(row["requests"] == 2 for row in rows.values())
    assert rows["discovered"]["discovered_chunks"] == 4
    assert rows["prefix"]["discovered_chunks"] == rows["annotated"]["discovered_chunks"] == 0
    assert all(0 < row["ttft_p50_s"] <= row["ttft_p95_s"] for row in rows.values())
    assert "| identical | discovered | 2 | 1 |" in (out / "discovery.md").read_text()
