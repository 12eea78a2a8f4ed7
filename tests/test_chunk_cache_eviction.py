"""A tiny KV pool forces the chunk cache to evict: nothing crashes, nothing stale is reused, and
under concurrent load every answer is the one the request gets alone."""

from __future__ import annotations

import pytest

from rag_server.bench.load import flush_when_idle
from tests.conftest import start_picrag_server, stop_picrag_server
from tests.chunk_requests import counters, generate, passages_of, picrag_meta
from tests.load_burst import MAX_RSS_GROWTH, ask, run_burst

pytestmark = pytest.mark.server

POOL_TOKENS = 1536
REQUESTS = 60  # each body three times: enough rounds for chunks to be evicted while others link
CLIENTS = 16


@pytest.fixture(scope="module")
def small_pool_server(served_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("small-pool") / "server.log"
    # At most 2 requests in the runtime at once: the pool holds their chunks and re-positioned
    # copies, while the passages of all requests together are several times the pool.
    handle = start_picrag_server(log, ["--model", str(served_model_dir), "--max-total-tokens", str(POOL_TOKENS),
                                       "--max-inflight", "2"])
    yield handle
    stop_picrag_server(handle)


def test_eviction_under_a_tiny_pool_never_reuses_freed_slots(small_pool_server, layout, musique):
    prompts = [
        layout.build(row["question"], passages_of(row, [0, 1, 2]))
        for row in musique[10:20]
    ]
    # A request needs its chunks twice (stored + re-positioned copy), so the pool holds about
    # one request; the whole set of chunks is more than twice the pool.
    assert sum(p.chunk_tokens for p in prompts) > 2 * POOL_TOKENS
    prompts.append(prompts[0])  # its chunks were evicted long ago: recompiled, same answer

    with small_pool_server.client() as client:
        small = [generate(client, p.input_ids, "naive", p.chunks) for p in prompts]
        pressure = counters(client)
        health = client.get("/health").status_code
        cold = []
        for prompt in prompts:  # each alone from an empty cache: the answer no eviction can touch
            flush_when_idle(client)
            cold.append(generate(client, prompt.input_ids, "naive", prompt.chunks))

    assert health == 200
    assert pressure["compile_chunk_misses"] >= 10 * 3 + 3  # the repeated prompt recompiled
    for small_out, cold_out in zip(small, cold):
        assert picrag_meta(small_out).chunk_hits == 3, [picrag_meta(o) for o in small]
        assert small_out["output_ids"] == cold_out["output_ids"]


def short_passage(row: dict, index: int) -> dict:
    """The passage's first ~25 words: many distinct passages, small prompts."""
    passage = row["passages"][index]
    return {"title": passage["title"], "text": " ".join(passage["text"].split()[:25])}


def test_concurrent_load_under_eviction_answers_like_serial(small_pool_server, musique):
    """60 RAG requests from 16 clients whose passages (all told) are several times the pool, so
    chunks are evicted and recompiled while others link: none is lost, every answer is the one the
    same request gets alone, memory stays bounded."""
    rows = musique[20:30]
    passages = [short_passage(row, i) for row in rows for i in range(4)]  # 40 distinct passages
    bodies = [
        {"question": rows[n % len(rows)]["question"], "max_tokens": 4, "temperature": 0, "policy": "naive",
         "documents": [passages[(n * 7 + j * 13) % len(passages)] for j in range(3)]}
        for n in range(20)
    ]
    with small_pool_server.client() as client:
        serial = [ask(client, body) for body in bodies]
        before = counters(client)
    burst = run_burst(small_pool_server, bodies, REQUESTS, CLIENTS)
    print(burst.report())
    with small_pool_server.client() as client:
        after = counters(client)
    assert len(burst.answers) == REQUESTS
    mismatches = [(i, got, serial[i]) for i, got in burst.answers if got[:2] != serial[i][:2]]
    assert not mismatches, mismatches[:5]
    # Chunks were evicted and compiled again during the burst, not only before it.
    assert after["compile_chunk_misses"] - before["compile_chunk_misses"] > 0
    assert burst.peak_rss - burst.baseline_rss < MAX_RSS_GROWTH


def test_eviction_takes_cached_linked_prompts_before_stored_chunks(small_pool_server, layout, musique):
    """Under pool pressure the chunk store outlives cached linked prompts (chunk_cache.ChunksLast):
    a chunk compiled first and unused since is still stored after later linked prompts overfill
    the pool; by plain LRU it would be the first to go."""
    import httpx

    from picrag_core.link_hints import ON_MISS_REFUSE, link_hints

    lone = layout.build(musique[40]["question"], passages_of(musique[40], [0]))
    others = [layout.build(row["question"], passages_of(row, [0, 1])) for row in musique[41:44]]
    chunk_tokens = lone.chunk_tokens + sum(p.chunk_tokens for p in others)
    linked_tokens = len(lone.input_ids) + sum(len(p.input_ids) for p in others)
    # The chunks fit the pool with a request in flight; chunks and linked prompts together do not.
    assert chunk_tokens + max(len(p.input_ids) for p in others) < POOL_TOKENS < chunk_tokens + linked_tokens
    with small_pool_server.client() as client:
        flush_when_idle(client)  # SGLang refused a bare flush once in CI, just after the burst test
        generate(client, lone.input_ids, "naive", lone.chunks)
        for prompt in others:
            generate(client, prompt.input_ids, "naive", prompt.chunks)
    hints = link_hints("naive", list(lone.chunks))
    hints["actions"][0]["payload"]["on_miss"] = ON_MISS_REFUSE
    relinked = httpx.post(f"{small_pool_server.runtime_url}/generate", timeout=120, json={
        "input_ids": lone.input_ids, "sampling_params": {"max_new_tokens": 1}, "kv_hints": hints})
    assert relinked.status_code == 200, relinked.text  # not refused: its chunk is still stored
