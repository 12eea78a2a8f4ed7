"""Shadow sampling: sampled reuse-policy requests also run as `full` for one token, in the
background; first-token KL and agreement per policy and prompt-size bucket, the cost, the
metrics, and (on the shared server) an answer that shadowing never changes."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass

import httpx
import pytest

import numpy as np

from rag_server.service.auto_policy import CALIBRATION_DIR, CalibrationTable
from rag_server.service.first_token_quality import QualityRecord, Sample, bucket_labels, size_bucket
from rag_server.service.quality_metrics import QualityMetrics
from rag_server.service.shadow import ShadowSampler, ShadowSettings, first_token, sample_name
from picrag_core.engine_report import FIRST_TOKEN_KEY, encode_floats
from picrag_core.link_hints import LinkRequest

CHUNKS = [(10, 40), (40, 90)]
PROMPT = list(range(100))
# Distributions over a 10-token vocabulary: full puts 0.6 on token 5 and 0.3 on token 7, the
# policy the other way round; both spread the last 0.1 evenly over the other 8 tokens.
FULL = np.log(np.array([0.1 / 8] * 5 + [0.6, 0.1 / 8, 0.3] + [0.1 / 8] * 2))
PROBE = np.log(np.array([0.1 / 8] * 5 + [0.3, 0.1 / 8, 0.6] + [0.1 / 8] * 2))
PAIR_KL = 0.3 * math.log(2)  # 0.6 ln(0.6/0.3) + 0.3 ln(0.3/0.6)


def test_buckets():
    assert bucket_labels() == ["<512", "512-1024", "1024-2048", ">=2048"]
    assert [size_bucket(n) for n in (0, 511, 512, 1023, 1024, 2047, 2048, 10**6)] == [
        "<512", "<512", "512-1024", "512-1024", "1024-2048", "1024-2048", ">=2048", ">=2048"]


@dataclass
class _Response:
    status_code: int


@dataclass
class _Linked:
    response: _Response
    head: bytes


def _answer(token: int, logprobs: np.ndarray, prompt: int, computed: int | None = None) -> bytes:
    details = {FIRST_TOKEN_KEY: encode_floats(logprobs)}
    if computed is not None:
        details.update(picrag_computed_tokens=computed, picrag_reused_tokens=prompt - computed)
    meta = {"prompt_tokens": prompt, "cached_tokens_details": details}
    return json.dumps({"text": "x", "output_ids": [token], "meta_info": meta}).encode()


class FakePipeline:
    """`full` answers token 5 with FULL; any other policy token 7 with PROBE; a gate
    holds every request until released, to test the concurrency cap."""

    def __init__(self, status: int = 200):
        self.calls: list[tuple[str, dict]] = []
        self.status = status
        self.gate = asyncio.Event()
        self.gate.set()

    async def generate(self, input_ids, link, fields):
        await self.gate.wait()
        self.calls.append((link, dict(fields)))
        if link.policy == "full":
            return _Linked(_Response(self.status), _answer(5, FULL, len(input_ids)))
        return _Linked(_Response(self.status), _answer(7, PROBE, len(input_ids), 12))


def _sampler(rate=1.0, status=200, calibrated=("legolink:4",), **settings):
    record = QualityRecord(window=2)
    pipeline = FakePipeline(status)
    sampler = ShadowSampler(pipeline, record, ShadowSettings(rate=rate, **settings), random.Random(0), calibrated)
    return sampler, pipeline, record


def test_a_shadow_pair_records_kl_agreement_and_its_cost():
    async def run():
        sampler, pipeline, record = _sampler()
        link = LinkRequest.of("legolink:4", CHUNKS)
        assert sampler.offer(PROMPT, link, in_flight=0)
        await sampler.drain()
        return pipeline, record

    pipeline, record = asyncio.run(run())
    (full_link, full), (probe_link, probe) = pipeline.calls
    assert (full_link.policy, probe_link.policy) == ("full", "legolink") and probe_link.k == 4
    assert full_link.report_first_token and probe_link.report_first_token
    assert full == probe == {"sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "stream": False}
    assert record.observed("legolink:4", "<512") == (1, pytest.approx(PAIR_KL))
    view = record.as_json()
    cell = view["policies"]["legolink:4"]["<512"]
    assert cell["all_time"] == cell["recent"] == {"count": 1, "mean_kl": pytest.approx(PAIR_KL),
                                                   "agreement_rate": 0.0}
    # full computes the whole prompt; the policy side what the engine reports it computed.
    assert view["shadow_cost"] == {"sent": 1, "prefilled_tokens": 100 + 12, "skipped_capacity": 0, "failed": 0}


def test_samples_of_policies_outside_the_calibration_table_are_filed_under_their_family():
    async def run():
        sampler, pipeline, record = _sampler(calibrated=("legolink:4",))
        for k in (4, 5, 6, 7):
            assert sampler.offer(PROMPT, LinkRequest.of(f"legolink:{k}", CHUNKS), in_flight=0)
            await sampler.drain()
        return record

    record = asyncio.run(run())
    # A client naming legolink:<k> for every k files its samples under two names, not one per k.
    assert sorted(record.as_json()["policies"]) == ["legolink", "legolink:4"]
    assert record.observed("legolink:4", "<512")[0] == 1 and record.observed("legolink", "<512")[0] == 3
    assert sample_name(LinkRequest.of("naive", CHUNKS), ()) == "naive"


def test_rate_policy_and_capacity_bound_the_shadows():
    async def run():
        sampler, pipeline, record = _sampler(rate=0.0)
        assert not sampler.offer(PROMPT, LinkRequest.of("naive", CHUNKS), 0)
        sampler, pipeline, record = _sampler()
        # Policies that reuse no chunk, and prompts without chunks, have nothing to compare.
        assert not sampler.offer(PROMPT, LinkRequest.of("full", CHUNKS), 0)
        assert not sampler.offer(PROMPT, LinkRequest.of("prefix", CHUNKS), 0)
        assert not sampler.offer(PROMPT, LinkRequest.of("naive", []), 0)
        # Busy: more RAG requests in flight than busy_requests.
        assert not sampler.offer(PROMPT, LinkRequest.of("naive", CHUNKS), in_flight=3)
        assert record.cost.skipped_capacity == 1
        # One shadow at a time: a second offer while the first waits is skipped.
        pipeline.gate.clear()
        assert sampler.offer(PROMPT, LinkRequest.of("naive", CHUNKS), 0)
        assert not sampler.offer(PROMPT, LinkRequest.of("naive", CHUNKS), 0)
        pipeline.gate.set()
        await sampler.drain()
        assert sampler.offer(PROMPT, LinkRequest.of("naive", CHUNKS), 0)
        await sampler.drain()
        return record

    record = asyncio.run(run())
    assert vars(record.cost) == {"sent": 2, "prefilled_tokens": 2 * 112, "skipped_capacity": 2, "failed": 0}
    assert record.observed("naive", "<512")[0] == 2


def test_sampling_follows_the_rate():
    async def run():
        sampler, _, record = _sampler(rate=0.25)
        started = 0
        for _ in range(400):
            started += sampler.offer(PROMPT, LinkRequest.of("naive", CHUNKS), 0)
            await sampler.drain()
        return started

    assert 70 <= asyncio.run(run()) <= 130


def test_a_failing_shadow_is_counted_and_records_nothing():
    async def run():
        sampler, _, record = _sampler(status=503)
        assert sampler.offer(PROMPT, LinkRequest.of("naive", CHUNKS), 0)
        await sampler.drain()
        return record

    record = asyncio.run(run())
    assert vars(record.cost) == {"sent": 1, "prefilled_tokens": 0, "skipped_capacity": 0, "failed": 1}
    assert record.as_json()["policies"] == {}


def test_recent_window_and_metrics():
    record = QualityRecord(window=2)
    metrics = QualityMetrics(record)
    for kl, agrees in ((0.9, False), (0.1, True), (0.3, True)):
        record.add(Sample("cacheblend:0.15", 1500, kl, agrees))
    cell = record.as_json()["policies"]["cacheblend:0.15"]["1024-2048"]
    assert cell["all_time"] == {"count": 3, "mean_kl": pytest.approx(1.3 / 3), "agreement_rate": pytest.approx(2 / 3)}
    assert cell["recent"] == {"count": 2, "mean_kl": pytest.approx(0.2), "agreement_rate": 1.0}
    record.cost.sent = 3
    text = metrics.exposition().decode()
    labels = 'bucket="1024-2048",policy="cacheblend:0.15"'
    assert f"picrag_shadow_first_token_kl_count{{{labels}}} 3.0" in text
    assert 'picrag_shadow_first_token_kl_bucket{bucket="1024-2048",le="0.1",policy="cacheblend:0.15"} 1.0' in text
    assert f"picrag_shadow_first_token_agreements_total{{{labels}}} 2.0" in text
    assert "picrag_shadow_requests_total 3.0" in text and "picrag_shadow_skipped_capacity_total 0.0" in text


def test_first_token_reads_sglang_answers():
    parsed = first_token(_answer(7, PROBE, 50, 9))
    assert (parsed.token, parsed.computed_tokens) == (7, 9)
    assert np.allclose(parsed.logprobs, PROBE, atol=1e-6)
    assert LinkRequest.of("legolink", CHUNKS).policy_name == "legolink:16"
    assert LinkRequest.of("cacheblend:0.3", CHUNKS).policy_name == "cacheblend:0.3"


DOCUMENTS = [{"title": "Oslo", "text": "Oslo is the capital of Norway. It lies at the head of the Oslofjord."},
             {"title": "Bergen", "text": "Bergen is a city on the west coast of Norway, known for rain."}]


def _shadows_done(view: dict) -> bool:
    samples = sum(cell["all_time"]["count"] for cells in view["policies"].values() for cell in cells.values())
    return samples + view["shadow_cost"]["failed"] == view["shadow_cost"]["sent"]


@pytest.mark.server
def test_shadow_sampling_never_changes_the_answer_and_fills_the_quality_view(picrag_server, layout):
    from rag_server.service.quality import QualitySettings
    from retrieval.prompt_layout import PromptPassage
    from picrag_core.link_hints import link_hints
    from tests.inprocess_frontend import frontend

    query = {"question": "What is the capital of Norway?", "documents": DOCUMENTS, "policy": "naive",
             "max_tokens": 12}
    prompt = layout.build(query["question"], [PromptPassage(d["title"], d["text"]) for d in DOCUMENTS])
    linked = {"input_ids": prompt.input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 6},
              "kv_hints": link_hints("naive", list(prompt.chunks))}
    with frontend(picrag_server.url) as quiet_url:
        with httpx.Client(base_url=quiet_url, timeout=600) as quiet:
            unshadowed = quiet.post("/rag/query", json=query).json()
            unshadowed_generate = quiet.post("/generate", json=linked).json()
            assert quiet.get("/picrag/quality").json()["shadow_cost"]["sent"] == 0
    # auto's target: naive's expected KL for this prompt's size in the shipped SmolLM2 table, so
    # naive, the cheapest policy, is exactly within it. (A frontend in front of picrag serve
    # cannot send the reordered layout a legolink choice needs: the server's frontend refuses
    # client layouts.)
    shipped = CalibrationTable.read(CALIBRATION_DIR / "smollm2-135m.json")
    assert shipped.cost_order[0] == "naive" and len(prompt.input_ids) < 512
    naive_kl, measured_at = shipped.table_kl("naive", "<512")
    with frontend(picrag_server.url, quality=QualitySettings(target=naive_kl, shadow=ShadowSettings(rate=1.0))) as url:
        with httpx.Client(base_url=url, timeout=600) as client:
            shadowed = client.post("/rag/query", json=query).json()
            deadline = time.monotonic() + 300
            while (view := client.get("/picrag/quality").json())["shadow_cost"]["sent"] < 1 or not view["policies"]:
                assert view["shadow_cost"]["failed"] == 0, view
                assert time.monotonic() < deadline, view
                time.sleep(0.5)
            after = client.post("/rag/query", json=query).json()
            # A client's linked /generate is never sampled: auto learns from picrag's own prompts.
            while not _shadows_done(quiet_view := client.get("/picrag/quality").json()):
                assert time.monotonic() < deadline
                time.sleep(0.5)
            shadowed_generate = client.post("/generate", json=linked).json()
            # A shadow would have started before the answer was sent, and counted itself at once.
            assert client.get("/picrag/quality").json()["shadow_cost"] == quiet_view["shadow_cost"]
            metrics = client.get("/picrag/metrics").text
            auto = client.post("/rag/query", json={**query, "policy": "auto"}).json()
            chat = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": query["question"]}], "max_tokens": 4,
                "picrag": {"documents": DOCUMENTS, "policy": "auto"}}).json()
    assert shadowed["answer"] == unshadowed["answer"] == after["answer"]
    assert shadowed_generate["output_ids"] == unshadowed_generate["output_ids"]
    assert shadowed["policy"] == "naive" and shadowed["policy_reason"] is None
    cell = view["policies"]["naive"][shadowed["usage"]["prompt_tokens"] < 512 and "<512" or "512-1024"]
    assert cell["all_time"]["count"] == 1 and cell["all_time"]["mean_kl"] >= 0.0
    assert cell["all_time"]["agreement_rate"] in (0.0, 1.0)
    assert view["shadow_cost"]["prefilled_tokens"] >= shadowed["usage"]["prompt_tokens"]
    assert "picrag_shadow_first_token_kl_count" in metrics and "picrag_shadow_requests_total" in metrics
    assert auto.get("policy") == "naive", auto
    assert auto["policy_reason"] == (f"auto: naive (expected KL {naive_kl:.3f} <= target {naive_kl:g} for <512 "
                                     f"tokens; calibration table, nearest measured size {measured_at})")
    assert chat["picrag"]["policy"] == "naive" and chat["picrag"]["policy_reason"] == auto["policy_reason"]
