"""The frontend half of chunk reuse: compile each chunk (and the prompt head) before linking.

A linked prompt can only reuse what the engine's chunk store holds, so before forwarding it
the frontend sends every chunk, and the head before the first chunk, as its own prefill-only
`picrag.compile` request. A cached chunk costs one token; a missing one is computed alone at
positions 0..n-1 and stored. Identical compiles in flight at the same time are sent once.

The compiler remembers what it compiled. With `skip_known`, a prompt whose pieces were all
compiled before is not sent at all: the round trip (a forward of one token per piece) is most
of a warm prompt's time to first token. The engine may have evicted a piece since; callers that
skip check the link's chunk misses and compile again (rag_server.linking.relink). A miss means the pool
is evicting, where skipping would mostly guess wrong and every wrong guess costs a wasted
prefill: after one, the compiler forgets what it knew and stops skipping for SKIP_PAUSE_S.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

import httpx

from sglang_patches.chunk_key import chunk_key
from sglang_patches.link_hints import CHUNK_POLICIES, LinkRequest, compile_hints


# Keys of compiled pieces remembered (about 100 bytes each).
KNOWN_PIECES = 100_000
SKIP_PAUSE_S = 60.0


class CompileError(RuntimeError):
    pass


@dataclass
class CompileReport:
    chunks_compiled: int = 0
    chunks_cached: int = 0


def segments_to_compile(input_ids: list[int], link: LinkRequest) -> list[list[int]]:
    if link.policy not in CHUNK_POLICIES or not link.chunks:
        return []
    head_end = link.chunks[0][0]
    head = [input_ids[:head_end]] if head_end > 0 else []
    return head + [link.stored_chunk(input_ids[start:end]) for start, end in link.chunks]


class ChunkCompiler:
    def __init__(self, client: httpx.AsyncClient):
        self.client = client
        self._inflight: dict[str, asyncio.Future] = {}
        self._known: OrderedDict[str, None] = OrderedDict()
        self._skip_paused_until = 0.0

    def forget(self) -> None:
        """The engine's cache was flushed: nothing is stored, and nothing was evicted."""
        self._known.clear()
        self._skip_paused_until = 0.0

    def note_eviction(self) -> None:
        """A link found a piece this compiler had compiled gone: the pool is evicting."""
        self._known.clear()
        self._skip_paused_until = time.monotonic() + SKIP_PAUSE_S

    def remember_compiled(self, segments: list[list[int]]) -> None:
        """Pieces compiled by someone else's picrag.compile request through this frontend."""
        self._remember([chunk_key(s) for s in segments])

    def _remember(self, keys: list[str]) -> None:
        for key in keys:
            self._known[key] = None
            self._known.move_to_end(key)
        while len(self._known) > KNOWN_PIECES:
            self._known.popitem(last=False)

    async def compile_many(self, segments: list[list[int]]) -> list[bool]:
        """Make sure every segment is stored; True for each that had to be computed.

        Segments not already being compiled go to the runtime as one batched request, so a
        prompt's twenty compiles cost one scheduler step, not twenty round trips."""
        keys = [chunk_key(s) for s in segments]
        mine: dict[str, list[int]] = {}
        for key, segment in zip(keys, segments):
            if key not in self._inflight and key not in mine:
                mine[key] = segment
        if mine:
            batch = asyncio.ensure_future(self._send(list(mine.values())))
            for index, key in enumerate(mine):
                future = asyncio.ensure_future(self._pick(batch, index))
                self._inflight[key] = future
                future.add_done_callback(lambda _, key=key: self._inflight.pop(key, None))
        pending = [self._inflight.get(key) for key in keys]
        results = await asyncio.gather(*(asyncio.shield(f) for f in pending))
        self._remember(keys)
        return list(results)

    @staticmethod
    async def _pick(batch: asyncio.Future, index: int) -> bool:
        return (await batch)[index]

    async def _send(self, segments: list[list[int]]) -> list[bool]:
        response = await self.client.post(
            "/generate",
            json={
                "input_ids": segments,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "kv_hints": compile_hints(),
            },
        )
        if response.status_code != 200:
            raise CompileError(f"chunk compile failed ({response.status_code}): {response.text[:300]}")
        outputs = response.json()
        return [
            bool((out["meta_info"].get("cached_tokens_details") or {}).get("picrag_chunk_misses", 1))
            for out in outputs
        ]

    async def prepare(self, input_ids: list[int], link: LinkRequest, skip_known: bool = False) -> CompileReport:
        segments = segments_to_compile(input_ids, link)
        if not segments:
            return CompileReport()
        if skip_known and time.monotonic() >= self._skip_paused_until:
            keys = [chunk_key(s) for s in segments]
            if all(key in self._known for key in keys):
                self._remember(keys)
                return CompileReport(chunks_cached=len(link.chunks))
        computed = await self.compile_many(segments)
        report = CompileReport()
        for was_computed in computed[len(segments) - len(link.chunks):]:
            if was_computed:
                report.chunks_compiled += 1
            else:
                report.chunks_cached += 1
        return report
