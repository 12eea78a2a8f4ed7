"""A linked request is admitted, and its chunks leased, when it reaches the scheduler, before any compute.

Every request SGLang queues passes here (an AROUND hook on `Scheduler._add_request_to_queue`),
from the HTTP server or any other entry, so this is where a picrag hint is admitted, once per
request (sglang_patches.guard.request_guard.admitted_link): the chunk cache builds the request's
plan and state (`ChunkRadixCache.admit`), and a hint the engine does not admit is answered at
once with SGLang's own abort and a 400 that says why.

Compile and link are two requests, so a chunk compiled for a prompt can be evicted before its
link arrives. Found only at the link's prefill, that miss costs a whole prefill the frontend
throws away to relink. So the chunk cache also leases the request's stored chunks here
(`ChunkRadixCache.lease_chunks`); a link that asked to be refused on a miss (`on_miss: refuse`)
and misses a chunk is answered at once (status MISS_REFUSAL_STATUS), with no forward, and the
frontend compiles and relinks.
"""

from __future__ import annotations

from http import HTTPStatus

HOOK_TARGET = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"
# An engine whose chunk cache is not active (its start-up re-rotation check failed) serves no link.
NO_CHUNK_CACHE = "kv_hints: picrag's chunk cache is not active on this engine (not started with it, or its start-up self-check failed)"


def admit(original, scheduler, req, is_retracted: bool = False, *args, **kwargs):
    from picrag_core.link_hints import MISS_REFUSAL_STATUS, LinkHintError, parse_link_request
    from sglang_patches.tree.chunk_cache import ChunkRadixCache

    cache = scheduler.tree_cache
    # A retracted or preempted request has run (and may have streamed tokens): it is requeued as is.
    fresh = not is_retracted and not getattr(req, "is_retracted", False) and req.to_finish is None
    if fresh and isinstance(cache, ChunkRadixCache):
        refusal = cache.admit(req)
        if refusal is not None:
            _refuse(scheduler, req, refusal, HTTPStatus.BAD_REQUEST)
            return None
        refusal = cache.lease_chunks(req)
        if refusal is not None:
            _refuse(scheduler, req, refusal, MISS_REFUSAL_STATUS)
            return None
    elif fresh and req.kv_hints is not None:
        try:
            linked = parse_link_request(req.kv_hints) is not None
        except LinkHintError:
            linked = True
        if linked:
            _refuse(scheduler, req, NO_CHUNK_CACHE, HTTPStatus.BAD_REQUEST)
            return None
    return original(scheduler, req, is_retracted, *args, **kwargs)


def _refuse(scheduler, req, message: str, status: int) -> None:
    # How SGLang answers a request it rejects at intake without running it (Scheduler's beam and
    # sampling-mask validation).
    from sglang.srt.disaggregation.utils import prepare_abort

    from sglang_patches.plan.link_state import state_of

    state = state_of(req)
    if state is not None:
        # Counted as a refusal (ChunkRadixCache.lease_chunks), not as a request served.
        state.count = None
    prepare_abort(req, message, status_code=status)
    scheduler.output_streamer.stream_output([req], req.return_logprob)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, admit, HookType.AROUND)
