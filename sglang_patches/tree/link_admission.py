"""A linked request's chunks are checked and leased when it reaches the scheduler, before any compute.

Compile and link are two requests, so a chunk compiled for a prompt can be evicted before its
link arrives. Found only at the link's prefill, that miss costs a whole prefill the frontend
throws away to relink. Here, as SGLang queues a new request (an AROUND hook on
`Scheduler._add_request_to_queue`), the chunk cache leases its stored chunks
(`ChunkRadixCache.lease_chunks`); a link that asked to be refused on a miss (`on_miss: refuse`)
and misses a chunk is answered at once with SGLang's own abort (status MISS_REFUSAL_STATUS),
with no forward, and the frontend compiles and relinks.
"""

from __future__ import annotations

HOOK_TARGET = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"


def admit(original, scheduler, req, is_retracted: bool = False, *args, **kwargs):
    from sglang_patches.tree.chunk_cache import ChunkRadixCache

    cache = scheduler.tree_cache
    # A retracted or preempted request has run (and may have streamed tokens): it is requeued as is.
    fresh = not is_retracted and not getattr(req, "is_retracted", False) and req.to_finish is None
    if fresh and isinstance(cache, ChunkRadixCache):
        refusal = cache.lease_chunks(req)
        if refusal is not None:
            _refuse(scheduler, req, refusal)
            return None
    return original(scheduler, req, is_retracted, *args, **kwargs)


def _refuse(scheduler, req, message: str) -> None:
    # How SGLang answers a request it rejects at intake without running it (Scheduler's beam and
    # sampling-mask validation).
    from sglang.srt.disaggregation.utils import prepare_abort

    from picrag_core.link_hints import MISS_REFUSAL_STATUS
    from sglang_patches.plan.link_plan import plan_of

    # Counted as a refusal (ChunkRadixCache.lease_chunks), not as a request served.
    plan_of(req).count = None
    prepare_abort(req, message, status_code=MISS_REFUSAL_STATUS)
    scheduler.output_streamer.stream_output([req], req.return_logprob)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, admit, HookType.AROUND)
