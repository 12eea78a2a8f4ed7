"""The picrag HTTP frontend: FastAPI in front of the SGLang runtime.

SGLang's native routes pass through unchanged, streaming included (rag_server/api/proxy.py), so
unmodified SGLang clients and DSL scripts work against picrag's port. picrag's own routes:
`/rag/query` and `/rag/retrieve` (rag_server/api/rag_api.py), RAG through `/v1/chat/completions`
with a `picrag` field (rag_server/api/openai_chat.py), `/generate` with link hints or chunk
markers and the DSL's `/concate_and_append_request` (rag_server/api/native_routes.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware

from rag_server.api import health, native_routes, openai_chat, page, proxy, quality_routes, rag_api, runtime_metrics
from rag_server.api.admission import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_QUEUE, Admission
from rag_server.api.auth import AccessGuard
from rag_server.api.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from rag_server.api.client_timeouts import DEFAULT_CLIENT_IDLE_TIMEOUT_S, ClientTimeouts
from rag_server.api.health import DEFAULT_INTERVAL_S, HealthMonitor
from rag_server.api.progress_watchdog import ProgressWatchdog
from rag_server.api.runtime_metrics import EngineMetrics
from rag_server.api.request_stats import RequestStats
from rag_server.api.state import Frontend, FrontendSettings
from rag_server.api.upstream import UpstreamTimeouts
from rag_server.api.validation_errors import validation_error
from rag_server.linking.chunk_discovery import DiscoverySettings
from rag_server.linking.policy_resolver import PolicyResolver
from rag_server.service.quality import QualitySettings


def create_app(
    runtime_url: str,
    *,
    model_path: Path | None = None,
    index_dir: Path | None = None,
    policies: PolicyResolver | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    timeouts: UpstreamTimeouts = UpstreamTimeouts(),
    health_interval_s: float = DEFAULT_INTERVAL_S,
    quality: QualitySettings = QualitySettings(),
    pass_unlisted_fields: bool = False,
    discovery: DiscoverySettings = DiscoverySettings(),
    client_idle_timeout_s: float = DEFAULT_CLIENT_IDLE_TIMEOUT_S,
    watchdog_timeout_s: float | None = None,
    on_stall: Callable[[str], None] | None = None,
    engine_urls: Sequence[str] = (),
) -> FastAPI:
    """The frontend for a runtime that is already up. `model_path` (default: the runtime's)
    gives the tokenizer and context window; `index_dir` the passage index to retrieve from.
    `api_key`: required on every route but /health; `admin_api_key`: required on the admin
    routes (none: those answer loopback clients only; rag_server/api/auth.py); `cors_origins`:
    browser origins allowed (none: no CORS headers); `max_inflight` requests run at once,
    `max_queue` more wait, 503 beyond (rag_server/api/admission.py); request bodies over
    `max_body_bytes` are refused (rag_server/api/body_limit.py); `timeouts` bound every call to
    the runtime (rag_server/api/upstream.py); `/health` reports the runtime's state as probed
    every `health_interval_s` (rag_server/api/health.py). `policies`: the default, availability
    and fallback of link policies (rag_server/linking/policy_resolver.py; None: the default
    resolver, every policy served). `quality`: the `auto` policy's target and table, and shadow
    sampling (rag_server/service/quality.py). `pass_unlisted_fields`: forward body fields the allowlist does not list
    (rag_server/api/forwarded_bodies.py). `discovery`: finding passages in whole prompts
    (rag_server/linking/chunk_discovery.py). `client_idle_timeout_s`: how long a client may stall
    its body or its answer (rag_server/api/client_timeouts.py). `watchdog_timeout_s`: a scheduler
    with work and no progress for this long makes /health 503 and calls `on_stall`
    (rag_server/api/progress_watchdog.py; None: no watchdog). `engine_urls`: the engines behind
    `runtime_url` when it is the gateway's (replicas): linked prompts in flight share that many KV
    pools (rag_server/linking/kv_budget.py), and /metrics scrapes each (rag_server/api/runtime_metrics.py);
    none: `runtime_url` is the one engine."""
    settings = FrontendSettings(runtime_url, policies or PolicyResolver.start(), model_path, index_dir, timeouts,
                                quality, pass_unlisted_fields=pass_unlisted_fields, discovery=discovery,
                                engines=max(1, len(engine_urls)))

    app = FastAPI(title="picrag", version="0.1.0", lifespan=lambda app: _running(app, settings))
    watchdog = None if watchdog_timeout_s is None else ProgressWatchdog(
        runtime_url, watchdog_timeout_s, health_interval_s, timeouts.connect_s, on_stall)
    app.state.health = HealthMonitor(runtime_url, health_interval_s, timeouts.connect_s, watchdog=watchdog)
    app.state.engine_metrics = EngineMetrics.open(tuple(engine_urls) or (runtime_url,), timeouts.connect_s)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.state.request_stats = RequestStats()
    for routes in (health, page, rag_api, openai_chat, quality_routes, native_routes, runtime_metrics, proxy):
        app.include_router(routes.router)

    # Added innermost first. CORS outermost, so that preflights (which carry no key) are
    # answered and 401/503 answers carry CORS headers a browser can read; the key check before
    # admission, so that requests without the key never take a slot; the body limit inside
    # admission, so that bodies read at once are at most one per slot; the client timeouts
    # between them, so that a slow client gives its slot back.
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, prefix_limits={"/rag/": rag_api.MAX_BODY_BYTES})
    app.add_middleware(ClientTimeouts, idle_timeout_s=client_idle_timeout_s)
    app.add_middleware(Admission, max_inflight=max_inflight, max_queue=max_queue)
    app.add_middleware(AccessGuard, api_key=api_key or None, admin_api_key=admin_api_key or None)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app


@asynccontextmanager
async def _running(app: FastAPI, settings: FrontendSettings) -> AsyncIterator[None]:
    app.state.frontend = await Frontend.open(settings)
    if settings.engines > 1:  # behind the gateway: the KV budget follows the engines it routes to
        app.state.health.on_live_engines = app.state.frontend.engines_live
    try:
        await app.state.health.start()
        yield
    finally:
        await app.state.health.aclose()
        await app.state.engine_metrics.aclose()
        await app.state.frontend.aclose()
