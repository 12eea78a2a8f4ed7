"""The picrag HTTP frontend: FastAPI in front of the SGLang runtime.

SGLang's native routes (`/generate`, `/get_model_info`, `/flush_cache`, ...) pass through
unchanged, streaming included, so unmodified SGLang clients and DSL scripts work against
picrag's port.
"""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from rag_server.chunk_compiler import ChunkCompiler, CompileError
from sglang_patches.link_hints import LinkHintError, parse_link_request

logger = logging.getLogger(__name__)

# SGLang routes the frontend forwards as they are.
PASSTHROUGH_ROUTES: dict[str, list[str]] = {
    "/get_model_info": ["GET"],
    "/model_info": ["GET"],
    "/get_server_info": ["GET"],
    "/server_info": ["GET"],
    "/flush_cache": ["GET", "POST"],
    "/abort_request": ["POST"],
    "/metrics": ["GET"],
    "/v1/models": ["GET"],
    "/v1/completions": ["POST"],
    "/v1/chat/completions": ["POST"],
}
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def create_app(runtime_url: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # No read timeout: a long prefill on CPU can take minutes before the first byte.
        app.state.client = httpx.AsyncClient(
            base_url=runtime_url, timeout=httpx.Timeout(10.0, read=None)
        )
        app.state.compiler = ChunkCompiler(app.state.client)
        yield
        await app.state.client.aclose()

    app = FastAPI(title="picrag", version="0.1.0", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        try:
            upstream = await app.state.client.get("/health", timeout=10.0)
        except httpx.HTTPError as exc:
            return JSONResponse({"status": "runtime unreachable", "error": str(exc)}, 503)
        if upstream.status_code != 200:
            return JSONResponse({"status": "runtime unhealthy"}, 503)
        return JSONResponse({"status": "ok"})

    async def forward(request: Request, body: bytes | None = None) -> Response:
        client: httpx.AsyncClient = app.state.client
        upstream_request = client.build_request(
            request.method,
            request.url.path,
            params=request.query_params,
            content=await request.body() if body is None else body,
            headers={k: v for k, v in request.headers.items() if k.lower() not in {"host", *_HOP_HEADERS}},
        )
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            logger.error("runtime request %s failed: %s", request.url.path, exc)
            return JSONResponse({"error": f"runtime unavailable: {exc}"}, 503)
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            async def relay():
                try:
                    async for chunk in upstream.aiter_raw():
                        yield chunk
                finally:
                    await upstream.aclose()

            return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)
        body = await upstream.aread()
        await upstream.aclose()
        return Response(body, status_code=upstream.status_code, headers=headers)

    @app.post("/generate", include_in_schema=False)
    async def generate(request: Request) -> Response:
        """SGLang's /generate; prompts with a picrag.link hint get their chunks compiled first."""
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError:
            return await forward(request, body)  # SGLang answers malformed JSON itself
        if not isinstance(payload, dict) or not payload.get("kv_hints"):
            return await forward(request, body)
        try:
            link = parse_link_request(payload["kv_hints"])
            if link is not None and not link.compile:
                input_ids = payload.get("input_ids")
                if not (isinstance(input_ids, list) and all(isinstance(t, int) for t in input_ids)):
                    raise LinkHintError(
                        "picrag.link chunk spans index input_ids: send one prompt as a flat input_ids list"
                    )
                link.validate(len(input_ids))
        except LinkHintError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_kv_hints"}}, 400)
        if link is not None and not link.compile:
            try:
                await app.state.compiler.prepare(input_ids, link)
            except (CompileError, httpx.HTTPError) as exc:
                logger.error("chunk compile failed: %s", exc)
                return JSONResponse({"error": {"message": str(exc), "type": "compile_failed"}}, 503)
        return await forward(request, body)

    for path, methods in PASSTHROUGH_ROUTES.items():
        app.add_api_route(path, forward, methods=methods, include_in_schema=False)
    return app
