"""cacherepair+legolink:K: CacheRepair's repaired chunk KV plus LegoLink's first K tokens of every
chunk recomputed, in one forward. A zero-initialised network is exactly legolink:K; K covering
every chunk is full prefill; without a checkpoint the engine serves legolink:K."""

from __future__ import annotations

import re

import pytest

from picrag_core.link_hints import LinkRequest, runtime_request
from picrag_core.policies import parse_policy
from tests.chunk_requests import assert_same_answer, counters, first_token_top, passages_of, picrag_meta, run
from tests.engine_routing import REPAIRER, routed

COMBINED = "cacherepair+legolink"


def test_policy_name_parameter_and_flags():
    policy = parse_policy(COMBINED)
    assert policy.name == f"{COMBINED}:16" and parse_policy(f"{COMBINED}:4").param == 4
    family = policy.family
    assert family.repairs and family.reordered_layout and family.position_masked and family.reuses_chunks
    assert family.unrepaired == "legolink"
    with pytest.raises(ValueError, match=re.escape(f"{COMBINED}:K needs a whole number K >= 0")):
        parse_policy(f"{COMBINED}:x")


def test_sent_reordered_like_legolink_under_its_own_namespace():
    chunks = [(2, 8), (8, 11), (11, 17)]
    prompt = list(range(100, 120))
    combined = LinkRequest.of(f"{COMBINED}:4", chunks)
    lego = LinkRequest.of("legolink:4", chunks)
    (combined_ids, combined_hints), (lego_ids, _) = runtime_request(prompt, combined), runtime_request(prompt, lego)
    assert combined_ids == lego_ids != prompt
    assert combined_hints["actions"][0]["payload"] == {
        "policy": COMBINED, "chunks": [list(c) for c in chunks], "k": 4, "layout": "legolink"}
    namespaces = {_routed(REPAIRER, policy, chunks)[0].namespace for policy in (f"{COMBINED}:4", "legolink:4", "cacherepair")}
    assert len(namespaces) == 3


def _routed(repairer, policy: str, chunks, prompt_len: int = 20):
    prompt = list(range(100, 100 + prompt_len))
    input_ids, hints = runtime_request(prompt, LinkRequest.of(policy, chunks))
    return routed(hints, input_ids, repairer=repairer, sink=None)


def test_without_a_checkpoint_the_engine_serves_legolink():
    chunks = [(2, 8), (8, 11), (11, 17)]
    prompt = list(range(100, 120))
    plan, req = _routed(None, f"{COMBINED}:4", chunks)
    assert plan.link.policy == "legolink" and plan.link.k == 4
    lego_ids, lego_hints = runtime_request(prompt, LinkRequest.of("legolink:4", chunks))
    assert req.extra_key == plan.namespace == routed(lego_hints, lego_ids, sink=None)[0].namespace
    assert plan.order is not None and not req.skip_radix_cache_insert
    combined, req = _routed(REPAIRER, f"{COMBINED}:4", chunks)
    assert combined.link.policy == COMBINED
    assert req.extra_key == combined.namespace != plan.namespace


def test_the_network_sees_every_chunk_even_one_k_covers_whole():
    chunks = [(2, 8), (8, 11), (11, 17)]
    plan, req = _routed(REPAIRER, f"{COMBINED}:4", chunks)
    segments = plan.segments
    prompt = tuple(range(100, 120))
    # The head, then every chunk in prompt order: the middle one (3 tokens, k = 4) has no rest.
    assert [seg.stored.tokens for seg in segments] == [prompt[:2]] + [prompt[s:e] for s, e in chunks]
    assert [seg.recomputed_whole for seg in segments] == [False, False, True, False]
    assert [(seg.chunk_offset, seg.shift) for seg in segments[1:]] == [(4, 2), (3, 8), (4, 11)]


def test_cli_help_lists_every_family(capsys):
    from rag_server.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert f"{COMBINED}[:K]" in " ".join(capsys.readouterr().out.split())


@pytest.mark.server
def test_zero_initialised_repair_with_legolink_is_exactly_legolink(picrag_server, layout, musique):
    row = musique[56]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2]))
    k = 4
    assert min(end - start for start, end in prompt.chunks) > k
    question_tokens = len(prompt.input_ids) - prompt.chunks[-1][1]
    with picrag_server.client() as client:
        before = counters(client).get("repaired_tokens", 0.0)
        lego = run(client, prompt, f"legolink:{k}", top=True)
        repaired = run(client, prompt, f"{COMBINED}:{k}", top=True)
        after = counters(client)["repaired_tokens"]
    meta = picrag_meta(repaired)
    assert meta.policy == COMBINED and meta.chunk_hits == 3 and meta.chunk_misses == 0
    assert meta.computed_tokens == 3 * k + question_tokens
    # The network corrected every grafted rest, and nothing else.
    assert after - before == prompt.chunk_tokens - 3 * k
    assert repaired["output_ids"] == lego["output_ids"]
    assert first_token_top(repaired) == first_token_top(lego)


@pytest.mark.server
def test_k_covering_every_chunk_is_full_prefill(picrag_server, layout, musique):
    row = musique[45]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2]))
    longest = max(end - start for start, end in prompt.chunks)
    with picrag_server.client() as client:
        before = counters(client).get("repaired_tokens", 0.0)
        full = run(client, prompt, "full", top=True)
        whole = run(client, prompt, f"{COMBINED}:{longest}", top=True)
        after = counters(client).get("repaired_tokens", 0.0)
    assert picrag_meta(whole).computed_tokens == len(prompt.input_ids) - len(layout.head_ids)
    assert after == before  # nothing grafted but the head, so nothing repaired
    assert_same_answer(whole, full)


@pytest.mark.server
def test_rag_query_accepts_it(picrag_server):
    documents = [
        {"title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris, France."},
        {"title": "Big Ben", "text": "Big Ben is the nickname for the Great Bell of the clock at the Palace of Westminster."},
    ]
    body = {"question": "Which city is the Eiffel Tower in?", "documents": documents, "max_tokens": 8}
    with picrag_server.client() as client:
        answers = {}
        for policy in ("legolink:4", f"{COMBINED}:4"):
            response = client.post("/rag/query", json={**body, "policy": policy})
            assert response.status_code == 200, response.text
            answers[policy] = response.json()
    combined = answers[f"{COMBINED}:4"]
    assert combined["policy"] == f"{COMBINED}:4"
    assert combined["answer"] == answers["legolink:4"]["answer"]
    assert combined["usage"]["computed_tokens"] == answers["legolink:4"]["usage"]["computed_tokens"]
