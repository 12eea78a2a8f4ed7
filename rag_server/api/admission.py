"""Admission control: a bounded number of requests in flight, a small queue, 503 beyond.

Every admitted request holds memory in the frontend and the runtime (prompt, KV, streamed
output) until its response ends, so past `max_inflight` running and `max_queue` waiting the
frontend answers 503 with `Retry-After` at once instead of letting memory grow with the
offered load. Plain ASGI, so a streamed response keeps its slot until its last byte (or the
client's disconnect) and no response is buffered.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse

DEFAULT_MAX_INFLIGHT = 64
DEFAULT_MAX_QUEUE = 16
RETRY_AFTER_S = 1
# Probes and monitoring must still answer when the server is saturated: that is when they matter.
UNLIMITED_PATHS = frozenset({"/health", "/metrics"})


class Admission:
    def __init__(self, app, max_inflight: int = DEFAULT_MAX_INFLIGHT, max_queue: int = DEFAULT_MAX_QUEUE,
                 retry_after_s: int = RETRY_AFTER_S):
        if max_inflight < 1 or max_queue < 0:
            raise ValueError(f"need max_inflight >= 1 and max_queue >= 0, not {max_inflight}, {max_queue}")
        self.app = app
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self._slots = asyncio.Semaphore(max_inflight)
        self._waiting = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            return await self.app(scope, receive, send)
        if self._slots.locked() and self._waiting >= self.max_queue:
            response = JSONResponse(
                {"detail": "server busy: too many requests in flight, retry later"},
                503,
                headers={"Retry-After": str(self.retry_after_s)},
            )
            return await response(scope, receive, send)
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._slots.release()
