"""picrag's SGLang plugin (entry-point group ``sglang.srt.plugins``).

SGLang calls `register` early in its main, scheduler and detokenizer processes. It adds:
* the radix-cache backend ``pic`` (`--radix-cache-backend pic`): sglang_patches.tree.chunk_cache;
* the attention backend ``picrag_native`` (`--attention-backend picrag_native`): SGLang's
  torch_native backend with extend attention on real query rows only (sglang_patches.attention.native);
* the attention backend ``picrag_flashinfer`` (CUDA): SGLang's FlashInfer backend whose extends
  with true-position annotations run FlashInfer prefill with a custom mask
  (sglang_patches.attention.flashinfer);
* a hook that adds each request's chunk-cache accounting to ``meta_info`` (sglang_patches.steps.meta_info);
* a hook that keeps the first answer token's full-vocabulary log-probabilities for links that
  ask (sglang_patches.steps.first_token_report), and one on the logits processor that computes the
  distributions after a link's last K positions when it asks (sglang_patches.steps.span_report);
* hooks that annotate each extend batch from its requests' link plans (true positions of reordered
  LegoLink prompts, sglang_patches.steps.positions; CacheBlend's cached KV, sglang_patches.steps.cacheblend),
  end their chunk leases, and keep the annotations on the eager runner's copy of the batch
  (sglang_patches.steps.batch_annotations);
* hooks that run CacheBlend's selective recompute in the decoder layers (sglang_patches.steps.cacheblend);
* a hook on the scheduler's intake that leases a linked request's stored chunks and refuses,
  before any compute, a link whose chunks are missing when it asked so (sglang_patches.tree.link_admission);
* a hook on the tokenizer manager's per-request validation that refuses token ids outside the
  vocabulary and picrag hints the engine does not admit (sglang_patches.guard.request_guard);
* a hook that reports the chunk cache's start-up re-rotation check in `/server_info`
  (sglang_patches.selfcheck);
* a hook that applies RoPE on CPU with cos/sin gathered once per forward (sglang_patches.cpu.rotary);
* hooks that run CPU decode steps without SGLang's per-layer boundary objects
  (sglang_patches.cpu.lean_decode).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

RADIX_CACHE_BACKEND = "pic"
SUPPORTED_SGLANG = "0.5.23"


def _disk_store(ctx, kv_pool):
    """The chunk store of this scheduler process (picrag_core.chunk_store_spec: a directory or a
    Mooncake store), or None without one. Each tensor/pipeline rank gets its own directory or key
    space, and so does each combination of KV options."""
    import os
    from pathlib import Path

    from picrag_core.chunk_store_spec import MAX_BYTES_ENV, TIMEOUT_ENV, MooncakeSpec, spec_from_env
    from sglang_patches.store.disk import KV_SERVER_OPTIONS, DiskChunkStore, partition_name
    from sglang_patches.store.hicache import DEFAULT_TIMEOUT_S, HiCacheChunkStore, mooncake_backend
    from picrag_core.model_fingerprint import model_fingerprint

    spec = spec_from_env()
    if spec is None:
        return None
    args = ctx.server_args
    fingerprint = model_fingerprint(Path(args.model_path), kv_pool.dtype)
    ranks = {"tp": (ctx.tp_rank, ctx.tp_size), "pp": (ctx.params.pp_rank, ctx.params.pp_size)}
    partition = partition_name(ranks, {name: getattr(args, name, None) for name in KV_SERVER_OPTIONS})
    if isinstance(spec, MooncakeSpec):
        timeout_s = float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)
        store = HiCacheChunkStore(lambda: mooncake_backend(spec, ranks), fingerprint, partition,
                                  timeout_s=timeout_s, name=f"mooncake://{spec.master}")
        logger.info("picrag chunk store on Mooncake: %s (%s, timeout %g s per call)", spec.url,
                    "connected" if store.connected else "connecting", timeout_s)
        return store
    max_bytes = os.environ.get(MAX_BYTES_ENV)
    store = DiskChunkStore(
        spec, fingerprint, partition,
        max_bytes=int(max_bytes) if max_bytes else None, processes=ctx.tp_size * ctx.params.pp_size,
    )
    logger.info("picrag chunk store on disk: %s (%d of at most %d bytes)",
                store.directory, store.stored_bytes, store.max_bytes)
    return store


def _with_host_tier(store, counters):
    """`store` behind the host-memory tier (sglang_patches.store.host_tier), unless it is off."""
    import os

    from picrag_core.chunk_store_spec import HOST_BYTES_ENV
    from sglang_patches.store.host_tier import DEFAULT_HOST_BYTES, HostChunkTier

    host_bytes = int(os.environ.get(HOST_BYTES_ENV) or DEFAULT_HOST_BYTES)
    if store is None or host_bytes <= 0:
        return store
    logger.info("picrag host-memory chunk tier: up to %d bytes", host_bytes)
    return HostChunkTier(store, host_bytes, counters)


def _sink_token(ctx):
    """The model's BOS as its tokenizer gives it (the frontend's too): the sink legolink0 compiles."""
    tokenizer = getattr(ctx.tp_worker, "tokenizer", None)
    return None if tokenizer is None else tokenizer.bos_token_id


def _chunk_cache_factory(ctx):
    from pathlib import Path

    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_patches.tree.chunk_cache import ChunkRadixCache
    from sglang_patches.tree.metrics import prometheus_counters
    from sglang_patches.guard.request_guard import EngineSettings
    from sglang_patches.selfcheck import ROPE_CHECK_ATTR, rope_shifter

    from sglang_patches.steps.kv_repair import load_engine_repairer

    model = ctx.tp_worker.model_runner.model
    kv_pool = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    shifter, rope_check = rope_shifter(model, kv_pool.dtype)
    logger.log(logging.INFO if rope_check.passed else logging.WARNING,
               "picrag self-check, re-rotation: %s: %s", "passed" if rope_check.passed else "FAILED", rope_check.detail)
    if shifter is None:
        # Nothing can move this model's cached keys: SGLang's own radix cache, and the frontend
        # refuses chunk reuse (the failed check says why).
        cache = RadixCache(ctx.params)
    else:
        counters = prometheus_counters()
        cache = ChunkRadixCache(
            ctx.params, kv_pool=kv_pool, shifter=shifter,
            engine=EngineSettings.of(_sink_token(ctx), ctx.server_args.attention_backend,
                                     ctx.tp_worker.model_runner.model_config),
            counters=counters, disk_store=_with_host_tier(_disk_store(ctx, kv_pool), counters),
            repairer=load_engine_repairer(Path(ctx.server_args.model_path)),
        )
        logger.info("picrag chunk radix cache active (pool of %d tokens)", kv_pool.size)
    setattr(cache, ROPE_CHECK_ATTR, rope_check)
    return cache


def register() -> None:
    import sglang

    if sglang.__version__ != SUPPORTED_SGLANG:
        raise RuntimeError(
            f"picrag's SGLang patches are written for sglang=={SUPPORTED_SGLANG}, found {sglang.__version__}"
        )
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from sglang_patches import selfcheck
    from sglang_patches.attention import flashinfer as flashinfer_attention, native as attention
    from sglang_patches.cpu import lean_decode, rotary
    from sglang_patches.guard import request_guard
    from sglang_patches.steps import batch_annotations, cacheblend, first_token_report, meta_info, span_report
    from sglang_patches.tree import link_admission

    if get_radix_cache_factory(RADIX_CACHE_BACKEND) is None:
        register_radix_cache_backend(RADIX_CACHE_BACKEND, _chunk_cache_factory)
    attention.register()
    flashinfer_attention.register()
    meta_info.register()
    first_token_report.register()
    span_report.register()
    cacheblend.register()
    batch_annotations.register()
    request_guard.register()
    link_admission.register()
    selfcheck.register()
    rotary.register()
    lean_decode.register()
