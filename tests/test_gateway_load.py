"""The gateway picrag launches routes by passage set and health, never by an engine's load
(rag_server/launch/gateway.py).

The rule: a healthy engine gets the requests its routing keys hash to, however long its queue.
Broken by smg's own overload protection, on by default: in the half-hour fault soak, with one of
two engines killed, the gateway answered 503 `no_available_workers` ("0/2 available (1 healthy)")
for as long as the survivor's load report showed 8 queued requests. Here the real gateway, as
picrag launches it, sits in front of two fake engines whose `/v1/loads` (what smg polls, every
10 s) reports a queue of 100 and a full KV pool."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rag_server.launch.gateway import ROUTED_TO_HEADER, Gateway, GatewayConfig
from rag_server.launch.ports import free_port
from rag_server.linking.chunk_compiler import ROUTING_KEY_HEADER
from tests.fake_runtime import FakeRuntime
from tests.inprocess_frontend import serving, wait_for

LOAD_POLL_S = 10  # smg's --load-monitor-interval default


class BusyEngine(FakeRuntime):
    """A fake SGLang engine whose load report says it is swamped."""

    async def _loads(self, request: Request) -> Response:
        await self._count(request)
        load = {"dp_rank": 0, "num_running_reqs": 4, "num_waiting_reqs": 100, "num_used_tokens": 8100,
                "max_total_num_tokens": 8192, "token_usage": 0.99}
        return JSONResponse({"timestamp": "2026-12-07T00:00:00+00:00", "version": "0.5.23", "loads": [load]})

    async def _version(self, request: Request) -> Response:
        return JSONResponse({"version": "0.5.23"})

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "sglang"}]})

    def app(self):
        app = super().app()
        # What smg reads to tell the backend's kind, then its load.
        app.router.routes += [Route("/v1/loads", self._loads), Route("/version", self._version),
                              Route("/server_info", self._server_info), Route("/v1/models", self._models)]
        return app


def generate(gateway: Gateway, key: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/generate", json={"text": "hi"}, headers={ROUTING_KEY_HEADER: key}, timeout=30)


def test_a_busy_engine_keeps_its_passage_sets_and_a_busy_survivor_answers(tmp_path):
    engines = [BusyEngine(Path("/nonexistent")), BusyEngine(Path("/nonexistent"))]
    with contextlib.ExitStack() as stack:
        kept = stack.enter_context(serving(engines[0].app(), graceful_shutdown_s=1))
        killed = stack.enter_context(contextlib.ExitStack())
        other = killed.enter_context(serving(engines[1].app(), graceful_shutdown_s=1))
        gateway = Gateway(GatewayConfig((kept, other), free_port()), log_file=tmp_path / "gateway.log")
        gateway.start(timeout_s=60)
        stack.callback(gateway.stop)
        wait_for(lambda: gateway.workers() == (2, 2))
        keys = {}  # worker -> a routing key the ring sends to it
        for index in range(64):
            reply = generate(gateway, f"passage-set-{index}")
            assert reply.status_code == 200, reply.text
            keys.setdefault(reply.headers[ROUTED_TO_HEADER], f"passage-set-{index}")
        assert len(keys) == 2, keys
        # Both engines' load reports read (each says: queue of 100, pool full): still on the ring.
        wait_for(lambda: all(e.calls["/v1/loads"] for e in engines), timeout_s=3 * LOAD_POLL_S)
        for worker, key in keys.items():
            assert generate(gateway, key).headers[ROUTED_TO_HEADER] == worker
        # One engine dies; once the gateway has seen it (health probes) and read the survivor's
        # load again, every request goes to the survivor and is answered.
        killed.close()
        wait_for(lambda: gateway.workers()[0] == 1, timeout_s=30)
        polls = engines[0].calls["/v1/loads"]
        wait_for(lambda: engines[0].calls["/v1/loads"] > polls, timeout_s=3 * LOAD_POLL_S)
        replies = [generate(gateway, key) for key in keys.values() for _ in range(3)]
        assert [r.status_code for r in replies] == [200] * len(replies), replies[0].text
