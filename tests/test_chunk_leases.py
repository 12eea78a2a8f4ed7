"""The chunk cache's leases (sglang_patches/tree/chunk_cache.py): what a linked request locks on
arrival, when it is refused, when the locks go. The tree is faked: these are the bookkeeping
rules; the refusal and the eviction order run against the real engine in test_chunk_cache.py
and test_chunk_cache_eviction.py."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from sglang_patches.tree.chunk_cache import CacheCounters, ChunkRadixCache
from picrag_core.link_hints import MISS_REFUSAL, LinkRequest
from picrag_core.chunk_key import StoredChunk
from sglang_patches.plan.link_state import LinkState, LinkStats, state_of

POOL = 1000


def fake_cache(stored: dict[str, int]):
    """A ChunkRadixCache whose store holds chunks named by `stored` (name -> tokens); every
    request links the chunks its `chunks` attribute names (one letter each). Returns it and its
    held locks."""
    cache = object.__new__(ChunkRadixCache)
    cache.disable = False
    cache.counters = CacheCounters()
    cache.kv_pool = SimpleNamespace(size=POOL)
    cache._leases, cache._leased, cache._leased_tokens = {}, Counter(), {}
    held: list[str] = []

    def plan_of_request(req):
        req.picrag_plan = SimpleNamespace(
            stored_chunks=tuple(StoredChunk.of([ord(name)] * stored.get(name, 50)) for name in req.chunks),
            link=req.link)
        req.picrag_state = LinkState(LinkStats("naive"))
        return req.picrag_plan

    cache._plan_of = plan_of_request

    def lookup_chunk(chunk):
        name = chr(chunk.tokens[0])
        if name not in stored:
            return None
        held.append(name)
        return None, None, name

    cache.lookup_chunk = lookup_chunk
    cache.unlock = held.remove
    return cache, held


def request(rid: str, chunks: list[str], refuse: bool = True):
    link = LinkRequest(policy="naive", chunks=((0, 1),), refuse_on_miss=refuse)
    return SimpleNamespace(rid=rid, chunks=chunks, link=link)


def test_a_lease_lasts_until_the_graft_is_done_or_the_request_goes():
    cache, held = fake_cache({"a": 100, "b": 100})
    first, second, third = request("r1", ["a", "b"]), request("r2", ["a"]), request("r3", ["b"])
    for req in (first, second, third):
        assert cache.lease_chunks(req) is None
    assert sorted(held) == ["a", "a", "b", "b"]
    state_of(first).release_lease()  # its first forward: grafted
    assert sorted(held) == ["a", "b"]
    state_of(first).release_lease()  # once only
    assert sorted(held) == ["a", "b"]
    cache.on_release(SimpleNamespace(rid="r2"), checkpointed=True)  # released before a forward (aborted)
    assert held == ["b"]
    cache.release_aborted_request(SimpleNamespace(rid="r3", attempt_id=0))
    assert held == [] and cache.leased_tokens == 0


def test_a_link_missing_a_chunk_is_refused_holding_nothing_unless_it_asked_to_be_computed():
    cache, held = fake_cache({"a": 100})
    refusal = cache.lease_chunks(request("r1", ["a", "g"]))
    assert refusal.startswith(MISS_REFUSAL) and "1 of 2" in refusal and held == []
    assert cache.counters.values["link_refusals"] == 1
    # The last attempt computes what is missing: it is queued, leasing what is there.
    assert cache.lease_chunks(request("r1", ["a", "g"], refuse=False)) is None and held == ["a"]


def test_the_pinned_share_counts_each_chunk_once_and_leases_lapse():
    cache, held = fake_cache({"a": 200, "b": 200, "c": 200})
    assert cache.lease_chunks(request("r1", ["a"])) is None and held == ["a"]
    # The same chunk again pins nothing more: four leases of "a" are 200 tokens, not 800.
    for rid in ("r2", "r3", "r4"):
        assert cache.lease_chunks(request(rid, ["a"])) is None
    assert cache.leased_tokens == 200 and held == ["a"] * 4
    assert cache.lease_chunks(request("r5", ["b"])) is None and cache.leased_tokens == 400
    # 400 + 200 > half the pool of 1000: queued without a lease.
    assert cache.lease_chunks(request("r6", ["c"])) is None and "c" not in held
    assert cache.counters.values["leases_over_share"] == 1
    for rid in ("r1", "r2", "r3", "r4"):
        cache._leases[rid].deadline = 0.0  # their requests neither ran nor ended in time
    assert cache.lease_chunks(request("r7", ["c"])) is None
    assert sorted(held) == ["b", "c"] and cache.counters.values["leases_lapsed"] == 4
    assert cache.leased_tokens == 400
