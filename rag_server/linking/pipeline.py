"""The one path a linked prompt takes to the runtime: compile, link, relink on misses, stream.

Every linked prompt goes through `LinkPipeline.generate`: a client's `/generate` with a
`picrag.link` hint, a DSL prompt with chunk markers (rewritten into one), `/rag/query` and the
OpenAI chat extension. It compiles the pieces the chunk store lacks (chunk_compiler.py), sends
the link to the runtime's `/generate`, and hands back the runtime's response once its first event
was checked (`Linked`). `/generate` relays that response byte for byte, so unmodified SGLang
clients read SGLang's own format; the RAG routes read it as text deltas.

Relinking: compile and link are two requests, so under memory pressure a chunk compiled for a
prompt can be evicted before the link arrives (and a compile skipped because the frontend
compiled the chunk earlier finds it gone). Every attempt but the last asks the engine to refuse
the link when a chunk is missing as it arrives (`on_miss: refuse`): the engine answers at once,
computing nothing (sglang_patches.tree.link_admission), and leases the chunks of a link it queues, so
they stay until it is served. The chunks are then compiled again and the link is sent again, at
most MAX_RELINKS times. The last attempt is answered as it is: a chunk still missing is computed
as ordinary tokens (correct attention, but not the policy asked for), which its first response
reports (`meta_info`: the first event of a stream, the whole body otherwise); such a response is
also dropped and relinked when it is not the last.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import httpx

from rag_server.linking import sse
from rag_server.linking.chunk_compiler import ROUTING_KEY_HEADER, ChunkCompiler, CompileError, Pieces
from rag_server.linking.kv_budget import KVBudget, KVHold
from rag_server.linking.selection import selected_runs
from picrag_core.engine_report import EngineReport
from picrag_core.link_hints import MISS_REFUSAL, MISS_REFUSAL_STATUS, LinkRequest, runtime_request

logger = logging.getLogger(__name__)

MAX_RELINKS = 3
_JSON = {"content-type": "application/json"}
SGLANG_MAX_NEW_TOKENS = 128  # SGLang's default where a body names none


class GenerationError(RuntimeError):
    """The chunks could not be compiled, or the runtime refused or failed the request; `status`
    is the HTTP status to report."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RuntimeDelta:
    text: str  # text produced since the previous delta
    meta: dict[str, Any]  # the runtime's meta_info; the last delta's carries the final counts


def refused(meta_info: Optional[dict[str, Any]]) -> bool:
    """The engine's answer to an `on_miss: refuse` link that missed a chunk on arrival."""
    reason = (meta_info or {}).get("finish_reason") or {}
    return reason.get("type") == "abort" and str(reason.get("message", "")).startswith(MISS_REFUSAL)


def response_misses(body: bytes) -> int:
    """Chunk misses a new compile can mend (`relinkable_misses`: chunks cut by the request's own
    shape would be cut again) reported by a non-streamed /generate answer (one object or a list)."""
    try:
        data = json.loads(body)
    except ValueError:
        return 0
    outputs = data if isinstance(data, list) else [data]
    return sum(EngineReport.of(out.get("meta_info")).relinkable_misses for out in outputs if isinstance(out, dict))


async def first_event(chunks: AsyncIterator[bytes]) -> tuple[bytes, Optional[dict[str, Any]]]:
    """Read a server-sent-event stream up to its first `data:` event: (the bytes read, that
    event's JSON, or None when the stream ended or the event is not JSON)."""
    read: list[bytes] = []
    events = sse.Splitter(b"\n\n")
    async for chunk in chunks:
        read.append(chunk)
        for line in events.feed(chunk).decode(errors="replace").split("\n"):
            data = sse.data_of(line)
            if data is not None:
                try:
                    return b"".join(read), json.loads(data)
                except ValueError:
                    return b"".join(read), None
    return b"".join(read), None


def is_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


@dataclass
class Linked:
    """The runtime's response to a link, as far as it was read to count its chunk misses.

    A stream is open: `head` holds its bytes up to the first event and `rest` (its one raw
    iterator) the others; read it with `body` or `deltas`, or `aclose` it. A whole answer was
    read into `head` and closed (`rest` None)."""

    response: httpx.Response
    head: bytes
    rest: Optional[AsyncIterator[bytes]]
    misses: int
    compile_s: float  # spent making sure the chunks were stored, relinks included
    refused: bool = False  # the engine refused it unrun: a chunk was missing as it arrived
    hold: Optional[KVHold] = None  # its share of the KV budget, given back when it is closed

    @classmethod
    async def read(cls, response: httpx.Response, compile_s: float) -> Linked:
        try:
            if is_stream(response):
                rest = response.aiter_raw()
                head, event = await first_event(rest)
                meta = (event or {}).get("meta_info")
                return cls(response, head, rest, EngineReport.of(meta).relinkable_misses, compile_s, refused(meta))
            head = await response.aread()
        except BaseException:
            await response.aclose()
            raise
        await response.aclose()
        misses = response_misses(head) if response.status_code == 200 else 0
        was_refused = response.status_code == MISS_REFUSAL_STATUS and MISS_REFUSAL.encode() in head
        return cls(response, head, None, misses, compile_s, was_refused)

    async def body(self) -> AsyncIterator[bytes]:
        """The response's bytes as the runtime sent them; closes it at the end."""
        try:
            if self.head:
                yield self.head
            if self.rest is not None:
                async for chunk in self.rest:
                    yield chunk
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        await self.response.aclose()
        if self.hold is not None:
            self.hold.release()

    async def deltas(self) -> AsyncIterator[RuntimeDelta]:
        """The text a streamed generation produces, delta by delta; GenerationError for a
        runtime that refused or failed it."""
        try:
            status = self.response.status_code
            if status != 200:
                detail = b"".join([chunk async for chunk in self.body()]).decode(errors="replace")[:500]
                # The runtime's 4xx (e.g. a prompt it rejects) is the caller's problem to fix.
                raise GenerationError(f"runtime answered {status}: {detail}", status if 400 <= status < 500 else 502)
            emitted = 0
            async for event in sse.aevents(sse.alines(self.body())):
                if "error" in event:
                    raise GenerationError(f"runtime error: {event['error']}")
                # SGLang streams the cumulative text of the request.
                text = event.get("text", "")
                yield RuntimeDelta(text[emitted:], event.get("meta_info") or {})
                emitted = len(text)
        except httpx.HTTPError as exc:
            raise GenerationError(f"runtime unavailable: {exc}", 503) from exc
        finally:
            await self.aclose()


class LinkPipeline:
    """Sends links as they are given: the policy a link names is the one it is served with,
    resolved once per request before it gets here (rag_server/linking/policy_resolver.py)."""

    def __init__(self, client: httpx.AsyncClient, compiler: ChunkCompiler, sink_token: Optional[int] = None,
                 budget: Optional[KVBudget] = None):
        self.client = client
        self.compiler = compiler
        self.sink_token = sink_token  # the model's BOS: the sink that policies with sink tokens compile
        self.budget = budget  # the runtime's KV pool shared by linked prompts in flight (kv_budget.py)
        self.relinks = 0  # links sent again because a chunk was missing (picrag_frontend_relinks)

    def with_sink(self, link: LinkRequest) -> LinkRequest:
        """`link` with this model's sink token where its policy compiles chunks behind sinks
        and the client named none."""
        if link.family.sink_tokens and link.sink_token is None:
            return dataclasses.replace(link, sink_token=self.sink_token)
        return link

    async def generate(
        self,
        input_ids: list[int],
        link: LinkRequest,
        fields: Mapping[str, Any],
        headers: Mapping[str, str] = _JSON,
        params: Any = None,
    ) -> Linked:
        """Send `fields` (a /generate body without its prompt) with `input_ids` linked as
        `link` says, its chunks compiled first; relinked when chunks are missing at link time.
        `headers` and `params` go with every link request."""
        pieces = Pieces.of(input_ids, link)  # hashed once for every compile, relink and probe below
        hold = None
        if self.budget is not None:
            new_tokens = (fields.get("sampling_params") or {}).get("max_new_tokens")
            row = len(input_ids) + (SGLANG_MAX_NEW_TOKENS if new_tokens is None else int(new_tokens))
            hold = await self.budget.hold(row, pieces.keys, [len(segment) for segment in pieces.segments])
        try:
            if link.family.scored_as and link.chunks and link.ratio > 0 and not link.recompute:
                link = await self._select(input_ids, link, pieces, headers, params)
            linked = await self._linked(input_ids, link, pieces, fields, headers, params)
        except BaseException:
            if hold is not None:
                hold.release()
            raise
        if hold is not None:
            hold.grafted()  # the first event is back: the pieces are in the request's own slots
            if linked.rest is None:  # a whole answer, read and closed already
                hold.release()
            else:
                linked.hold = hold
        return linked

    async def _linked(self, input_ids: list[int], link: LinkRequest, pieces: Pieces, fields: Mapping[str, Any],
                      headers: Mapping[str, str], params: Any) -> Linked:
        if pieces.route:  # behind the gateway, the compile and the link go to the replica of the passage set
            headers = {**headers, ROUTING_KEY_HEADER: pieces.route}
        relinks = MAX_RELINKS if link.family.reuses_chunks and link.chunks else 0
        compile_s = 0.0
        for attempt in range(relinks + 1):
            last = attempt == relinks
            # Refused unrun on a miss, but for the last attempt, whatever the client's hint said.
            attempt_link = dataclasses.replace(link, refuse_on_miss=not last)
            runtime_ids, hints = runtime_request(input_ids, attempt_link)
            content = json.dumps({**fields, "input_ids": runtime_ids, "kv_hints": hints}).encode()
            compile_s += await self._compile(pieces, skip_known=attempt == 0)
            try:
                request = self.client.build_request("POST", "/generate", content=content, headers=headers,
                                                    params=params)
                linked = await Linked.read(await self.client.send(request, stream=True), compile_s)
            except httpx.HTTPError as exc:
                raise GenerationError(f"runtime unavailable: {exc}", 503) from exc
            if last or not (linked.misses or linked.refused):
                return linked
            await linked.aclose()
            self.relinks += 1
            logger.warning("%s: compiling again (retry %d)",
                           "link refused, a chunk was not in the store" if linked.refused
                           else f"{linked.misses} chunk(s) not in the store at link time", attempt + 1)
            self.compiler.note_eviction()
        raise AssertionError("the last attempt always answers")

    async def _select(self, input_ids: list[int], link: LinkRequest, pieces: Pieces, headers: Mapping[str, str],
                      params: Any) -> LinkRequest:
        """`link` with the tokens it recomputes chosen by the question's attention over its base
        policy's linked KV, measured by one prefill-only link of that policy (selection.py)."""
        probe = dataclasses.replace(link.like(link.family.scored_as), report_attention=True)
        if (probe.family.reuses_chunks, probe.stored_chunk([])) != (link.family.reuses_chunks, link.stored_chunk([])):
            pieces = Pieces.of(input_ids, probe)  # the base policy stores its chunks otherwise
        # A link teacher-forced on an answer (its last report_span - 1 tokens) selects from the
        # question alone, as the request that generated that answer did.
        forced = max(link.report_span - 1, 0)
        measured = await self._linked(input_ids[:len(input_ids) - forced], probe, pieces,
                                      {"sampling_params": {"max_new_tokens": 0, "temperature": 0}}, headers, params)
        if measured.response.status_code != 200:
            raise GenerationError(f"measuring the question's attention failed: {measured.head[:300]!r}",
                                  measured.response.status_code if 400 <= measured.response.status_code < 500
                                  else 502)
        scores = EngineReport.of(json.loads(measured.head).get("meta_info")).context_attention
        if scores is None:
            raise GenerationError("the runtime reported no attention for a selecting link")
        return dataclasses.replace(link, recompute=selected_runs(scores, link.chunks, link.k, link.ratio))

    async def _compile(self, pieces: Pieces, skip_known: bool) -> float:
        started = time.perf_counter()
        try:
            await self.compiler.prepare(pieces, skip_known=skip_known)
        except (CompileError, httpx.HTTPError) as exc:
            raise GenerationError(f"chunk compile failed: {exc}", 503) from exc
        return time.perf_counter() - started
