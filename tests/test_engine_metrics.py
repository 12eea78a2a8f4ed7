"""/metrics and /picrag/stats behind the gateway read every engine's counters (rag_server/api/runtime_metrics.py).

The rule: picrag's counters, read through picrag serve, cover every engine that serves. Behind
the gateway they were read through it, and the gateway's own /metrics holds none of the engines'
counters: the half-hour soak with two replicas sampled 0 chunk hits every minute. Fake engines
and a fake gateway here, each with a /metrics of its own."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rag_server.api.runtime_metrics import merged_exposition, picrag_counters
from tests.fake_runtime import FakeRuntime
from tests.inprocess_frontend import serving

HISTOGRAM = """# HELP sglang_time_to_first_token_seconds TTFT.
# TYPE sglang_time_to_first_token_seconds histogram
sglang_time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 1.0
sglang_time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 2.0
sglang_time_to_first_token_seconds_count{model_name="m"} 2.0
sglang_time_to_first_token_seconds_sum{model_name="m"} 1.25
"""


def engine_text(hits: int) -> str:
    return (f"# HELP picrag_chunk_hits_total Chunks found.\n# TYPE picrag_chunk_hits_total counter\n"
            f"picrag_chunk_hits_total{{pid=\"7\"}} {hits}.0\n" + HISTOGRAM)


class MetricsServer(FakeRuntime):
    """A fake engine or gateway whose /metrics answers `text` (None: a 500)."""

    def __init__(self, model_dir, text: str | None):
        super().__init__(model_dir)
        self.text = text

    async def _metrics(self, request: Request) -> Response:
        await self._count(request)
        if self.text is None:
            return Response("down", 500)
        return Response(self.text, media_type="text/plain; version=0.0.4")

    def app(self):
        app = super().app()
        app.router.routes.append(Route("/metrics", self._metrics))
        return app


def samples(text: str) -> dict[str, list]:
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_merged_exposition_labels_each_engine_and_keeps_every_family_once():
    text = merged_exposition({"0": engine_text(3), "1": engine_text(5)})
    families = samples(text)
    hits = {s.labels["engine"]: s.value for s in families["picrag_chunk_hits"]}
    assert hits == {"0": 3.0, "1": 5.0}
    assert all(s.labels["pid"] == "7" for s in families["picrag_chunk_hits"])
    ttft = families["sglang_time_to_first_token_seconds"]
    assert len(ttft) == 8 and {s.labels["engine"] for s in ttft} == {"0", "1"}
    assert {s.labels["le"] for s in ttft if s.name.endswith("_bucket")} == {"0.5", "+Inf"}
    assert text.count("# TYPE sglang_time_to_first_token_seconds histogram") == 1
    assert picrag_counters(text)["chunk_hits"] == 8.0
    assert families["picrag_metrics_engines_unreachable"][0].value == 0


def test_behind_the_gateway_metrics_and_stats_count_every_engine(default_model_dir):
    from rag_server.api.app import create_app

    gateway_text = "# TYPE smg_requests_total counter\nsmg_requests_total 4.0\n"
    with (serving(MetricsServer(default_model_dir, gateway_text).app(), graceful_shutdown_s=1) as gateway_url,
          serving((first := MetricsServer(default_model_dir, engine_text(3))).app(), graceful_shutdown_s=1) as one,
          serving((second := MetricsServer(default_model_dir, engine_text(5))).app(), graceful_shutdown_s=1) as two):
        app = create_app(gateway_url, engine_urls=(one, two), health_interval_s=0.1)
        with serving(app) as url, httpx.Client(base_url=url, timeout=30) as client:
            metrics = client.get("/metrics")
            assert metrics.status_code == 200
            assert picrag_counters(metrics.text)["chunk_hits"] == 8.0
            assert "smg_requests" not in samples(metrics.text)  # the engines', not the gateway's
            assert client.get("/picrag/stats").json()["cache"]["counters"]["chunk_hits"] == 8.0

            second.text = None  # one engine's /metrics fails: the other's still answer, and it is said
            metrics = client.get("/metrics")
            assert metrics.status_code == 200
            assert picrag_counters(metrics.text)["chunk_hits"] == 3.0
            assert samples(metrics.text)["picrag_metrics_engines_unreachable"][0].value == 1

            first.text = None  # none answers: a status that says so, and stats say why
            assert client.get("/metrics").status_code == 503
            stats = client.get("/picrag/stats").json()
            assert stats["cache"] is None and "runtime unavailable" in stats["cache_error"]


def test_one_engine_exposition_is_relayed_as_it_is(default_model_dir):
    from rag_server.api.app import create_app

    text = engine_text(2)
    with serving((engine := MetricsServer(default_model_dir, text)).app(), graceful_shutdown_s=1) as runtime_url:
        with serving(create_app(runtime_url, health_interval_s=0.1)) as url:
            assert httpx.get(f"{url}/metrics", timeout=30).text == text
            engine.text = None  # its status too
            assert httpx.get(f"{url}/metrics", timeout=30).status_code == 500
            assert "status 500" in httpx.get(f"{url}/picrag/stats", timeout=30).json()["cache_error"]
