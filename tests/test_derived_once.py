"""Each fact about a linked request is derived once: one admission, one plan with its layout,
one content key per chunk (picrag_core.chunk_key), whatever steps the request then takes (lease,
graft, repair, CacheBlend's forward, reports). Counted, not read: a spy on the plan builder, and
the engine's own counters of admissions and chunk keys on a running server."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

import picrag_core.chunk_key as chunk_key_module
from picrag_core.link_hints import LinkRequest, compile_hints, runtime_request
from rag_server.linking.chunk_compiler import segments_to_compile
from sglang_patches.plan import link_plan
from tests.chunk_requests import counters, passages_of
from tests.engine_routing import REPAIRER, routed

FAMILIES = ("naive", "legolink0", "legolink:2", "cacheblend:0.3", "cacherepair", "cacherepair+legolink:2",
            "select:0.2,1", "prefix", "full")


@pytest.mark.parametrize("policy", FAMILIES)
def test_a_plan_hashes_each_chunk_once_and_builds_its_layout_once(policy, monkeypatch):
    prompt, chunks = [7, 8, *range(20, 40), 9, 10], [(2, 12), (12, 22)]
    link = LinkRequest.of(policy, chunks, sink_token=1)
    if link.family.scored_as:
        link = dataclasses.replace(link, recompute=((5, 7),))
    ids, hints = runtime_request(prompt, link)
    hashed, layouts = [], []
    monkeypatch.setattr(chunk_key_module, "_listeners", [lambda: hashed.append(1)])
    real_layout = link_plan.reordered_layout
    monkeypatch.setattr(link_plan, "reordered_layout", lambda *a: layouts.append(1) or real_layout(*a))
    plan, req = routed(hints, ids, repairer=REPAIRER)
    reuses = link.family.reuses_chunks
    # The head and every chunk, each once; none for a family that reuses no chunk.
    assert len(hashed) == (1 + len(chunks) if reuses else 0), policy
    assert len(layouts) == int(link.family.reordered_layout)
    assert (plan.order is not None) == link.family.reordered_layout
    # Everything later reads the plan's chunks: their keys travel with them.
    assert all(len(chunk.digest) == 64 for chunk in plan.stored_chunks)


@pytest.mark.server
def test_a_request_is_admitted_once_and_hashes_each_chunk_once_on_the_engine(picrag_server, layout, musique):
    row = musique[73]
    prompt = layout.build(row["question"], passages_of(row, [1, 0, 2]))
    with picrag_server.client() as frontend, httpx.Client(base_url=picrag_server.runtime_url, timeout=600) as runtime:
        for policy in ("naive", "legolink:2", "cacheblend:0.3", "cacherepair"):
            link = LinkRequest.of(policy, prompt.chunks, tail=prompt.tail)
            pieces = segments_to_compile(prompt.input_ids, link)
            before = counters(frontend)
            compiled = runtime.post("/generate", json={
                "input_ids": pieces, "sampling_params": {"max_new_tokens": 0}, "kv_hints": compile_hints()})
            assert compiled.status_code == 200, compiled.text
            middle = counters(frontend)
            # One admission and one content key per compile request (a batch: one per prompt).
            assert middle["admissions"] - before["admissions"] == len(pieces)
            assert middle["chunk_digests"] - before["chunk_digests"] == len(pieces)
            ids, hints = runtime_request(prompt.input_ids, link)
            for stream in (False, True):
                response = runtime.post("/generate", json={
                    "input_ids": ids, "kv_hints": hints, "stream": stream,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
                assert response.status_code == 200, response.text
            after = counters(frontend)
            # Each link: admitted once, its head and chunks hashed once each, through its lease,
            # graft, repair or blend and every forward.
            assert after["admissions"] - middle["admissions"] == 2, policy
            assert after["chunk_digests"] - middle["chunk_digests"] == 2 * len(pieces), policy


@pytest.mark.server
def test_a_hint_the_engine_does_not_admit_is_refused_once_with_a_400(picrag_server, layout, musique):
    row = musique[73]
    prompt = layout.build(row["question"], passages_of(row, [1]))
    bad = runtime_request(prompt.input_ids, LinkRequest.of("legolink0", prompt.chunks, sink_token=7))[1]
    with picrag_server.client() as frontend, httpx.Client(base_url=picrag_server.runtime_url, timeout=600) as runtime:
        before = counters(frontend)
        response = runtime.post("/generate", json={"input_ids": prompt.input_ids, "kv_hints": bad,
                                                   "sampling_params": {"max_new_tokens": 2}})
        after = counters(frontend)
        assert response.status_code == 400 and "sink_token" in response.text, response.text
        assert runtime.get("/health").status_code == 200
    assert after["admissions"] - before["admissions"] == 1
    assert after["link_hint_refusals"] - before["link_hint_refusals"] == 1
