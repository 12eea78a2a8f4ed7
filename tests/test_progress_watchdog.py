"""`/health` reflects the scheduler's progress (rag_server/api/progress_watchdog.py): a scheduler
with work and no progress for --watchdog-timeout turns /health 503, and `picrag serve` exits with
status 3 for its supervisor. Against a fake runtime whose state query goes unanswered, and a real
server whose scheduler is stopped in the middle of a forward."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rag_server.cli import RUNTIME_DIED_EXIT
from tests.conftest import start_picrag_server
from tests.fake_runtime import FakeRuntime
from tests.inprocess_frontend import frontend, serving
from tests.test_runtime_supervision import LONG_GENERATION, scheduler_of

DEADLINE_S = 120


class StallingRuntime(FakeRuntime):
    """A runtime whose HTTP side answers /health while its scheduler answers no state query
    once `stalled` is set (as SGLang's does when its scheduler is stuck in one step)."""

    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.stalled = threading.Event()

    async def _state(self, request: Request) -> Response:
        await self._count(request)
        while self.stalled.is_set():
            await asyncio.sleep(0.05)
        return JSONResponse({"internal_states": [{}]})

    def app(self):
        app = super().app()
        app.router.routes.append(Route("/server_info", self._state))
        return app


def test_a_stalled_scheduler_turns_health_503_and_calls_on_stall(default_model_dir):
    fake = StallingRuntime(default_model_dir)
    stalls: list[str] = []
    with serving(fake.app(), graceful_shutdown_s=1) as runtime_url, \
            frontend(runtime_url, health_interval_s=0.2, watchdog_timeout_s=1.0, on_stall=stalls.append) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        deadline = time.monotonic() + DEADLINE_S
        while fake.calls["/server_info"] < 3:  # answered while it progresses
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.get("/health").status_code == 200
        fake.stalled.set()
        while (health := client.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 with a stalled scheduler"
            time.sleep(0.05)
        fake.stalled.clear()
    assert health.status_code == 503 and health.json()["status"] == "scheduler stalled", health.text
    assert stalls == [health.json()["error"]]
    assert stalls[0] == ("scheduler stalled: it has work and made no progress for 1 s (its state query went "
                         "unanswered)")


@pytest.mark.slow
def test_picrag_serve_exits_3_when_its_scheduler_stalls_mid_forward(tmp_path):
    """The scheduler is stopped (SIGSTOP) while it decodes a long generation: its HTTP side still
    answers the runtime's /health, the frontend's /health turns 503 and the server exits 3."""
    server = start_picrag_server(tmp_path / "server.log", ["--health-interval", "1", "--watchdog-timeout", "5"])
    processes = psutil.Process(server.process.pid).children(recursive=True)
    scheduler = scheduler_of(server.process.pid)
    health: list[httpx.Response] = []
    try:
        with server.client(timeout=60) as client, \
                client.stream("POST", "/generate", json=LONG_GENERATION) as generation:
            next(line for line in generation.iter_lines() if line.startswith("data:"))
            os.kill(scheduler.pid, signal.SIGSTOP)
            runtime_health = httpx.get(f"{server.runtime_url}/health", timeout=10).status_code
            deadline = time.monotonic() + DEADLINE_S
            while server.process.poll() is None:
                assert time.monotonic() < deadline, "picrag serve still running with a stalled scheduler"
                try:
                    health.append(client.get("/health", timeout=5))
                except httpx.HTTPError:
                    pass  # the server is on its way out
                time.sleep(0.2)
        exit_code = server.process.wait(60)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    _, left = psutil.wait_procs(processes, timeout=30)
    log = server.log.read_text()
    assert runtime_health == 200  # what SGLang's own /health says
    assert any(h.status_code == 503 and h.json()["status"] in ("scheduler stalled", "runtime dead") for h in health)
    assert exit_code == RUNTIME_DIED_EXIT, log[-3000:]
    assert "SGLang runtime scheduler stalled: it has work and made no progress for 5 s" in log
    assert not left, [p.pid for p in left]
