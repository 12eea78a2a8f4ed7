"""One client cannot monopolise the frontend: a body that stalls or an answer nobody reads gives
its admission slot back (rag_server/api/client_timeouts.py), scrapes of /metrics never take the
connections real requests use (rag_server/api/runtime_metrics.py), and a stream is read in time
linear in its size with a cap on one event (rag_server/linking/sse.py). Against a fake runtime."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from rag_server.api.proxy import _ended_by_error_event
from rag_server.api.runtime_metrics import CONNECTIONS
from rag_server.linking import sse
from rag_server.linking.pipeline import first_event
from tests.fake_runtime import FakeRuntime, answer, fake_runtime
from tests.inprocess_frontend import frontend, serving

DEADLINE_S = 60


def eventually(condition, what: str, deadline_s: float = DEADLINE_S):
    """Poll `condition` until it returns a truthy value, within `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"not within {deadline_s} s: {what}"
        time.sleep(0.05)
    return result


def admitted(url: str) -> bool:
    """One slot, no queue: a request is answered 200 once no other request holds the slot."""
    return httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=DEADLINE_S).status_code == 200


def raw_connection(url: str, receive_buffer: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, int(port)))
    sock.settimeout(DEADLINE_S)
    return sock


def test_a_stalled_request_body_gets_408_and_frees_its_slot(default_model_dir):
    with fake_runtime(default_model_dir) as (fake, runtime_url), \
            frontend(runtime_url, max_inflight=1, max_queue=0, client_idle_timeout_s=1.0) as url:
        stalled = raw_connection(url)
        stalled.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"text\": ")  # and nothing more
        eventually(lambda: admitted(url), "a request admitted while the stalled body holds the only slot")
        answer = stalled.recv(4096)
        stalled.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"no request body bytes for 1 s" in answer
    assert fake.calls["/generate"] == 1  # the admitted one only


async def flood(_request: Request) -> Response:
    """A stream that never ends, as fast as it can be sent: 64 KiB events."""
    event = b"data: " + json.dumps({"text": "a" * 65_536, "meta_info": {}}).encode() + b"\n\n"

    async def events() -> AsyncIterator[bytes]:
        while True:
            yield event
            await asyncio.sleep(0)

    return StreamingResponse(events(), media_type="text/event-stream")


def test_an_answer_nobody_reads_is_dropped_and_frees_its_slot(default_model_dir):
    with fake_runtime(default_model_dir) as (fake, runtime_url), \
            frontend(runtime_url, max_inflight=1, max_queue=0, client_idle_timeout_s=1.0) as url:
        fake.generate = flood
        reader = raw_connection(url, receive_buffer=4096)
        body = json.dumps({"text": "hi", "stream": True}).encode()
        reader.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # and never reads
        eventually(lambda: fake.calls["/generate"] == 1, "the stream started")
        fake.generate = answer
        eventually(lambda: admitted(url), "a request admitted while an unread stream holds the only slot")
        reader.close()


class ScrapedRuntime(FakeRuntime):
    """A runtime whose /metrics answers only once released, like a runtime too busy to."""

    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.metrics_open = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.at_once = self.most_at_once = 0  # /metrics requests in flight

    async def _metrics(self, request: Request) -> Response:
        await self._count(request)
        self.loop = asyncio.get_running_loop()
        self.at_once += 1
        self.most_at_once = max(self.most_at_once, self.at_once)
        await self.metrics_open.wait()
        self.at_once -= 1
        return Response(b"sglang:num_requests_total 7\n", media_type="text/plain")

    def app(self):
        app = super().app()
        app.router.routes.append(Route("/metrics", self._metrics))
        return app


def test_a_flood_of_metrics_scrapes_takes_no_connection_real_requests_need(default_model_dir):
    """150 scrapes at once against a /metrics that hangs: at most CONNECTIONS reach the runtime at
    once, and a /generate is answered meanwhile (over the shared pool of 100 connections the
    scrapes took them all)."""
    fake = ScrapedRuntime(default_model_dir)

    async def scenario(url: str) -> tuple[int, list[httpx.Response]]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S, limits=limits) as client:
            scrapes = [asyncio.create_task(client.get("/metrics")) for _ in range(150)]
            while fake.calls["/metrics"] == 0:
                await asyncio.sleep(0.01)
            generate = await client.post("/generate", json={"text": "hi"}, timeout=10)
            fake.loop.call_soon_threadsafe(fake.metrics_open.set)
            return generate.status_code, await asyncio.gather(*scrapes)

    with serving(fake.app(), graceful_shutdown_s=1) as runtime_url, frontend(runtime_url) as url:
        generated, scrapes = asyncio.run(scenario(url))
    assert generated == 200
    assert {(s.status_code, s.text) for s in scrapes} == {(200, "sglang:num_requests_total 7\n")}
    assert fake.calls["/metrics"] == 150 and fake.most_at_once == CONNECTIONS


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start:start + size]


async def _collect(stream: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in stream])


def test_relayed_events_are_split_in_linear_time_and_byte_for_byte():
    """An 8 MiB event in 1 KiB pieces: concatenating what was pending with each piece (as the
    relay did) copies about 32 GiB; reading it once takes milliseconds."""
    big = b"data: " + json.dumps({"text": "x" * (8 << 20)}).encode() + b"\n\n"
    stream = big + b'data: {"text": "y"}\n\n' + sse.DONE.encode().join([b"data: ", b"\n\n"])
    started = time.perf_counter()
    relayed = asyncio.run(_collect(_ended_by_error_event(_chunks(stream, 1024))))
    head, event = asyncio.run(first_event(_chunks(stream, 1024)))
    lines = asyncio.run(_collect_lines(_chunks(stream, 1024)))
    elapsed = time.perf_counter() - started
    assert relayed == stream
    assert head.startswith(big) and len(head) < len(big) + 1024 and event == {"text": "x" * (8 << 20)}
    assert len(lines) == 6 and lines[4] == "data: [DONE]"
    assert elapsed < 5, f"{elapsed:.1f} s to read 8 MiB three times"


async def _collect_lines(chunks: AsyncIterator[bytes]) -> list[str]:
    return [line async for line in sse.alines(chunks)]


def test_an_event_over_the_cap_ends_the_stream_with_an_error_event():
    too_large = b"x" * (sse.MAX_EVENT_BYTES + 1)
    stream = b'data: {"text": "a"}\n\n' + b"data: " + too_large + b"\n\n"
    relayed = asyncio.run(_collect(_ended_by_error_event(_chunks(stream, 65_536))))
    assert relayed.split(b"\n\n") == [
        b'data: {"text": "a"}',
        b"data: " + json.dumps({"error": {
            "message": f"runtime failed mid-stream: EventTooLarge('the runtime sent an event over "
                       f"{sse.MAX_EVENT_BYTES} bytes')", "type": "server_error", "code": 503,
            "retryable": True}}).encode(),
        b"data: [DONE]", b""]
    with pytest.raises(sse.EventTooLarge):
        asyncio.run(first_event(_chunks(too_large, 65_536)))
    with pytest.raises(sse.EventTooLarge):
        asyncio.run(_collect_lines(_chunks(too_large, 65_536)))
