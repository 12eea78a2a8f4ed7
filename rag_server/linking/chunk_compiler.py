"""The compile half of chunk reuse: compile each chunk (and the prompt head) before linking.

A linked prompt can only reuse what the engine's chunk store holds, so before forwarding it
the frontend sends every chunk, and the head before the first chunk, as its own prefill-only
`picrag.compile` request. A cached chunk costs one token; a missing one is computed alone at
positions 0..n-1 and stored. Identical compiles in flight at the same time are sent once.

The compiler remembers what it compiled. With `skip_known`, only the pieces it did not compile
before are sent, and a prompt whose pieces were all compiled before is not sent at all: the
round trip (a forward of one token per piece) is most of a warm prompt's time to first token. The engine may have evicted a piece since; callers that
skip check the link's chunk misses and compile again (rag_server/linking/pipeline.py). A miss
means the pool is evicting, where skipping would mostly guess wrong and every wrong guess costs
a wasted prefill: after one, the compiler forgets what it knew and stops skipping for
SKIP_PAUSE_S.

A prompt's pieces are hashed once per request (`Pieces`): the keys that name them in the
compiler's record, and the passage-set key that routes them, come from one hash of each chunk.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import httpx

from picrag_core.chunk_key import chunk_key
from picrag_core.link_hints import LinkRequest, compile_hints

# Keys of compiled pieces remembered (about 100 bytes each).
KNOWN_PIECES = 100_000
SKIP_PAUSE_S = 60.0
# The header the model gateway's consistent-hashing policy routes by (rag_server/launch/gateway.py);
# a single runtime ignores it.
ROUTING_KEY_HEADER = "x-smg-routing-key"


class CompileError(RuntimeError):
    pass


def compile_request(segments: list[list[int]]) -> dict[str, Any]:
    """The `/generate` body that stores each segment in the chunk store (prefill only)."""
    return {
        "input_ids": segments,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "kv_hints": compile_hints(),
    }


def segments_to_compile(input_ids: list[int], link: LinkRequest) -> list[list[int]]:
    """The pieces a link reuses, as they are stored: the head before the first chunk, then
    every chunk."""
    if not link.family.reuses_chunks or not link.chunks:
        return []
    head_end = link.chunks[0][0]
    head = [input_ids[:head_end]] if head_end > 0 else []
    return head + [list(tokens) for tokens in link.stored_chunks(input_ids)]


def _passage_set(chunk_keys: Sequence[str]) -> Optional[str]:
    if not chunk_keys:
        return None
    return hashlib.sha256(" ".join(sorted(set(chunk_keys))).encode()).hexdigest()[:32]


def passage_set_key(input_ids: list[int], link: LinkRequest) -> str | None:
    """The routing key of the passages `link` marks, in any order (None without chunks): the
    compile and the link of a request reach the same replica behind the gateway, and so do
    requests over the same passages, where those are cached. The price is balance: one passage
    set is served by one replica, however hot it is."""
    return _passage_set(_passage_keys(input_ids, link))


def _passage_keys(input_ids: list[int], link: LinkRequest) -> list[str]:
    """Each passage's content key: its span, the last with the link's tail (the separator it is
    stored with), so a passage keys alike wherever it stands."""
    last = len(link.chunks) - 1
    return [chunk_key(list(input_ids[start:end]) + (list(link.tail) if index == last else []))
            for index, (start, end) in enumerate(link.chunks)]


@dataclass(frozen=True)
class Pieces:
    """What a linked prompt needs stored, each piece hashed once: the pieces as stored
    (`segments_to_compile`), their content keys, and the prompt's passage-set key (`route`)."""

    segments: tuple[list[int], ...]
    keys: tuple[str, ...]
    route: Optional[str]

    @classmethod
    def of(cls, input_ids: list[int], link: LinkRequest) -> Pieces:
        chunk_keys = _passage_keys(input_ids, link)
        segments = segments_to_compile(input_ids, link)
        if not segments or link.family.sink_tokens:  # stored with a sink token: hashed so
            keys = [chunk_key(segment) for segment in segments]
        else:  # the head, then the chunks: their stored form is their passage key
            keys = [chunk_key(head) for head in segments[:len(segments) - len(chunk_keys)]] + chunk_keys
        return cls(tuple(segments), tuple(keys), _passage_set(chunk_keys))


class ChunkCompiler:
    def __init__(self, client: httpx.AsyncClient):
        self.client = client
        self._inflight: dict[str, asyncio.Future[None]] = {}
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

    def _remember(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._known[key] = None
            self._known.move_to_end(key)
        while len(self._known) > KNOWN_PIECES:
            self._known.popitem(last=False)

    async def compile_many(self, segments: Sequence[list[int]], keys: Sequence[str], route: str | None = None) -> None:
        """Make sure every segment (named by its key in `keys`) is stored (`route`: the request's
        routing key).

        Segments not already being compiled go to the runtime as one batched request, so a
        prompt's twenty compiles cost one scheduler step, not twenty round trips."""
        mine: dict[str, list[int]] = {}
        for key, segment in zip(keys, segments):
            if key not in self._inflight and key not in mine:
                mine[key] = segment
        if mine:
            batch = asyncio.ensure_future(self._send(list(mine.values()), route))
            for key in mine:
                self._inflight[key] = batch
            batch.add_done_callback(lambda done: [self._inflight.pop(key) for key in mine
                                                  if self._inflight.get(key) is done])
        pending = {id(future): future for future in (self._inflight[key] for key in keys)}
        await asyncio.gather(*(asyncio.shield(future) for future in pending.values()))
        self._remember(keys)

    async def _send(self, segments: list[list[int]], route: str | None) -> None:
        headers = {ROUTING_KEY_HEADER: route} if route else None
        response = await self.client.post("/generate", json=compile_request(segments), headers=headers)
        if response.status_code != 200:
            raise CompileError(f"chunk compile failed ({response.status_code}): {response.text[:300]}")

    async def prepare(self, pieces: Pieces, skip_known: bool = False) -> None:
        """Make sure a prompt's `pieces` are in the chunk store (`skip_known`: pieces this
        compiler compiled before are taken as stored)."""
        if not pieces.segments:
            return
        if skip_known and time.monotonic() >= self._skip_paused_until:
            # Only the pieces it never compiled: a known piece would cost the engine a forward
            # for a hit (one new passage among twenty known ones, a document that moved first).
            unknown = [index for index, key in enumerate(pieces.keys) if key not in self._known]
            if unknown:
                await self.compile_many([pieces.segments[i] for i in unknown], [pieces.keys[i] for i in unknown],
                                        pieces.route)
            self._remember(pieces.keys)
            return
        await self.compile_many(pieces.segments, pieces.keys, pieces.route)
