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
COUNTER_PREFIX = "picrag_"


def metrics_client(runtime_url: str, connect_timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=runtime_url, timeout=httpx.Timeout(FETCH_TIMEOUT_S, connect=connect_timeout_s),
                             limits=httpx.Limits(max_connections=CONNECTIONS))


def picrag_counters(metrics_text: str) -> dict[str, float]:
    """Every picrag counter in a Prometheus text exposition (the engine's /metrics, the frontend's
    /picrag/metrics), by its name without the prefix (`picrag_chunk_hits_total` -> `chunk_hits`),
    summed over label sets (one per process, or per policy and prompt size)."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.type != "counter" or not family.name.startswith(COUNTER_PREFIX):
            continue
        total = sum(s.value for s in family.samples if s.name == f"{family.name}_total")
        counters[family.name.removeprefix(COUNTER_PREFIX)] = total
    return counters


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
