"""`GET /picrag/quality` (JSON) and `GET /picrag/metrics` (Prometheus): the first-token quality that
shadow sampling measures on live traffic (rag_server/service/shadow.py), its cost, and how `auto`
decides (rag_server/service/auto_policy.py); the metrics also count the frontend's relinks and
the prompts it linked with passages it found in them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from rag_server.api.state import frontend

router = APIRouter(tags=["quality"])


@router.get("/picrag/quality")
async def quality(request: Request) -> dict[str, Any]:
    """Per policy and prompt-size bucket, all-time and recent: shadow samples, mean first-token KL
    to full (exact) and agreement; the shadow cost; `auto`'s target and table."""
    control = frontend(request).rag.quality
    auto = control.auto
    return {
        **control.record.as_json(),
        "shadow_settings": vars(control.shadow.settings),
        "auto": {"quality_target": auto.target, "min_samples": auto.min_samples,
                 "calibration": auto.table.as_json() if auto.table else None},
    }


RELINKS_METRIC = "picrag_frontend_relinks_total"
DISCOVERED_METRIC = "picrag_frontend_discovered_prompts_total"


def _counter(name: str, help_text: str, value: int) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} counter\n{name} {value}\n"


@router.get("/picrag/metrics")
async def metrics(request: Request) -> Response:
    state = frontend(request)
    counters = (_counter(RELINKS_METRIC, "links sent again because a chunk was missing from the store",
                         state.pipeline.relinks)
                + _counter(DISCOVERED_METRIC, "chat, completions and /generate prompts linked with the passages "
                           "found in them", state.discovery.found))
    return Response(state.rag.quality.metrics.exposition() + counters.encode(), media_type=CONTENT_TYPE_LATEST)
