"""The page for people: `GET /` asks questions and shows the server live, and the JSON it reads.

The page is three static files (rag_server/api/static/: HTML, JS, CSS; charts are drawn as SVG
by page.js, no library, no build step). They hold no data, so they are served without the API key
(PAGE_PATHS, open in rag_server/api/auth.py); everything the page reads comes from keyed routes,
with the key the user typed into the page:

- `GET /picrag/policies`: the policy menu: every family of picrag_core.policies with whether
  this server serves it, then `auto`, and the default (rag_server/linking/policy_resolver.py);
- `GET /picrag/stats`: RAG answers per policy with their TTFT p50/p90
  (rag_server/api/request_stats.py), and the engines' picrag counters from their /metrics;
- `POST /rag/query` with `"stream": true` for the answer, and `GET /picrag/quality` for the
  shadow-quality panel, shown only where the server answers it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from rag_server.api.request_stats import request_stats
from rag_server.api.runtime_metrics import MetricsUnavailable, picrag_counters
from rag_server.api.state import frontend

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
# URL path -> (file in STATIC_DIR, media type).
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/page.css": ("page.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset(PAGE_FILES)

router = APIRouter(tags=["page"])


def _page_file(path: str):
    name, media_type = PAGE_FILES[path]

    async def serve() -> FileResponse:
        # no-cache: a browser revalidates, so a restarted server's new page is seen at once.
        return FileResponse(STATIC_DIR / name, media_type=media_type, headers={"Cache-Control": "no-cache"})

    return serve


for _path in PAGE_FILES:
    router.add_api_route(_path, _page_file(_path), methods=["GET"], include_in_schema=False)


@router.get("/picrag/policies")
async def policies(request: Request) -> dict:
    """The policies this server knows, each with whether it serves them (and why not), and the default."""
    policies = frontend(request).rag.policies
    return {"default": policies.default.name, "policies": policies.menu()}


@router.get("/picrag/stats")
async def stats(request: Request) -> dict:
    """The frontend's RAG answers per policy (requests, tokens, TTFT p50/p90 in ms) and the
    engines' picrag counters, summed (`cache`: null, with `cache_error`, when no engine's /metrics answers)."""
    summary = request_stats(request).summary()
    try:
        status, text, _ = await request.app.state.engine_metrics.exposition()
        if status != 200:
            raise MetricsUnavailable(f"status {status}", status)
        counters = picrag_counters(text)
    except MetricsUnavailable as exc:
        logger.warning("runtime /metrics for /picrag/stats failed: %s", exc)
        return {**summary, "cache": None, "cache_error": f"runtime /metrics: {exc}"}
    return {**summary, "cache": {"counters": counters, "chunk_hit_rate": hit_rate(counters)}, "cache_error": None}


def hit_rate(counters: dict[str, float]) -> float | None:
    """Chunks of linked requests found cached over all their chunks; None before any."""
    hits, misses = counters.get("chunk_hits", 0.0), counters.get("chunk_misses", 0.0)
    return hits / (hits + misses) if hits + misses else None
