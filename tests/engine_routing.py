"""A request routed through a bare ChunkRadixCache: what the engine admits and plans for it,
without pools or a model (routing reads the engine's settings and the repairer only)."""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any, Optional

from picrag_core.attention_backends import NATIVE_BACKEND
from sglang_patches.tree.chunk_cache import CacheCounters, ChunkRadixCache
from sglang_patches.plan.link_plan import LinkPlan
from sglang_patches.guard.request_guard import EngineSettings

BOS = 1
# Stands for a loaded checkpoint: routing reads its digest only.
REPAIRER = SimpleNamespace(checkpoint_digest="ab" * 32)


def routed(hints: Any, prompt: list[int], *, repairer: Any = None, extra_key: Optional[str] = None,
           sink: Optional[int] = BOS, backend: str = NATIVE_BACKEND, max_new_tokens: int = 8,
           **req_fields) -> tuple[Optional[LinkPlan], SimpleNamespace]:
    cache = object.__new__(ChunkRadixCache)
    cache.repairer, cache.engine, cache.counters = repairer, EngineSettings(sink, backend), CacheCounters()
    req = SimpleNamespace(rid="r", kv_hints=hints, origin_input_ids=array("q", prompt), extra_key=extra_key,
                          skip_radix_cache_insert=False,
                          sampling_params=SimpleNamespace(max_new_tokens=max_new_tokens), **req_fields)
    return cache._plan_of(req), req
