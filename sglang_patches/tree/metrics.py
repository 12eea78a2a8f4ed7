"""Prometheus counters for the chunk cache, exported through SGLang's own /metrics."""

from __future__ import annotations

from sglang_patches.tree.chunk_cache import CacheCounters

COUNTER_NAMES = {
    "requests": "linked requests (a picrag policy other than compile)",
    "chunk_hits": "chunks reused from the chunk cache by linked requests",
    "chunk_misses": "chunks of linked requests that had to be computed",
    "reused_tokens": "prompt tokens of linked requests served from cache",
    "computed_tokens": "prompt tokens of linked requests computed",
    "compile_requests": "chunk compile requests",
    "compile_chunk_hits": "compile requests whose chunk was already cached",
    "compile_chunk_misses": "compile requests that computed their chunk",
    "compile_reused_tokens": "chunk tokens found cached by compile requests",
    "compile_computed_tokens": "chunk tokens computed by compile requests",
    "grafted_tokens": "chunk tokens re-positioned into linked prompts",
    "graft_skipped_pool_full": "grafts skipped because the KV pool was full",
    "link_refusals": "links answered at once, computing nothing, because a chunk was missing on arrival",
    "leases_over_share": "linked requests queued without a chunk lease: leases held their share of the pool",
    "leases_lapsed": "chunk leases released because their request neither ran nor ended in time",
    "repaired_tokens": "grafted chunk tokens corrected by the CacheRepair network",
    "repair_inputs_computed": "chunks whose CacheRepair network inputs were computed from their stored KV",
    "repair_inputs_kept": "chunks whose CacheRepair network inputs were kept from an earlier link (not recomputed)",
    "disk_saves": "compiled chunks written to the chunk store (file or Mooncake)",
    "disk_loads": "chunks reloaded into the KV pool from the host tier or the chunk store",
    "disk_misses": "chunk lookups that found the chunk in neither the host tier nor the chunk store",
    "disk_rejects": "stored chunks found corrupt, foreign or of another KV shape and ignored",
    "disk_write_failures": "chunk saves that failed (full disk or store, I/O error, store down or slow) and were dropped",
    "disk_saves_dropped": "chunk saves dropped unwritten because the chunk writer's queue was full",
    "disk_evictions": "persisted chunk files evicted, least recently used first, to keep the store under its size bound",
    "host_loads": "chunks reloaded from the host-memory tier",
    "host_evictions": "chunks dropped from the host-memory tier, least recently used first, to keep its bound",
    "store_loads": "chunks reloaded from the chunk store (file or Mooncake) past the host tier",
    "store_failures": "chunk lookups the store did not answer (down, slow past the timeout, not connected): computed",
    "chunk_digests": "chunk content keys computed by the engine (one per chunk a request names, on admission)",
    "admissions": "requests carrying kv_hints whose picrag action the engine admitted or refused (once each)",
    "link_hint_refusals": "requests refused at the scheduler's intake: a picrag hint the engine does not admit",
}


class PrometheusCounters(CacheCounters):
    def __init__(self):
        super().__init__()
        from prometheus_client import Counter

        self._counters = {
            name: Counter(f"picrag_{name}", help_text) for name, help_text in COUNTER_NAMES.items()
        }

    def add(self, name: str, amount: int = 1) -> None:
        super().add(name, amount)
        if amount:
            self._counters[name].inc(amount)


def prometheus_counters() -> CacheCounters:
    from picrag_core.chunk_key import on_digest

    counters = PrometheusCounters()
    on_digest(lambda: counters.add("chunk_digests"))
    return counters
