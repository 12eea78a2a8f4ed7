"""The HTTP edge under abuse: API key, CORS, admission (503 + Retry-After), over-long inputs,
client disconnects.

Frontends with non-default options run in this process (uvicorn in a thread) in front of the
shared server's runtime: the code under test is the `create_app` that `picrag serve --api-key ...
--max-inflight ...` runs, without a second model. (In front of the shared frontend they would be
its clients, and it refuses the reordered LegoLink hints a frontend sends its runtime.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from rag_server.api.auth import presented_key
from tests.inprocess_frontend import admission_of, frontend, serving, wait_for

pytestmark = pytest.mark.server

KEY = "s3cret-key"
# Longer than the default model's 8,192-token window whatever the tokenizer does with it.
TOO_LONG_TEXT = "hello " * 9_000


@pytest.fixture(scope="module")
def guarded(picrag_server) -> Iterator[str]:
    with frontend(picrag_server.runtime_url, api_key=KEY, cors_origins=["https://app.example"]) as url:
        yield url


def long_generation(max_new_tokens: int = 8_000) -> dict:
    # ignore_eos: the request runs until cancelled, far longer than any test waits.
    return {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}}


def running_requests(client: httpx.Client) -> int:
    # /v1/loads asks the scheduler; the Prometheus gauges are only refreshed every few dozen steps.
    return sum(load["num_running_reqs"] + load["num_waiting_reqs"] for load in client.get("/v1/loads").json()["loads"])


def wait_idle(client: httpx.Client, timeout_s: float) -> float:
    started = time.monotonic()
    while running_requests(client):
        assert time.monotonic() - started < timeout_s, f"the runtime still runs requests after {timeout_s} s"
        time.sleep(0.2)
    return time.monotonic() - started


def test_presented_key_from_either_header():
    assert presented_key({b"authorization": b"Bearer abc"}) == b"abc"
    assert presented_key({b"authorization": b"bearer  abc "}) == b"abc"
    assert presented_key({b"x-api-key": b"abc"}) == b"abc"
    assert presented_key({b"authorization": b"Basic abc"}) is None
    assert presented_key({}) is None


def test_wrong_or_missing_key_is_401_and_health_stays_open(guarded):
    with httpx.Client(base_url=guarded, timeout=120) as client:
        assert client.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "wrong"},
                        {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
            for method, path in (("GET", "/get_model_info"), ("POST", "/generate"), ("POST", "/rag/query"),
                                 ("GET", "/openapi.json"), ("GET", "/metrics")):
                response = client.request(method, path, headers=headers, json={"question": "q"})
                assert response.status_code == 401, (headers, path, response.text)
                assert response.headers["www-authenticate"] == "Bearer"
                assert KEY not in response.text
        assert client.get("/get_model_info", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert client.get("/get_model_info", headers={"X-API-Key": KEY}).status_code == 200
        answer = client.post("/rag/query", headers={"Authorization": f"Bearer {KEY}"}, json={
            "question": "Where is the Eiffel Tower?", "max_tokens": 2,
            "documents": [{"title": "Eiffel Tower", "text": "The Eiffel Tower is in Paris."}]})
        assert answer.status_code == 200, answer.text


def test_cors_preflight_and_headers(guarded, picrag_server):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with httpx.Client(base_url=guarded, timeout=60) as client:
        # A browser's preflight carries no credentials: it must be answered, not refused.
        response = client.options("/rag/query", headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in response.headers["access-control-allow-methods"]
        # Answers, refusals included, carry the header so the page can read them.
        refused = client.get("/get_model_info", headers={"Origin": "https://app.example"})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == "https://app.example"
        foreign = client.options("/rag/query", headers={**preflight, "Origin": "https://evil.example"})
        assert foreign.status_code == 400
        assert "access-control-allow-origin" not in foreign.headers
    with httpx.Client(base_url=picrag_server.url, timeout=60) as client:  # default: no CORS at all
        response = client.get("/health", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in response.headers


def test_503_with_retry_after_beyond_inflight_and_queue(picrag_server):
    from rag_server.api.app import create_app

    app = create_app(picrag_server.url, max_inflight=1, max_queue=1)
    with serving(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        queued: list[httpx.Response] = []
        with client.stream("POST", "/generate", json=long_generation()) as running:
            # Keep the iterator: a discarded one closes the stream, and the slot with it.
            lines = running.iter_lines()
            assert next(lines).startswith("data:")  # it holds the slot
            waiter = threading.Thread(target=lambda: queued.append(client.post("/generate", json={
                "text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})))
            waiter.start()
            wait_for(lambda: admission_of(app).slots.waiting == 1)  # the second request is in the queue
            assert waiter.is_alive()
            refused = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert client.get("/health").status_code == 200  # probes are not admission-controlled
        # The first client left: its slot goes to the queued request.
        waiter.join(120)
        assert queued and queued[0].status_code == 200, queued
        assert client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


@pytest.mark.parametrize("path", ["/generate", "/rag/query"])
def test_disconnect_mid_stream_frees_the_request_in_the_runtime(picrag_server, path):
    body = long_generation() if path == "/generate" else {
        "question": "Tell a long story.", "documents": [{"text": "A story about a cat."}],
        "max_tokens": 2_048, "temperature": 2.0, "stream": True}  # hot: no early end of text
    with picrag_server.client(timeout=120) as client:
        wait_idle(client, 60)
        with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line.startswith("data:"))
            for _ in range(3):
                next(lines)
            assert running_requests(client) == 1
        # Thousands of tokens were still to come: only an abort ends the request this soon.
        assert wait_idle(client, 10) < 10


def test_requests_over_the_context_window_are_4xx_and_harmless(picrag_server, layout):
    from picrag_core.link_hints import link_hints

    ids = layout.encode("hello " * 3_000)[:9_000] * 3
    linked = {"input_ids": ids[:9_000], "sampling_params": {"max_new_tokens": 4},
              "kv_hints": link_hints("naive", [(10, 4_000), (4_000, 8_990)])}
    fits_but_long_answer = {"input_ids": ids[:100], "sampling_params": {"max_new_tokens": 8_150},
                            "kv_hints": link_hints("naive", [(10, 90)])}
    requests = [
        ("/generate", {"text": TOO_LONG_TEXT, "sampling_params": {"max_new_tokens": 4}}),
        ("/generate", {"input_ids": ids[:9_000], "sampling_params": {"max_new_tokens": 4}}),
        ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 10**9}}),
        ("/generate", linked),
        ("/generate", fits_but_long_answer),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": TOO_LONG_TEXT}],
                                  "max_tokens": 4}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 10**9}),
        # Passages found in the message (rag_server/service/prompt_discovery.py): refused before a compile.
        ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": "\n\n".join(["hello " * 300] * 30)}]}),
        ("/v1/completions", {"model": "m", "max_tokens": 4, "prompt": "\n\n".join(["hello " * 300] * 30)}),
    ]
    with picrag_server.client(timeout=120) as client:
        for path, body in requests:
            started = time.monotonic()
            response = client.post(path, json=body)
            assert response.status_code == 400, (path, response.text)
            assert "context length" in response.text or "longer than" in response.text, response.text
            # Refused before any chunk is computed (a 9,000-token compile takes a minute here).
            assert time.monotonic() - started < 10, path
        assert client.get("/health").status_code == 200
        wait_idle(client, 10)


def test_json_nested_too_deeply_is_a_400_on_every_route(picrag_server):
    """Python's JSON parser raises RecursionError, not ValueError, on deep nesting: caught at the
    edge, it is a 400 on every route that parses a body, never a 500, and the runtime never sees it."""
    body = "[" * 50_000 + "]" * 50_000
    with picrag_server.client(timeout=60) as client:
        for path in ("/generate", "/v1/chat/completions", "/v1/completions", "/concate_and_append_request",
                     "/rag/query", "/rag/retrieve"):
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            assert 400 <= response.status_code < 500, (path, response.status_code, response.text[:200])
        assert client.get("/health").status_code == 200


def test_serve_flags():
    from rag_server.cli import build_parser

    args = build_parser().parse_args(["serve", "--api-key", KEY, "--cors-origin", "https://a.example",
                                      "--cors-origin", "https://b.example", "--max-inflight", "2",
                                      "--max-queue", "0"])
    assert (args.api_key, args.cors_origin, args.max_inflight, args.max_queue) == (
        KEY, ["https://a.example", "https://b.example"], 2, 0)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.api_key, defaults.cors_origin, defaults.max_inflight, defaults.max_queue) == (None, [], 64, 16)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-inflight", "0"])
