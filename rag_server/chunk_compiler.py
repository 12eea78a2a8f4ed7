"""The frontend half of chunk reuse: compile each chunk (and the prompt head) before linking.

A linked prompt can only reuse what the engine's chunk store holds, so before forwarding it
the frontend sends every chunk, and the head before the first chunk, as its own prefill-only
`picrag.compile` request. A cached chunk costs one token; a missing one is computed alone at
positions 0..n-1 and stored. Identical compiles in flight at the same time are sent once.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from dataclasses import dataclass

import httpx

from sglang_patches.link_hints import CHUNK_POLICIES, LinkRequest, compile_hints


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
    spans = ([(0, head_end)] if head_end > 0 else []) + list(link.chunks)
    return [input_ids[start:end] for start, end in spans]


def _chunk_key(token_ids: list[int]) -> str:
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()


class ChunkCompiler:
    def __init__(self, client: httpx.AsyncClient):
        self.client = client
        self._inflight: dict[str, asyncio.Future] = {}

    async def compile(self, token_ids: list[int]) -> bool:
        """Make sure the chunk is stored; True if it had to be computed."""
        key = _chunk_key(token_ids)
        pending = self._inflight.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._send(token_ids))
            self._inflight[key] = pending
            pending.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(pending)

    async def _send(self, token_ids: list[int]) -> bool:
        response = await self.client.post(
            "/generate",
            json={
                "input_ids": token_ids,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "kv_hints": compile_hints(),
            },
        )
        if response.status_code != 200:
            raise CompileError(f"chunk compile failed ({response.status_code}): {response.text[:300]}")
        details = response.json()["meta_info"].get("cached_tokens_details") or {}
        return bool(details.get("picrag_chunk_misses", 1))

    async def prepare(self, input_ids: list[int], link: LinkRequest) -> CompileReport:
        segments = segments_to_compile(input_ids, link)
        computed = await asyncio.gather(*(self.compile(s) for s in segments))
        report = CompileReport()
        for was_computed in computed[len(segments) - len(link.chunks):]:
            if was_computed:
                report.chunks_compiled += 1
            else:
                report.chunks_cached += 1
        return report
