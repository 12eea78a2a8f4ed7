"""`GET /metrics`: SGLang's Prometheus metrics, fetched over a connection pool of their own.

/metrics is never queued (rag_server/api/admission.py): monitoring must answer when the server
is saturated. Relayed over the runtime client, each scrape took a connection of the pool real
requests use, so a flood of scrapes against a slow runtime could take all of them. Here scrapes
share CONNECTIONS connections of their own: a flood waits for those (or gives up after
FETCH_TIMEOUT_S), and real requests never wait for a scrape. Every scrape is fetched when asked,
so counters read after a request include it.
"""

from __future__ import annotations

import logging

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

CONNECTIONS = 2
FETCH_TIMEOUT_S = 30.0


def metrics_client(runtime_url: str, connect_timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=runtime_url, timeout=httpx.Timeout(FETCH_TIMEOUT_S, connect=connect_timeout_s),
                             limits=httpx.Limits(max_connections=CONNECTIONS))


router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    client: httpx.AsyncClient = request.app.state.metrics_client
    try:
        upstream = await client.get("/metrics")
    except httpx.HTTPError as exc:
        logger.error("runtime /metrics failed: %r", exc)
        status = 504 if isinstance(exc, httpx.TimeoutException) else 503
        return JSONResponse({"error": f"runtime unavailable: {exc!r}"}, status)
    return Response(upstream.content, upstream.status_code,
                    media_type=upstream.headers.get("content-type", "text/plain"))
