"""No request can kill, stall or monopolise the engine, on the real server: the attacks of issue 33
through the frontend and straight to the engine's port (as a client of a replica deployment can),
then a fuzz over SGLang's sampling-parameter space. After every request a canary is answered
within CANARY_BOUND_S, and every response is a 2xx or a 4xx."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from picrag_core.link_hints import link_hints
from picrag_core.request_bounds import MAX_CHUNK_SPANS, MAX_N, MAX_TOP_LOGPROBS

pytestmark = pytest.mark.server

# A canary is one token; its answer takes well under a second unless something holds the scheduler.
CANARY_BOUND_S = 30.0
CANARY = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def targets(picrag_server) -> dict[str, str]:
    return {"frontend": picrag_server.url, "engine": picrag_server.runtime_url}


def canary_answered(url: str) -> None:
    started = time.monotonic()
    response = httpx.post(f"{url}/generate", json=CANARY, timeout=CANARY_BOUND_S)
    assert response.status_code == 200, response.text
    assert time.monotonic() - started < CANARY_BOUND_S


def refused(url: str, path: str, body: dict) -> str:
    """The 400's message for `body` (a stream's error event, for a streamed /generate)."""
    response = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert response.status_code == 400, response.text[:500]
    error = response.json().get("error", response.json())
    return error["message"] if isinstance(error, dict) else error


SPANS = [(i, i + 2) for i in range(0, 2 * MAX_CHUNK_SPANS + 2, 2)]  # one more than a hint may carry
ATTACKS = {
    # 1. took the runtime down (selected index k out of range), in each spelling.
    "top_logprobs_num": ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 10_000_000,
                                       "sampling_params": {"max_new_tokens": 2}}),
    "chat top_logprobs": ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 10_000_000}),
    "completions logprobs": ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 2,
                                                 "logprobs": 10_000_000}),
    "batch top_logprobs_num": ("/generate", {"text": ["hi", "ho"], "return_logprob": True,
                                             "top_logprobs_num": [1, 10_000_000],
                                             "sampling_params": {"max_new_tokens": 1}}),
    # 2. held every request for minutes while /health answered 200.
    "stop_regex": ("/generate", {"text": "aaaa", "sampling_params": {"max_new_tokens": 40, "temperature": 0,
                                                                     "regex": "a{40}", "stop_regex": "(a+)+b"}}),
    # 3. as many sequences, and chunk spans, as the body holds.
    "n": ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": 64}}),
    "chat n": ("/v1/chat/completions", {**CHAT, "n": 64}),
    "chunk spans": ("/generate", {"input_ids": list(range(100, 100 + 2 * (MAX_CHUNK_SPANS + 1))),
                                  "sampling_params": {"max_new_tokens": 1},
                                  "kv_hints": link_hints("naive", SPANS)}),
}
# What the 400 names (the engine names SGLang's own fields: top_logprobs_num for every spelling).
NAMED = {"top_logprobs_num": "top_logprobs_num: ", "chat top_logprobs": "top_logprobs",
         "completions logprobs": "logprobs", "batch top_logprobs_num": "top_logprobs_num",
         "stop_regex": "stop_regex: ", "n": "sampling_params.n: ", "chat n": "n: ", "chunk spans": "chunk spans"}


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("target", ["frontend", "engine"])
def test_each_attack_is_a_400_naming_its_field_and_the_engine_keeps_answering(targets, target, attack):
    path, body = ATTACKS[attack]
    message = refused(targets[target], path, body)
    assert NAMED[attack] in message, message
    canary_answered(targets[target])


def test_bounded_values_still_run(targets):
    for url in targets.values():
        top = httpx.post(f"{url}/generate", timeout=120, json={
            "text": "hi", "return_logprob": True, "top_logprobs_num": MAX_TOP_LOGPROBS,
            "sampling_params": {"max_new_tokens": 1, "n": MAX_N, "stop": ["\n"]}})
        assert top.status_code == 200, top.text
        assert len(top.json()) == MAX_N
        assert all(len(out["meta_info"]["output_top_logprobs"][0]) == MAX_TOP_LOGPROBS for out in top.json())


# SGLang's sampling-parameter space (sglang.srt.sampling.sampling_params.SamplingParams, its API
# fields) and the logprob fields of a request: in-range values, their edges, values past them,
# wrong types. Token budgets stay tiny where valid, so that the valid requests really run.
INTS = st.one_of(st.integers(-3, 5), st.sampled_from([21, 64, 49_151, 49_152, 10_000_000, 2**63, 2**70]))
FLOATS = st.one_of(st.floats(-3, 3), st.sampled_from([0.0, 1e-9, 1.0, 2.0, 1e308, float("inf"), float("nan")]))
TEXTS = st.one_of(st.text(max_size=8), st.sampled_from(["(a+)+b", "(a|aa)*$", ".*", "", "\x00", "a" * 300]))
JUNK = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXTS, st.lists(INTS, max_size=3),
                 st.dictionaries(st.text(max_size=3), INTS, max_size=2))


def maybe(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(values, values, values, JUNK)


SAMPLING = st.fixed_dictionaries({"max_new_tokens": st.one_of(st.integers(0, 2), st.sampled_from([-1, 10**12, 2.5]))},
                                 optional={
    "min_new_tokens": maybe(st.integers(0, 3)),
    "temperature": maybe(FLOATS), "top_p": maybe(FLOATS), "top_k": maybe(INTS), "min_p": maybe(FLOATS),
    "frequency_penalty": maybe(FLOATS), "presence_penalty": maybe(FLOATS), "repetition_penalty": maybe(FLOATS),
    "stop": maybe(st.one_of(TEXTS, st.lists(TEXTS, max_size=20))),
    "stop_token_ids": maybe(st.lists(INTS, max_size=70)),
    "stop_regex": maybe(st.one_of(TEXTS, st.lists(TEXTS, max_size=3))),
    "n": maybe(INTS), "beam_width": maybe(INTS),
    "regex": maybe(TEXTS), "json_schema": maybe(st.sampled_from(['{"type": "string"}', "{", "[]"])),
    "ebnf": maybe(st.sampled_from(['root ::= "a"', "root ::= "])),
    "ignore_eos": maybe(st.booleans()), "skip_special_tokens": maybe(st.booleans()),
    "spaces_between_special_tokens": maybe(st.booleans()), "no_stop_trim": maybe(st.booleans()),
    "stream_interval": maybe(INTS), "logit_bias": maybe(st.dictionaries(st.sampled_from(["5", "-1", "99999", "x"]),
                                                                          FLOATS, max_size=2)),
    "sampling_seed": maybe(INTS), "custom_params": JUNK, "unknown": JUNK,
})
GENERATE = st.fixed_dictionaries({"text": st.one_of(st.just("Hello"), st.lists(st.just("Hi"), min_size=1, max_size=3)),
                                  "sampling_params": SAMPLING}, optional={
    "return_logprob": maybe(st.booleans()), "top_logprobs_num": maybe(INTS), "logprob_start_len": maybe(INTS),
    "token_ids_logprob": maybe(st.lists(INTS, max_size=25)), "stream": maybe(st.booleans()),
})
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def no_server_error(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:1000]
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            data = line[len("data:"):].strip() if line.startswith("data:") else None
            if data and data != "[DONE]":
                error = json.loads(data).get("error")
                assert not isinstance(error, dict) or error.get("code", 500) < 500, error


@pytest.mark.parametrize("target", ["engine", "frontend"])
def test_fuzz_sampling_parameters(targets, target):
    url = targets[target]

    @FUZZ
    @given(body=GENERATE)
    def run(body):
        # allow_nan: NaN and Infinity are not JSON, but clients send them and servers parse them.
        content = json.dumps(body).encode()
        no_server_error(httpx.post(f"{url}/generate", content=content, timeout=120,
                                   headers={"content-type": "application/json"}))
        canary_answered(url)

    run()
