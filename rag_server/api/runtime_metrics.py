"""`GET /metrics`: SGLang's Prometheus metrics, from a cache filled on a connection of its own.

/metrics is never queued (rag_server/api/admission.py): monitoring must answer when the server
is saturated. Relayed over the runtime client, each scrape would take a connection of the pool
real requests use, and a flood of scrapes against a slow runtime could take all of them. Here
one fetch runs at a time, on a connection of its own, and its answer serves every scrape for
MAX_AGE_S: a flood costs the runtime one request a second and real requests nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Optional

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

MAX_AGE_S = 1.0
FETCH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Scrape:
    status: int
    body: bytes
    content_type: str
    at: float  # time.monotonic() when fetched


class MetricsCache:
    def __init__(self, runtime_url: str, connect_timeout_s: float, max_age_s: float = MAX_AGE_S):
        self.max_age_s = max_age_s
        self._client = httpx.AsyncClient(base_url=runtime_url,
                                         timeout=httpx.Timeout(FETCH_TIMEOUT_S, connect=connect_timeout_s),
                                         limits=httpx.Limits(max_connections=1))
        self._last: Optional[Scrape] = None
        self._fetch: Optional[asyncio.Task[Scrape]] = None

    async def scrape(self) -> Scrape:
        """The runtime's metrics at most `max_age_s` old; every caller shares the fetch in flight."""
        last = self._last
        if last is not None and time.monotonic() - last.at <= self.max_age_s:
            return last
        if self._fetch is None:
            self._fetch = asyncio.create_task(self._fetched())
            self._fetch.add_done_callback(lambda _: setattr(self, "_fetch", None))
        # Shielded: a scraper that leaves does not cancel the fetch the others wait for.
        return await asyncio.shield(self._fetch)

    async def _fetched(self) -> Scrape:
        response = await self._client.get("/metrics")
        scrape = Scrape(response.status_code, response.content, response.headers.get("content-type", "text/plain"),
                        time.monotonic())
        self._last = scrape
        return scrape

    async def aclose(self) -> None:
        if self._fetch is not None:
            self._fetch.cancel()
        await self._client.aclose()


router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    try:
        scrape = await request.app.state.metrics.scrape()
    except httpx.HTTPError as exc:
        logger.error("runtime /metrics failed: %r", exc)
        return JSONResponse({"error": f"runtime unavailable: {exc!r}"}, 504 if isinstance(exc, httpx.TimeoutException)
                            else 503)
    return Response(scrape.body, scrape.status, media_type=scrape.content_type)
