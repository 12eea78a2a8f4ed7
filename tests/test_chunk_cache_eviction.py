"""A tiny KV pool forces the chunk cache to evict: nothing crashes and nothing stale is reused."""

from __future__ import annotations

import pytest

from tests.conftest import start_picrag_server, stop_picrag_server
from tests.chunk_requests import counters, generate, layout, musique, passages_of, picrag_meta

pytestmark = pytest.mark.server

__all__ = ["layout", "musique"]  # fixtures, used by name

POOL_TOKENS = 1536


@pytest.fixture(scope="module")
def small_pool_server(default_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("small-pool") / "server.log"
    handle = start_picrag_server(log, ["--max-total-tokens", str(POOL_TOKENS)])
    yield handle
    stop_picrag_server(handle)


def test_eviction_under_a_tiny_pool_never_reuses_freed_slots(small_pool_server, picrag_server, layout, musique):
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
    with picrag_server.client() as client:
        client.post("/flush_cache").raise_for_status()
        cold = [generate(client, p.input_ids, "naive", p.chunks) for p in prompts]

    assert health == 200
    assert pressure["compile_chunk_misses"] >= 10 * 3 + 3  # the repeated prompt recompiled
    for small_out, cold_out in zip(small, cold):
        assert picrag_meta(small_out)["chunk_hits"] == 3, [picrag_meta(o) for o in small]
        assert small_out["output_ids"] == cold_out["output_ids"]
