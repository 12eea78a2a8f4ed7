"""`GET /metrics`: the engines' Prometheus metrics, fetched over connection pools of their own.

/metrics is never queued (rag_server/api/admission.py): monitoring must answer when the server
is saturated. Relayed over the runtime client, each scrape took a connection of the pool real
requests use, so a flood of scrapes against a slow runtime could take all of them. Here scrapes
share CONNECTIONS connections per engine: a flood waits for those (or gives up after
FETCH_TIMEOUT_S), and real requests never wait for a scrape. Every scrape is fetched when asked,
so counters read after a request include it.

Behind the gateway (`picrag serve --replicas N`, `--worker-url`) the engines are scraped each,
not through the gateway: the gateway's own /metrics holds none of the engines' counters, and a
reader of picrag's counters (`/picrag/stats`, the benches) would have read nothing. Their
expositions are merged into one, every sample labelled with its engine (`engine="0"`...), the
way a Prometheus server labels the targets it scrapes; an engine that does not answer is left
out and counted in `picrag_metrics_engines_unreachable`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Sequence

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

CONNECTIONS = 2
FETCH_TIMEOUT_S = 30.0
COUNTER_PREFIX = "picrag_"
ENGINE_LABEL = "engine"
EXPOSITION_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsUnavailable(Exception):
    """No engine answered /metrics; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass
class EngineMetrics:
    """A scrape client per engine (one: its exposition relayed as it is; several: merged)."""

    clients: tuple[httpx.AsyncClient, ...]

    @classmethod
    def open(cls, engine_urls: Sequence[str], connect_timeout_s: float) -> "EngineMetrics":
        timeout = httpx.Timeout(FETCH_TIMEOUT_S, connect=connect_timeout_s)
        return cls(tuple(httpx.AsyncClient(base_url=url, timeout=timeout,
                                           limits=httpx.Limits(max_connections=CONNECTIONS))
                         for url in engine_urls))

    async def exposition(self) -> tuple[int, str, str]:
        """(status, metrics text, content type): one engine's answer as it is, or several engines'
        merged from those that answer 200; MetricsUnavailable when none can be reached."""
        answers = await asyncio.gather(*(_scrape(client) for client in self.clients))
        reached = [answer for answer in answers if isinstance(answer, httpx.Response)]
        if len(self.clients) == 1 and reached:
            (response,) = reached
            return response.status_code, response.text, response.headers.get("content-type", "text/plain")
        texts = {str(i): answer.text for i, answer in enumerate(answers)
                 if isinstance(answer, httpx.Response) and answer.status_code == 200}
        for i, answer in enumerate(answers):
            if str(i) not in texts:
                logger.warning("engine %d (%s) /metrics failed: %s", i, self.clients[i].base_url,
                               repr(answer) if isinstance(answer, Exception) else f"status {answer.status_code}")
        if not texts:
            errors = [answer for answer in answers if isinstance(answer, Exception)]
            status = 504 if errors and all(isinstance(e, httpx.TimeoutException) for e in errors) else 503
            raise MetricsUnavailable(f"runtime unavailable: {errors[0] if errors else 'no engine answered 200'!r}", status)
        return 200, merged_exposition(texts, len(self.clients) - len(texts)), EXPOSITION_TYPE

    async def aclose(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self.clients))


async def _scrape(client: httpx.AsyncClient) -> httpx.Response | httpx.HTTPError:
    try:
        return await client.get("/metrics")
    except httpx.HTTPError as exc:
        return exc


def merged_exposition(texts: dict[str, str], unreachable: int = 0) -> str:
    """One Prometheus text exposition of several engines' (`texts` by engine label): each family
    once, with every engine's samples labelled `engine="<label>"`."""
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.utils import floatToGoString

    families: dict[str, tuple[str, str, list[str]]] = {}
    for engine, text in texts.items():
        for family in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(family.name, (family.type, family.documentation, []))
            for sample in family.samples:
                labels = {**sample.labels, ENGINE_LABEL: engine}
                rendered = ",".join(f'{key}="{_escaped(value)}"' for key, value in labels.items())
                lines.append(f"{sample.name}{{{rendered}}} {floatToGoString(sample.value)}")
    out: list[str] = []
    for name, (kind, documentation, lines) in families.items():
        # The parser drops a counter's `_total` (an info's `_info`) from the family name; the text
        # format names the family as its samples are named.
        name += {"counter": "_total", "info": "_info"}.get(kind, "")
        out += [f"# HELP {name} {_escaped_help(documentation)}", f"# TYPE {name} {kind}", *lines]
    out += ["# HELP picrag_metrics_engines_unreachable Engines whose /metrics did not answer this scrape.",
            "# TYPE picrag_metrics_engines_unreachable gauge", f"picrag_metrics_engines_unreachable {unreachable}"]
    return "\n".join(out) + "\n"


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escaped_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def picrag_counters(metrics_text: str) -> dict[str, float]:
    """Every picrag counter in a Prometheus text exposition (the engine's /metrics, the frontend's
    /picrag/metrics), by its name without the prefix (`picrag_chunk_hits_total` -> `chunk_hits`),
    summed over label sets (one per process or engine, or per policy and prompt size)."""
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
    engines: EngineMetrics = request.app.state.engine_metrics
    try:
        status, text, content_type = await engines.exposition()
    except MetricsUnavailable as exc:
        logger.error("runtime /metrics failed: %s", exc)
        return JSONResponse({"error": str(exc)}, exc.status)
    return Response(text, status, media_type=content_type)
