"""The picrag HTTP frontend: FastAPI in front of the SGLang runtime.

SGLang's native routes (`/generate`, `/get_model_info`, `/flush_cache`, ...) pass through
unchanged, streaming included, so unmodified SGLang clients and DSL scripts work against
picrag's port. picrag's own routes: `/rag/query` and `/rag/retrieve` (rag_server/api/rag_api.py),
RAG through `/v1/chat/completions` with a `picrag` field (rag_server/api/openai_chat.py), chunk
markers in `/generate` texts (rag_server/api/chunk_markers.py) and `/concate_and_append_request`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse

from rag_server.api.admission import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_QUEUE, Admission
from rag_server.api.auth import ApiKeyGuard
from rag_server.linking.chunk_compiler import ChunkCompiler, CompileError
from rag_server.api.chunk_markers import link_marked_payload
from rag_server.service.context_window import ContextLimits
from rag_server.linking.linked_generation import LinkedGenerator
from rag_server.api.openai_chat import rag_chat_completion
from rag_server.api.rag_api import MAX_BODY_BYTES
from rag_server.api.rag_api import router as rag_router
from rag_server.service.rag_service import DEFAULT_POLICY, RagService
from rag_server.linking.relink import MAX_RELINKS, chunk_misses, first_event, response_misses
from sglang_patches.link_hints import LinkHintError, parse_link_request, runtime_request, split_policy

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
    "/v1/loads": ["GET"],
    "/v1/models": ["GET"],
    "/v1/completions": ["POST"],
}
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}
# The API key is the frontend's: the runtime (loopback, no key) never sees it.
_CREDENTIAL_HEADERS = {"authorization", "x-api-key"}


class BodyLimit:
    """Refuse oversized bodies under `prefix` before reading them (pydantic limits the fields).

    Plain ASGI rather than an HTTP middleware, which would wrap every streamed response."""

    def __init__(self, app, prefix: str, max_bytes: int):
        self.app = app
        self.prefix = prefix
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            length = dict(scope["headers"]).get(b"content-length", b"0")
            if length.isdigit() and int(length) > self.max_bytes:
                response = JSONResponse({"detail": f"request body over {self.max_bytes} bytes"}, 413)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def linked_prompt_error(input_tokens: int, sampling: object, limits: ContextLimits) -> str | None:
    """Why the runtime would refuse this prompt, asked before its chunks are compiled: the
    runtime checks length only when the prompt arrives, after every chunk was computed (minutes
    on a CPU), and a chunk over the window makes the compile fail as if the runtime had."""
    if input_tokens > limits.max_input_tokens:
        return f"the prompt ({input_tokens} tokens) is longer than the runtime accepts ({limits.max_input_tokens})"
    max_new = sampling.get("max_new_tokens") if isinstance(sampling, dict) else None
    if isinstance(max_new, int) and input_tokens + max_new > limits.context_length:
        return (f"prompt ({input_tokens} tokens) plus max_new_tokens ({max_new}) exceed the context "
                f"length ({limits.context_length})")
    return None


class AsciiJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        # ASCII escapes: a lone surrogate (valid JSON, "\\ud800") echoed back is not UTF-8.
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
    """FastAPI's 422, which quotes the offending input, rendered so that any input can be quoted
    (the default response raised a 500 on an unpaired surrogate in a question)."""
    return AsciiJSONResponse({"detail": jsonable_encoder(exc.errors())}, 422)


def leading_special_tokens(tokenizer) -> list[int]:
    """What the tokenizer puts before any text (a BOS for some models, nothing for others)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    return list(full[: full.index(plain[0])]) if plain and plain[0] in full else []


async def _context_limits(client: httpx.AsyncClient, model_path: Path) -> ContextLimits:
    server_info = (await client.get("/get_server_info")).json()
    context_length = server_info.get("context_length")
    if not context_length:  # not set on the command line: the model's own
        config = json.loads((model_path / "config.json").read_text())
        context_length = config["max_position_embeddings"]
    return ContextLimits(
        context_length=int(context_length),
        max_input_tokens=int(server_info.get("max_req_input_len") or context_length),
    )


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _open_index(index_dir: Path):
    from retrieval.retriever import Retriever

    return Retriever.open(index_dir)


def create_app(
    runtime_url: str,
    *,
    model_path: Path | None = None,
    index_dir: Path | None = None,
    default_policy: str = DEFAULT_POLICY,
    unavailable_policies: Mapping[str, str] | None = None,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
    max_queue: int = DEFAULT_MAX_QUEUE,
) -> FastAPI:
    """The frontend for a runtime that is already up. `model_path` (default: the runtime's)
    gives the tokenizer and context window; `index_dir` the passage index to retrieve from.
    `api_key`: required on every route but /health; `cors_origins`: browser origins allowed
    (none: no CORS headers); `max_inflight` requests run at once, `max_queue` more wait, 503
    beyond (rag_server/api/admission.py). `unavailable_policies`: policy family -> why this server
    refuses it (cacherepair without a checkpoint for the model)."""
    unavailable = dict(unavailable_policies or {})
    try:
        default_family, _ = split_policy(default_policy)
    except LinkHintError as exc:
        raise ValueError(f"default policy: {exc}") from exc
    if default_family in unavailable:
        raise ValueError(f"default policy {default_policy!r} is unavailable: {unavailable[default_family]}")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # No read timeout: a long prefill on CPU can take minutes before the first byte.
        app.state.client = httpx.AsyncClient(
            base_url=runtime_url, timeout=httpx.Timeout(10.0, read=None)
        )
        app.state.compiler = ChunkCompiler(app.state.client)
        try:
            info = (await app.state.client.get("/get_model_info")).json()
            app.state.model_name = info.get("served_model_name") or info["model_path"]
            model_dir = Path(model_path or info["model_path"])
            tokenizer = await asyncio.to_thread(_load_tokenizer, Path(info.get("tokenizer_path") or model_dir))
            retriever = await asyncio.to_thread(_open_index, index_dir) if index_dir else None
            app.state.rag = RagService(
                tokenizer,
                LinkedGenerator(app.state.client, app.state.compiler, sink_token=tokenizer.bos_token_id),
                await _context_limits(app.state.client, model_dir),
                retriever=retriever,
                default_policy=default_policy,
                unavailable_policies=unavailable,
            )
            app.state.special_prefix = leading_special_tokens(tokenizer)
            yield
        finally:
            await app.state.client.aclose()

    app = FastAPI(title="picrag", version="0.1.0", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.include_router(rag_router)

    # Added innermost first. CORS outermost, so that preflights (which carry no key) are
    # answered and 401/503 answers carry CORS headers a browser can read; the key check before
    # admission, so that requests without the key never take a slot.
    app.add_middleware(BodyLimit, prefix="/rag/", max_bytes=MAX_BODY_BYTES)
    app.add_middleware(Admission, max_inflight=max_inflight, max_queue=max_queue)
    if api_key:
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.get("/health")
    async def health() -> Response:
        try:
            upstream = await app.state.client.get("/health", timeout=10.0)
        except httpx.HTTPError as exc:
            return JSONResponse({"status": "runtime unreachable", "error": str(exc)}, 503)
        if upstream.status_code != 200:
            return JSONResponse({"status": "runtime unhealthy"}, 503)
        return JSONResponse({"status": "ok"})

    async def send(request: Request, body: bytes | None = None) -> httpx.Response:
        client: httpx.AsyncClient = app.state.client
        upstream_request = client.build_request(
            request.method,
            request.url.path,
            params=request.query_params,
            content=await request.body() if body is None else body,
            headers={k: v for k, v in request.headers.items()
                     if k.lower() not in {"host", *_HOP_HEADERS, *_CREDENTIAL_HEADERS}},
        )
        return await client.send(upstream_request, stream=True)

    def relay(upstream: httpx.Response, read: bytes = b"", rest: AsyncIterator[bytes] | None = None) -> Response:
        """The runtime's stream as the client's (`read`: bytes already taken from `rest`, the
        stream's one raw iterator, when part of it was read)."""
        async def chunks():
            try:
                if read:
                    yield read
                async for chunk in rest or upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(chunks(), status_code=upstream.status_code, headers=relayed_headers(upstream))

    def relayed_headers(upstream: httpx.Response) -> dict[str, str]:
        return {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}

    def is_stream(upstream: httpx.Response) -> bool:
        return upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def forward(request: Request, body: bytes | None = None) -> Response:
        try:
            upstream = await send(request, body)
        except httpx.HTTPError as exc:
            logger.error("runtime request %s failed: %s", request.url.path, exc)
            return JSONResponse({"error": f"runtime unavailable: {exc}"}, 503)
        if is_stream(upstream):
            return relay(upstream)
        data = await upstream.aread()
        await upstream.aclose()
        return Response(data, status_code=upstream.status_code, headers=relayed_headers(upstream))

    async def linked_generate(request: Request, input_ids: list[int], link, body: bytes) -> Response:
        """Compile (skipping pieces compiled before), link, and relink if the engine reports a
        chunk missing (rag_server.linking.relink)."""
        for attempt in range(MAX_RELINKS + 1):
            last = attempt == MAX_RELINKS
            try:
                await app.state.compiler.prepare(input_ids, link, skip_known=attempt == 0)
                upstream = await send(request, body)
            except (CompileError, httpx.HTTPError) as exc:
                logger.error("linked /generate failed: %s", exc)
                return JSONResponse({"error": {"message": str(exc), "type": "compile_failed"}}, 503)
            if is_stream(upstream):
                rest = upstream.aiter_raw()
                read, event = await first_event(rest)
                if last or not chunk_misses((event or {}).get("meta_info")):
                    return relay(upstream, read, rest)
            else:
                data = await upstream.aread()
                if last or upstream.status_code != 200 or not response_misses(data):
                    await upstream.aclose()
                    return Response(data, status_code=upstream.status_code, headers=relayed_headers(upstream))
            await upstream.aclose()
            app.state.compiler.note_eviction()
            logger.warning("chunks not in the store at link time: compiling again (retry %d)", attempt + 1)
        raise AssertionError("the last attempt always answers")

    @app.post("/generate", include_in_schema=False)
    async def generate(request: Request) -> Response:
        """SGLang's /generate; prompts with a picrag.link hint get their chunks compiled first."""
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError:
            return await forward(request, body)  # SGLang answers malformed JSON itself
        if not isinstance(payload, dict):
            return await forward(request, body)
        if not payload.get("kv_hints"):
            rag: RagService = app.state.rag
            marked = link_marked_payload(payload, rag.layout.encode, app.state.special_prefix, rag.default_policy)
            if marked is None:
                return await forward(request, body)
            payload, body = marked, json.dumps(marked).encode()
        try:
            link = parse_link_request(payload["kv_hints"])
            if link is not None and link.policy == "legolink0" and link.sink_token is None:
                link = dataclasses.replace(link, sink_token=app.state.rag.generator.sink_token)
            if link is not None and not link.compile:
                input_ids = payload.get("input_ids")
                if not (isinstance(input_ids, list) and all(isinstance(t, int) for t in input_ids)):
                    raise LinkHintError(
                        "picrag.link chunk spans index input_ids: send one prompt as a flat input_ids list"
                    )
                link.validate(len(input_ids))
                app.state.rag.check_available(link.policy)
        except LinkHintError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_kv_hints"}}, 400)
        if link is not None and not link.compile:
            too_long = linked_prompt_error(len(input_ids), payload.get("sampling_params"), app.state.rag.limits)
            if too_long:
                return JSONResponse({"error": {"message": too_long, "type": "prompt_too_long"}}, 400)
            payload["input_ids"], payload["kv_hints"] = runtime_request(input_ids, link)
            return await linked_generate(request, input_ids, link, json.dumps(payload).encode())
        response = await forward(request, body)
        if link is not None and link.compile and response.status_code == 200:
            pieces = payload.get("input_ids")
            if isinstance(pieces, list) and pieces and all(isinstance(t, int) for t in pieces):
                pieces = [pieces]
            if isinstance(pieces, list) and all(isinstance(p, list) for p in pieces):
                app.state.compiler.remember_compiled(pieces)
        return response

    @app.post("/v1/chat/completions", include_in_schema=False)
    async def chat_completions(request: Request) -> Response:
        """SGLang's chat endpoint, or RAG when the body carries a `picrag` field."""
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError:
            return await forward(request, body)
        if not (isinstance(payload, dict) and "picrag" in payload):
            return await forward(request, body)
        return await rag_chat_completion(app.state.rag, payload, app.state.model_name)

    @app.post("/concate_and_append_request", include_in_schema=False)
    async def concate_and_append_request(request: Request) -> Response:
        """The DSL's `join(mode="concate_and_append")`; SGLang 0.5.23 dropped the route.

        By the time the DSL calls it, it has already appended the forks' texts to the parent's
        text, and every later `/generate` sends that whole text, so acknowledging is enough for
        correct results. The forks' KV is not spliced: the radix cache reuses the common
        prefix, and passages wrapped in `rag_server.dsl.chunk` are reused at any position.
        """
        try:
            payload = json.loads(await request.body())
        except ValueError:
            payload = None
        if not (isinstance(payload, dict) and isinstance(payload.get("src_rids"), list)
                and isinstance(payload.get("dst_rid"), str)):
            return JSONResponse({"error": {"message": "expected {\"src_rids\": [...], \"dst_rid\": \"...\"}"}}, 400)
        return JSONResponse({"success": True})

    async def flush_cache(request: Request) -> Response:
        """SGLang's flush; the compiler forgets what it compiled, since nothing is stored now."""
        app.state.compiler.forget()
        return await forward(request)

    for path, methods in PASSTHROUGH_ROUTES.items():
        handler = flush_cache if path == "/flush_cache" else forward
        app.add_api_route(path, handler, methods=methods, include_in_schema=False)
    return app
