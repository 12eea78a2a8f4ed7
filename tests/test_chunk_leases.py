"""The chunk cache's leases (sglang_patches/chunk_cache.py): what a linked request locks on
arrival, when it is refused, when the locks go. The tree is faked: these are the bookkeeping
rules; the refusal and the eviction order run against the real engine in test_chunk_cache.py
and test_chunk_cache_eviction.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_patches.chunk_cache import CacheCounters, ChunkRadixCache
from sglang_patches.link_hints import MISS_REFUSAL, LinkRequest

POOL = 1000


def fake_cache(stored: dict[str, int]):
    """A ChunkRadixCache whose store holds chunks named by `stored` (name -> tokens); every
    request links the chunks its `chunks` attribute names. Returns it and its held locks."""
    cache = object.__new__(ChunkRadixCache)
    cache.disable = False
    cache.counters = CacheCounters()
    cache.kv_pool = SimpleNamespace(size=POOL)
    cache._leases = {}
    held: list[str] = []
    cache._link_of = lambda req: req.link
    cache._needed_chunks = lambda req, link: [[name] * stored.get(name, 50) for name in req.chunks]

    def lookup_chunk(tokens):
        if tokens[0] not in stored:
            return None
        held.append(tokens[0])
        return None, None, tokens[0]

    cache.lookup_chunk = lookup_chunk
    cache.unlock = held.remove
    return cache, held


def request(rid: str, chunks: list[str], refuse: bool = True):
    link = LinkRequest(policy="naive", chunks=((0, 1),), refuse_on_miss=refuse)
    return SimpleNamespace(rid=rid, chunks=chunks, link=link)


def test_a_link_leases_its_chunks_until_it_is_released_or_aborted():
    cache, held = fake_cache({"a": 100, "b": 100})
    assert cache.lease_chunks(request("r1", ["a", "b"])) is None
    assert cache.lease_chunks(request("r2", ["a"])) is None
    assert sorted(held) == ["a", "a", "b"]
    cache.on_release(request("r1", []), checkpointed=True)
    assert held == ["a"]
    cache.release_aborted_request(SimpleNamespace(rid="r2", attempt_id=0))
    assert held == []


def test_a_link_missing_a_chunk_is_refused_holding_nothing_unless_it_asked_to_be_computed():
    cache, held = fake_cache({"a": 100})
    refusal = cache.lease_chunks(request("r1", ["a", "gone"]))
    assert refusal.startswith(MISS_REFUSAL) and "1 of 2" in refusal and held == []
    assert cache.counters.values["link_refusals"] == 1
    # The last attempt computes what is missing: it is queued, leasing what is there.
    assert cache.lease_chunks(request("r1", ["a", "gone"], refuse=False)) is None and held == ["a"]


def test_leases_never_hold_more_than_their_share_of_the_pool_and_lapse():
    cache, held = fake_cache({"a": 300, "b": 300})
    assert cache.lease_chunks(request("r1", ["a"])) is None and held == ["a"]
    # 300 + 300 > half the pool of 1000: queued without a lease.
    assert cache.lease_chunks(request("r2", ["b"])) is None and held == ["a"]
    assert cache.counters.values["leases_over_share"] == 1
    cache._leases["r1"].deadline = 0.0  # its request neither ran nor ended in time
    assert cache.lease_chunks(request("r3", ["b"])) is None
    assert held == ["b"] and cache.counters.values["leases_lapsed"] == 1

