"""SGLang's routes through the frontend, unchanged: requests are relayed to the runtime and its
answers (streams included, byte for byte) back to the client, so unmodified SGLang clients work
against picrag's port."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from rag_server.api.state import frontend
from rag_server.linking.pipeline import is_stream
from rag_server.linking.sse import Splitter

logger = logging.getLogger(__name__)

# SGLang routes the frontend forwards as they are (/generate, /flush_cache, /v1/completions and
# /v1/chat/completions are forwarded by their own handlers, which add picrag's part; /metrics
# over connections of its own, rag_server/api/runtime_metrics.py).
PASSTHROUGH_ROUTES: dict[str, list[str]] = {
    "/get_model_info": ["GET"],
    "/model_info": ["GET"],
    "/get_server_info": ["GET"],
    "/server_info": ["GET"],
    "/abort_request": ["POST"],
    "/v1/loads": ["GET"],
    "/v1/models": ["GET"],
}
HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "content-encoding"})
# The API key is the frontend's: the runtime (loopback, no key) never sees it.
_CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key"})
EVENT_END = b"\n\n"
DONE_EVENT = b"data: [DONE]\n\n"


def forwarded_headers(request: Request) -> dict[str, str]:
    """The client's headers that go on to the runtime."""
    return {k: v for k, v in request.headers.items()
            if k.lower() not in {"host", *HOP_HEADERS, *_CREDENTIAL_HEADERS}}


def relayed_headers(upstream: httpx.Response) -> dict[str, str]:
    """The runtime's headers that go back to the client."""
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}


def relay(upstream: httpx.Response, body: bytes | AsyncIterator[bytes]) -> Response:
    """The runtime's answer as the client's: `body` whole, or streamed as it arrives (a stream
    the runtime fails to finish ends with an error event)."""
    if isinstance(body, bytes):
        return Response(body, status_code=upstream.status_code, headers=relayed_headers(upstream))
    return StreamingResponse(_ended_by_error_event(body), status_code=upstream.status_code,
                             headers=relayed_headers(upstream))


def failure_status(exc: httpx.HTTPError) -> int:
    """The status for a runtime call that failed: 504 when a timeout ran out, 503 otherwise."""
    return 504 if isinstance(exc, httpx.TimeoutException) else 503


def error_event(message: str, status: int) -> bytes:
    """An error as SGLang's streams report one, then the stream's end."""
    error = {"message": message, "type": "server_error", "code": status, "retryable": True}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n" + DONE_EVENT


async def _ended_by_error_event(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A server-sent-event stream relayed event by event (byte for byte); if the runtime's
    side fails (it died, a timeout ran out, an event grew over sse.MAX_EVENT_BYTES), the event it
    was in the middle of is dropped and an error event ends the stream, so the client reads a
    failure instead of a cut connection."""
    events = Splitter(EVENT_END)
    try:
        async for chunk in chunks:
            if complete := events.feed(chunk):
                yield complete
        if rest := events.rest():
            yield rest
    except httpx.HTTPError as exc:
        logger.error("runtime stream failed: %r", exc)
        yield error_event(f"runtime failed mid-stream: {exc!r}", failure_status(exc))


async def _raw_stream(upstream: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()


async def json_object(request: Request) -> tuple[bytes, dict | None]:
    """The request's body, and its JSON when that is an object. Routes that extend SGLang's
    forward any other body untouched, so SGLang answers malformed JSON itself."""
    body = await request.body()
    try:
        payload = loads_bounded(body)
    except ValueError:
        return body, None
    return body, payload if isinstance(payload, dict) else None


def loads_bounded(body: bytes | str):
    """`json.loads`, with nesting too deep for Python's parser a 400 (HTTPException) instead of
    the RecursionError it raises, which would be a 500 here and in the runtime (SGLang parses
    the same body with the same parser)."""
    try:
        return json.loads(body)
    except RecursionError:
        raise HTTPException(400, "the JSON body is nested too deeply") from None


async def forward(request: Request, body: bytes | None = None) -> Response:
    """The client's request (`body`: its body, when the handler read it) answered by the runtime."""
    client = frontend(request).client
    try:
        upstream = await client.send(client.build_request(
            request.method,
            request.url.path,
            params=request.query_params,
            content=await request.body() if body is None else body,
            headers=forwarded_headers(request),
        ), stream=True)
    except httpx.HTTPError as exc:
        return _failed(request, exc)
    if is_stream(upstream):
        return relay(upstream, _raw_stream(upstream))
    try:
        data = await upstream.aread()
    except httpx.HTTPError as exc:
        return _failed(request, exc)
    finally:
        await upstream.aclose()
    return relay(upstream, data)


def _failed(request: Request, exc: httpx.HTTPError) -> Response:
    logger.error("runtime request %s failed: %r", request.url.path, exc)
    return JSONResponse({"error": f"runtime unavailable: {exc!r}"}, failure_status(exc))


async def passthrough(request: Request) -> Response:
    return await forward(request)


router = APIRouter()
for _path, _methods in PASSTHROUGH_ROUTES.items():
    router.add_api_route(_path, passthrough, methods=_methods, include_in_schema=False)
