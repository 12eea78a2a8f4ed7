"""Every call to the runtime is bounded (connect, first byte, total): a hung runtime gets the
client a 504 or an error event, and frees the admission slot it held. The runtime is a fake
(tests/fake_runtime.py) that accepts requests and never answers, stalls or never finishes."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from rag_server.api.upstream import UpstreamTimeouts
from tests.fake_runtime import fake_runtime, hang, stall, trickle
from tests.inprocess_frontend import frontend

# Without the bounds these tests would wait for their client's timeout, and fail there.
CLIENT_TIMEOUT_S = 60


def data_lines(response: httpx.Response, give_up_s: float = CLIENT_TIMEOUT_S) -> list[str]:
    lines = []
    started = time.monotonic()
    for line in response.iter_lines():
        assert time.monotonic() - started < give_up_s, f"the stream did not end in {give_up_s} s: {lines[-3:]}"
        if line.startswith("data:"):
            lines.append(line[len("data:"):].strip())
    return lines


def test_hung_runtime_is_a_504_and_frees_the_slot(default_model_dir):
    with fake_runtime(default_model_dir, hang) as (fake, runtime_url), \
            frontend(runtime_url, timeouts=UpstreamTimeouts(first_byte_s=1.0), max_inflight=1, max_queue=0) as url, \
            httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        # One slot, no queue: a slot still held by the first would make the second a 503 (busy).
        answers = [client.post("/generate", json={"text": "hello"}) for _ in range(2)]
    assert [a.status_code for a in answers] == [504, 504], [a.text for a in answers]
    assert all("timeout" in a.text.lower() for a in answers), [a.text for a in answers]
    assert fake.calls["/generate"] == 2


def test_stalled_stream_ends_with_an_error_event(default_model_dir):
    with fake_runtime(default_model_dir, stall) as (_fake, runtime_url), \
            frontend(runtime_url, timeouts=UpstreamTimeouts(first_byte_s=1.0)) as url, \
            httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client, \
            client.stream("POST", "/generate", json={"text": "hello", "stream": True}) as response:
        assert response.status_code == 200
        lines = data_lines(response)
    assert json.loads(lines[0]) == {"text": "a", "meta_info": {}}
    error = json.loads(lines[1])["error"]
    assert error["code"] == 504 and "timeout" in error["message"].lower(), error
    assert lines[2:] == ["[DONE]"]


def test_total_timeout_ends_a_stream_that_never_ends(default_model_dir):
    with fake_runtime(default_model_dir, trickle) as (_fake, runtime_url), \
            frontend(runtime_url, timeouts=UpstreamTimeouts(first_byte_s=30.0, total_s=1.5)) as url, \
            httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client, \
            client.stream("POST", "/generate", json={"text": "hello", "stream": True}) as response:
        lines = data_lines(response)
    texts = [json.loads(line)["text"] for line in lines[:-2]]
    assert texts and texts == ["a" * (i + 1) for i in range(len(texts))]  # every event whole, in order
    error = json.loads(lines[-2])["error"]
    assert error["code"] == 504 and "1.5 s" in error["message"], error
    assert lines[-1] == "[DONE]"


def test_rag_query_on_a_hung_runtime_fails_instead_of_waiting(default_model_dir):
    with fake_runtime(default_model_dir, hang) as (fake, runtime_url), \
            frontend(runtime_url, timeouts=UpstreamTimeouts(first_byte_s=1.0), max_inflight=1, max_queue=0) as url, \
            httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        answers = [client.post("/rag/query", json={
            "question": "Where is the Eiffel Tower?", "max_tokens": 2, "policy": "naive",
            "documents": [{"title": "Eiffel Tower", "text": "The Eiffel Tower is in Paris."}]}) for _ in range(2)]
    # The chunk compile hangs: a server error naming the timeout, and the slot is free again.
    assert [a.status_code for a in answers] == [503, 503], [a.text for a in answers]
    assert all("timeout" in a.text.lower() for a in answers), [a.text for a in answers]
    assert fake.calls["/generate"] == 2


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_timeouts_must_be_positive(bad):
    with pytest.raises(ValueError):
        UpstreamTimeouts(total_s=bad)


def test_serve_flags_for_timeouts():
    from rag_server.cli import build_parser

    args = build_parser().parse_args(["serve", "--runtime-connect-timeout", "2", "--runtime-first-byte-timeout",
                                      "30", "--runtime-total-timeout", "90.5", "--health-interval", "0.5"])
    assert (args.runtime_connect_timeout, args.runtime_first_byte_timeout, args.runtime_total_timeout,
            args.health_interval) == (2.0, 30.0, 90.5, 0.5)
    defaults = build_parser().parse_args(["serve"])
    assert UpstreamTimeouts(defaults.runtime_connect_timeout, defaults.runtime_first_byte_timeout,
                            defaults.runtime_total_timeout) == UpstreamTimeouts()
    # A prefill of a long prompt on CPU takes minutes: the defaults must allow it.
    assert UpstreamTimeouts().first_byte_s >= 300 and UpstreamTimeouts().total_s >= UpstreamTimeouts().first_byte_s
    for flag in ("--runtime-total-timeout", "--health-interval"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, "0"])
