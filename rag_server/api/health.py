"""`GET /health`: the frontend's own view of its runtime, open even with an API key.

A background task probes the runtime's `/health` every `interval_s` on a client of its own (one
connection), and `/health` answers from the last probe: 200 when it succeeded and is recent,
503 otherwise. No request to `/health` reaches the runtime, so a flood of them costs the
runtime nothing and cannot take the connections that real requests use. `picrag serve` starts
SGLang with its `/health` reporting the server's state without generating a token, and watches
the runtime's processes itself (rag_server/launch/runtime.py): a dead runtime is reported at
once (`mark_dead`), without waiting for the next probe. A runtime whose scheduler stalled is
reported by its ProgressWatchdog (rag_server/api/progress_watchdog.py). Behind SGLang's gateway
(several engines), each probe also reads how many engines the gateway can route to
(`/readiness`) and hands the count to `on_live_engines` (the frontend's KV budget follows it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from rag_server.api.progress_watchdog import ProgressWatchdog
from rag_server.api.state import frontend

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0
# A probe longer than this counts as failed (SGLang's own generating health check gives up after 20 s).
PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Probe:
    ok: bool
    at: float  # time.monotonic() when it ended
    error: str = ""


class HealthMonitor:
    def __init__(self, runtime_url: str, interval_s: float = DEFAULT_INTERVAL_S, connect_timeout_s: float = 10.0,
                 probe_timeout_s: float = PROBE_TIMEOUT_S, watchdog: ProgressWatchdog | None = None):
        if interval_s <= 0:
            raise ValueError(f"health probe interval must be positive, not {interval_s}")
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self._runtime_url = runtime_url
        self._connect_timeout_s = connect_timeout_s
        self._client: httpx.AsyncClient | None = None
        self._last: Probe | None = None
        self._dead: str | None = None
        self._task: asyncio.Task | None = None
        self._watchdog = watchdog
        self.on_live_engines: Callable[[int], None] | None = None  # set for a gateway over several engines

    async def start(self) -> None:
        """One probe now (the frontend starts knowing its runtime's state), then every interval."""
        # A fresh connection per probe: a kept-alive one idles for the whole interval, and a
        # server that closes idle connections after about that long (uvicorn: 5 s, the default
        # interval) can close it just as the next probe is sent, which read as the runtime down.
        self._client = httpx.AsyncClient(base_url=self._runtime_url,
                                         timeout=httpx.Timeout(self.probe_timeout_s, connect=self._connect_timeout_s),
                                         limits=httpx.Limits(max_connections=1, max_keepalive_connections=0))
        await self.probe()
        self._task = asyncio.create_task(self._probe_forever())
        if self._watchdog is not None:
            self._watchdog.start()

    async def probe(self) -> Probe:
        assert self._client is not None, "start() first"
        try:
            status = (await self._client.get("/health")).status_code
            probe = Probe(status == 200, time.monotonic(), "" if status == 200 else f"runtime /health answered {status}")
        except httpx.HTTPError as exc:
            probe = Probe(False, time.monotonic(), f"runtime unreachable: {exc!r}")
        if self._last is not None and probe.ok != self._last.ok:
            logger.log(logging.INFO if probe.ok else logging.WARNING, "runtime %s",
                       "healthy again" if probe.ok else f"unhealthy: {probe.error}")
        self._last = probe
        if self.on_live_engines is not None:
            await self._count_live_engines()
        return probe

    async def _count_live_engines(self) -> None:
        try:
            live = int((await self._client.get("/readiness")).json()["healthy_workers"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return  # no count this time: what the last one said stands
        self.on_live_engines(live)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.probe()

    def mark_dead(self, reason: str) -> None:
        """The runtime is gone for good (its process exited): unhealthy from now on."""
        self._dead = reason

    def report(self) -> tuple[int, dict]:
        """The status code and body `/health` answers with."""
        if self._dead is not None:
            return 503, {"status": "runtime dead", "error": self._dead}
        if self._watchdog is not None and self._watchdog.stalled is not None:
            return 503, {"status": "scheduler stalled", "error": self._watchdog.stalled}
        last = self._last
        if last is None:
            return 503, {"status": "starting"}
        age = time.monotonic() - last.at
        body = {"checked_s_ago": round(age, 1)}
        if age > self.interval_s + self.probe_timeout_s + 1.0:  # the probing itself stopped
            return 503, {"status": "runtime probe overdue", **body}
        if not last.ok:
            return 503, {"status": "runtime unhealthy", "error": last.error, **body}
        return 200, {"status": "ok", **body}

    async def aclose(self) -> None:
        if self._watchdog is not None:
            await self._watchdog.aclose()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._client is not None:
            await self._client.aclose()


router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    status, body = request.app.state.health.report()
    # The start-up self-check: whether chunk-reusing policies are served as asked, and why not.
    body["selfcheck"] = frontend(request).rag.policies.gate.as_json()
    return JSONResponse(body, status)
