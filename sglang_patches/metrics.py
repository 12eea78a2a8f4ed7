"""Prometheus counters for the chunk cache, exported through SGLang's own /metrics."""

from __future__ import annotations

from sglang_patches.chunk_cache import CacheCounters

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
    "disk_saves": "compiled chunks written to the disk chunk store",
    "disk_loads": "chunks reloaded from the disk chunk store",
    "disk_rejects": "persisted chunk files found corrupt, foreign or of another KV shape and ignored",
    "disk_write_failures": "chunk saves that failed to write (full disk, I/O error) and were dropped",
    "disk_saves_dropped": "chunk saves dropped unwritten because the disk writer's queue was full",
    "disk_evictions": "persisted chunk files evicted, least recently used first, to keep the store under its size bound",
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
    return PrometheusCounters()
