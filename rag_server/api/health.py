"""`GET /health`: the frontend is healthy when its runtime is (open even with an API key)."""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from rag_server.api.state import frontend

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    try:
        upstream = await frontend(request).client.get("/health", timeout=10.0)
    except httpx.HTTPError as exc:
        return JSONResponse({"status": "runtime unreachable", "error": str(exc)}, 503)
    if upstream.status_code != 200:
        return JSONResponse({"status": "runtime unhealthy"}, 503)
    return JSONResponse({"status": "ok"})
