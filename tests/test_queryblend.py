"""Query-aware selection in one pass (`queryblend:R[,K]`, `cacherepair+queryblend`): CacheBlend's
single extend, with chunk tokens ranked after layer 1 by the attention the question pays them.

Limits: R = 1, and K as long as every chunk, recompute every chunk token (full prefill); the
token counts are exactly the first K of every chunk, ceil(R * chunk tokens) besides them and the
question; repairing the dropped rows with a zero residual changes nothing, with the shipped
network it does."""

from __future__ import annotations

import math

import pytest
import torch

from picrag_core.link_hints import LinkHintError, LinkRequest, hints_of, parse_link_request
from picrag_core.policies import parse_policy
from sglang_patches.cacheblend import select_rows
from sglang_patches.context_attention import AttentionReport, accumulate
from tests.chunk_requests import (assert_same_answer, counters, first_token_top, passages_of, picrag_meta,
                                  question_tokens, run)


def test_policy_names_and_wire_format():
    assert parse_policy("queryblend").name == "queryblend:0.15"
    policy = parse_policy("cacherepair+queryblend:0.1,4")
    assert policy.name == "cacherepair+queryblend:0.1,4" and policy.k == 4
    assert policy.family.repairs and policy.family.blends_chunks and policy.family.unrepaired == "queryblend"
    for bad in ("queryblend:2", "queryblend:0.1,x", "cacheblend:0.1,4"):
        with pytest.raises(LinkHintError):
            parse_policy(bad)
    link = LinkRequest.of("queryblend:0.25,3", [(2, 8), (8, 12)])
    assert (link.k, link.ratio) == (3, 0.25)
    assert parse_link_request(hints_of(link)) == link
    with pytest.raises(LinkHintError, match="context_attention is for"):
        LinkRequest(policy="queryblend", chunks=((2, 8),), ratio=0.2, report_attention=True).validate(10)


def test_forced_rows_are_kept_and_the_ratio_counts_every_candidate():
    candidates = torch.tensor([1, 2, 3, 4, 5, 6])
    score = torch.tensor([9.0, 0.1, 5.0, 9.0, 0.2, 3.0])
    # Rows 1 and 4 open their chunks (k = 1): kept whatever their score, and not among the top.
    forced = torch.tensor([True, False, False, True, False, False])
    # ceil(0.33 * 6) = 2 of the four others: rows 3 (5.0) and 6 (3.0).
    assert select_rows(score, candidates, 8, 0.33, forced=forced).tolist() == [0, 1, 3, 4, 6, 7]
    assert select_rows(score, candidates, 8, 0.0, forced=forced).tolist() == [0, 1, 4, 7]
    assert select_rows(score, candidates, 8, 1.0, forced=forced).tolist() == list(range(8))
    assert select_rows(score, candidates, 8, 0.0, forced=torch.ones(6, dtype=torch.bool)).tolist() == list(range(8))


def test_the_question_attention_ranks_what_the_question_looks_at():
    """The sums the ranking reads: the question's rows only, each softmax row adding 1 per head."""
    heads, dim, rows = 2, 4, 6
    key = torch.zeros(rows, 1, dim)
    key[2, 0, 0] = 8.0  # the question's query looks along dim 0: row 2 dominates
    query = torch.zeros(heads, 2, dim)
    query[:, :, 0] = 1.0
    report = AttentionReport(question_start=4)
    accumulate(report, query, key, 1.0, None, torch.tensor([4, 5]))
    assert report.sums.sum().item() == pytest.approx(heads * 2)
    assert int(report.sums[:4].argmax()) == 2


@pytest.mark.server
def test_ratio_one_and_k_covering_every_chunk_equal_full(picrag_server, layout, musique):
    row = musique[54]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2]))
    longest = max(end - start for start, end in prompt.chunks)
    with picrag_server.client() as client:
        full = run(client, prompt, "full", top=True)
        whole_ratio = run(client, prompt, "queryblend:1.0", top=True)
        whole_k = run(client, prompt, f"queryblend:0.0,{longest}", top=True)
    for out in (whole_ratio, whole_k):
        assert picrag_meta(out).computed_tokens == len(prompt.input_ids) - len(layout.head_ids)
        assert_same_answer(out, full)


@pytest.mark.server
def test_it_recomputes_the_first_k_the_ratio_and_the_question(picrag_server, layout, musique):
    row = musique[55]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2, 3]))
    with picrag_server.client() as client:
        blend = run(client, prompt, "queryblend:0.1,4", top=True)
        again = run(client, prompt, "queryblend:0.1,4", top=True)
        deviation = run(client, prompt, "cacheblend:0.1", top=True)
        repaired = run(client, prompt, "cacherepair+queryblend:0.1,4", top=True)
    meta = picrag_meta(blend)
    assert meta.chunk_hits == 4 and meta.chunk_misses == 0
    first_k = sum(min(4, end - start) for start, end in prompt.chunks)
    assert meta.computed_tokens == first_k + math.ceil(0.1 * prompt.chunk_tokens) + question_tokens(prompt)
    assert meta.reused_tokens == len(prompt.input_ids) - meta.computed_tokens
    # Nothing is kept between runs: the same prompt gets the same answer.
    assert again["output_ids"] == blend["output_ids"]
    assert first_token_top(again) == pytest.approx(first_token_top(blend), abs=1e-5)
    # Another ranking keeps other rows.
    assert first_token_top(deviation) != pytest.approx(first_token_top(blend), abs=1e-4)
    # picrag_server's checkpoint is all zeros: the repaired rows are naive's, so the answer is queryblend's.
    assert picrag_meta(repaired).computed_tokens == meta.computed_tokens
    assert_same_answer(repaired, blend, abs_tol=1e-5)


@pytest.mark.server
def test_the_shipped_network_repairs_the_rows_it_drops(shipped_checkpoint_server, layout, musique):
    row = musique[56]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2]))
    with shipped_checkpoint_server.client() as client:
        before = counters(client).get("repaired_tokens", 0)
        plain = run(client, prompt, "queryblend:0.1,2", top=True)
        repaired = run(client, prompt, "cacherepair+queryblend:0.1,2", top=True)
        after = counters(client).get("repaired_tokens", 0)
    assert picrag_meta(repaired).computed_tokens == picrag_meta(plain).computed_tokens
    assert after - before == prompt.chunk_tokens
    assert first_token_top(repaired) != pytest.approx(first_token_top(plain), abs=1e-4)
