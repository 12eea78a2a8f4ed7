"""Send one linked prompt to the runtime: compile its chunks, then stream the generation.

This is the path the `/generate` handler takes for a `picrag.link` request (the ChunkCompiler,
then the runtime's `/generate`), called in-process by the RAG routes instead of over HTTP.
The runtime is always asked to stream, so the frontend sees the first token when it is
produced and can report time to first token for streaming and non-streaming clients alike.
Chunks evicted between compile and link are compiled and linked again (rag_server.linking.relink).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from rag_server.linking import sse
from rag_server.linking.chunk_compiler import ChunkCompiler, CompileError
from rag_server.linking.relink import MAX_RELINKS, chunk_misses
from sglang_patches.link_hints import CHUNK_POLICIES, LinkRequest, runtime_request

logger = logging.getLogger(__name__)


class GenerationError(RuntimeError):
    """The runtime refused or failed the request; `status` is the HTTP status to report."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RuntimeDelta:
    text: str  # text produced since the previous delta
    meta: dict[str, Any]  # the runtime's meta_info; the last delta's carries the final counts


class LinkedGenerator:
    def __init__(self, client: httpx.AsyncClient, compiler: ChunkCompiler, sink_token: int | None = None):
        self.client = client
        self.compiler = compiler
        self.sink_token = sink_token  # legolink0's sink: the model's BOS

    async def compile(
        self, input_ids: list[int], policy: str, chunks: Sequence[tuple[int, int]], skip_known: bool = True
    ) -> float:
        """Make sure the prompt's chunks are in the chunk store (`skip_known`: pieces this
        frontend compiled before are taken as stored; `stream` relinks if one was not);
        returns the seconds it took."""
        started = time.perf_counter()
        link = LinkRequest.of(policy, chunks, self.sink_token)
        link.validate(len(input_ids))
        try:
            await self.compiler.prepare(input_ids, link, skip_known=skip_known)
        except (CompileError, httpx.HTTPError) as exc:
            raise GenerationError(f"chunk compile failed: {exc}", 503) from exc
        return time.perf_counter() - started

    async def stream(
        self, input_ids: list[int], policy: str, chunks: Sequence[tuple[int, int]], sampling: dict[str, Any]
    ) -> AsyncIterator[RuntimeDelta]:
        """The generation of a prompt whose chunks `compile` has prepared."""
        link = LinkRequest.of(policy, chunks, self.sink_token)
        runtime_ids, hints = runtime_request(input_ids, link)
        body = {
            "input_ids": runtime_ids,
            "sampling_params": sampling,
            "stream": True,
            "kv_hints": hints,
        }
        relinks = MAX_RELINKS if link.policy in CHUNK_POLICIES and link.chunks else 0
        try:
            for attempt in range(relinks + 1):
                deltas = self._stream(body)
                first = await anext(deltas, None)
                misses = chunk_misses(first.meta) if first else 0
                if misses and attempt < relinks:
                    await deltas.aclose()
                    logger.warning("%d chunk(s) not in the store at link time: compiling again (retry %d)",
                                   misses, attempt + 1)
                    self.compiler.note_eviction()
                    await self.compile(input_ids, policy, chunks, skip_known=False)
                    continue
                if first is not None:
                    yield first
                async for delta in deltas:
                    yield delta
                return
        except httpx.HTTPError as exc:
            raise GenerationError(f"runtime unavailable: {exc}", 503) from exc

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[RuntimeDelta]:
        async with self.client.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                # The runtime's 4xx (e.g. a prompt it rejects) is the caller's problem to fix.
                status = response.status_code if 400 <= response.status_code < 500 else 502
                raise GenerationError(f"runtime answered {response.status_code}: {detail}", status)
            emitted = 0
            async for event in sse.aevents(response.aiter_lines()):
                if "error" in event:
                    raise GenerationError(f"runtime error: {event['error']}")
                # SGLang streams the cumulative text of the request.
                text = event.get("text", "")
                yield RuntimeDelta(text[emitted:], event.get("meta_info") or {})
                emitted = len(text)
