"""A stand-in for SGLang's server behind an in-process frontend: it answers what the frontend
asks at start (model and server info, /health), counts every call, and answers /generate as a
test chooses (at once, never, or a stream that stalls or never ends)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from picrag_core.link_hints import link_hints, parse_link_request
from tests.inprocess_frontend import serving

CONTEXT_LENGTH = 2048


def event(data: dict) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def _forever() -> None:
    await asyncio.Event().wait()


async def answer(_request: Request) -> Response:
    return JSONResponse({"text": "ok", "meta_info": {"prompt_tokens": 1, "completion_tokens": 1}})


async def hang(_request: Request) -> Response:
    """Accepts the request and never answers, not even with headers."""
    await _forever()
    raise AssertionError("unreachable")


async def stall(_request: Request) -> Response:
    """A stream with one event, then silence."""

    async def events() -> AsyncIterator[bytes]:
        yield event({"text": "a", "meta_info": {}})
        await _forever()

    return StreamingResponse(events(), media_type="text/event-stream")


async def trickle(_request: Request) -> Response:
    """A stream that never ends: an event every 0.1 s."""

    async def events() -> AsyncIterator[bytes]:
        text = ""
        while True:
            text += "a"
            yield event({"text": text, "meta_info": {}})
            await asyncio.sleep(0.1)

    return StreamingResponse(events(), media_type="text/event-stream")


DOCUMENTS = [{"title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris."}]


def recording(policies: list[str]):
    """A /generate handler that notes each request's policy (vanilla: none) and answers "Paris"."""
    async def generate(request):
        body = await request.json()
        link = parse_link_request(body.get("kv_hints"))
        policies.append("vanilla" if link is None else "compile" if link.compile else link.policy)
        meta = {"prompt_tokens": 9, "completion_tokens": 1, "finish_reason": {"type": "stop"}}
        if not body.get("stream"):
            return JSONResponse({"text": "Paris", "output_ids": [7], "meta_info": meta})

        async def events():
            yield event({"text": "Paris", "meta_info": meta})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return generate


def link_hints_naive() -> dict:
    return link_hints("naive", [(0, 3)])


class FakeRuntime:
    def __init__(self, model_dir: Path, generate=answer):
        self.model_dir = model_dir
        self.generate = generate  # the /generate handler; tests may swap it
        self.calls: Counter[str] = Counter()  # path -> requests received
        self.bodies: dict[str, bytes] = {}  # path -> the last body received
        self.health_open = threading.Event()  # /health answers only while set
        self.health_open.set()
        self.health_status = 200

    async def _count(self, request: Request) -> None:
        self.calls[request.url.path] += 1
        self.bodies[request.url.path] = await request.body()

    async def _model_info(self, request: Request) -> Response:
        await self._count(request)
        return JSONResponse({"model_path": str(self.model_dir), "tokenizer_path": str(self.model_dir),
                             "served_model_name": "fake"})

    async def _server_info(self, request: Request) -> Response:
        await self._count(request)
        return JSONResponse({"context_length": CONTEXT_LENGTH, "max_req_input_len": CONTEXT_LENGTH})

    async def _health(self, request: Request) -> Response:
        await self._count(request)
        while not self.health_open.is_set():
            await asyncio.sleep(0.02)
        return Response(status_code=self.health_status)

    async def _generate(self, request: Request) -> Response:
        await self._count(request)
        return await self.generate(request)

    async def _ok(self, request: Request) -> Response:
        await self._count(request)
        return JSONResponse({"success": True})

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/get_model_info", self._model_info),
            Route("/get_server_info", self._server_info),
            Route("/health", self._health),
            Route("/generate", self._generate, methods=["POST"]),
            *(Route(path, self._ok, methods=["GET", "POST"])
              for path in ("/flush_cache", "/abort_request", "/v1/completions", "/v1/chat/completions")),
        ])


@contextmanager
def fake_runtime(model_dir: Path, generate=answer) -> Iterator[tuple[FakeRuntime, str]]:
    """A FakeRuntime on a free port: (it, its URL). Requests it never answers are dropped at the end."""
    fake = FakeRuntime(model_dir, generate)
    with serving(fake.app(), graceful_shutdown_s=1) as url:
        yield fake, url
