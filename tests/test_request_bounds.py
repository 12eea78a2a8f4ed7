"""The typed allowlist of forwarded bodies (rag_server/api/forwarded_bodies.py) and the engine's
bounds (picrag_core/request_bounds.py), without a model: each bound refuses with a 400 naming
its field, unlisted fields are refused unless passed through, and `n` takes --max-inflight slots.
The same requests against the real engine: tests/test_request_bounds_server.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rag_server.api.forwarded_bodies import ChatBody, CompletionBody, ForwardLimits, GenerateBody, parse_forwarded
from picrag_core import request_bounds
from picrag_core.link_hints import link_hints
from picrag_core.request_bounds import MAX_BATCH_PROMPTS, MAX_CHUNK_SPANS, MAX_N, MAX_TOP_LOGPROBS
from tests.fake_runtime import fake_runtime
from tests.inprocess_frontend import frontend

LIMITS = ForwardLimits(context_length=2048)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(body_type, payload, limits=LIMITS):
    return parse_forwarded(body_type, payload, limits)[1]


@pytest.mark.parametrize("body_type, payload, field", [
    # 1. top logprobs, in every spelling: 10,000,000 took the runtime down.
    (GenerateBody, {"text": "hi", "return_logprob": True, "top_logprobs_num": 10_000_000}, "top_logprobs_num"),
    (GenerateBody, {"text": ["a", "b"], "top_logprobs_num": [1, MAX_TOP_LOGPROBS + 1]}, "top_logprobs_num.1"),
    (ChatBody, {**CHAT, "logprobs": True, "top_logprobs": 10_000_000}, "top_logprobs"),
    (CompletionBody, {"prompt": "hi", "logprobs": 10_000_000}, "logprobs"),
    (GenerateBody, {"text": "hi", "token_ids_logprob": list(range(MAX_TOP_LOGPROBS + 1))}, "token_ids_logprob"),
    # 2. stop_regex runs through Python's backtracking re on the scheduler thread.
    (GenerateBody, {"text": "aaaa", "sampling_params": {"regex": "a{40}", "stop_regex": "(a+)+b"}},
     "sampling_params.stop_regex"),
    # 3. sequences, prompts, chunk spans and stop strings.
    (GenerateBody, {"text": "hi", "sampling_params": {"n": 64}}, "sampling_params.n"),
    (ChatBody, {**CHAT, "n": MAX_N + 1}, "n"),
    (GenerateBody, {"text": ["hi"] * (MAX_BATCH_PROMPTS + 1)}, "text"),
    (GenerateBody, {"input_ids": [[1, 2]] * (MAX_BATCH_PROMPTS + 1)}, "input_ids"),
    (CompletionBody, {"prompt": ["hi"] * (MAX_BATCH_PROMPTS + 1)}, "prompt"),
    (GenerateBody, {"text": "hi", "sampling_params": {"stop": ["x"] * 17}}, "sampling_params.stop"),
    (GenerateBody, {"text": "hi", "sampling_params": {"stop": "x" * 257}}, "sampling_params.stop"),
    (ChatBody, {**CHAT, "stop": ["x" * 257]}, "stop.0"),
    # Within the context window, and logprobs from inside the prompt.
    (GenerateBody, {"text": "hi", "sampling_params": {"max_new_tokens": 2049}}, "sampling_params.max_new_tokens"),
    (ChatBody, {**CHAT, "max_completion_tokens": 10**9}, "max_completion_tokens"),
    (GenerateBody, {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
    (GenerateBody, {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    # Structured output only through the grammar backend, and bounded.
    (GenerateBody, {"text": "hi", "sampling_params": {"regex": "a" * (request_bounds.MAX_GRAMMAR_CHARS + 1)}},
     "sampling_params.regex"),
    (ChatBody, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["a" * request_bounds.MAX_GRAMMAR_CHARS]}}}},
     "response_format.json_schema.schema"),
    # Values SGLang would take but no client of picrag needs.
    (GenerateBody, {"text": "hi", "sampling_params": {"temperature": float("nan")}}, "sampling_params.temperature"),
    (GenerateBody, {"text": "hi", "sampling_params": {"n": True}}, "sampling_params.n"),
])
def test_a_field_out_of_bounds_is_refused_by_name(body_type, payload, field):
    message = refusal(body_type, payload)
    assert message is not None and message.split(": ")[0] == field, message


@pytest.mark.parametrize("body_type, payload, field", [
    (GenerateBody, {"text": "hi", "custom_logit_processor": "x"}, "custom_logit_processor"),
    (GenerateBody, {"text": "hi", "sampling_params": {"stream_interval": 0}}, "sampling_params.stream_interval"),
    (GenerateBody, {"text": "hi", "sampling_params": [{"max_new_tokens": 1}, {"beam_width": 8}]},
     "sampling_params.1.beam_width"),
    (ChatBody, {**CHAT, "messages": [{"role": "user", "content": "hi", "image": "x"}]}, "messages.0.image"),
    (CompletionBody, {"prompt": "hi", "best_of": 3}, "best_of"),
])
def test_an_unlisted_field_is_refused_by_name_unless_passed_through(body_type, payload, field):
    message = refusal(body_type, payload)
    assert message == f"{field}: not a field picrag forwards (picrag serve --pass-unlisted-fields lets unlisted " \
                      "fields through)"
    assert refusal(body_type, payload, ForwardLimits(2048, pass_unlisted=True)) is None


def test_what_sglang_clients_send_is_listed():
    # SGLang's DSL (sglang.lang.backend.runtime_endpoint) sends every sampling field, unset ones as null.
    dsl = {"text": "Q: 1+1?\nA:", "sampling_params": {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 16,
        "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": None, "temperature": 0.0,
        "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "ignore_eos": False, "regex": None, "json_schema": None},
        "return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0, "return_text_in_logprobs": False}
    select = {"text": ["Q: a", "Q: b"], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
              "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 1}
    chat = {**CHAT, "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "stop": ["\n"], "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS,
            "seed": 7, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}}
    completion = {"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 4, "logprobs": 5, "echo": False}
    assert refusal(GenerateBody, dsl) is None
    assert refusal(GenerateBody, select) is None
    assert refusal(ChatBody, chat) is None
    assert refusal(CompletionBody, completion) is None


def test_sequences_count_prompts_and_n():
    def sequences(body_type, payload):
        return parse_forwarded(body_type, payload, LIMITS)[0].sequences()

    assert sequences(GenerateBody, {"text": "hi"}) == 1
    assert sequences(GenerateBody, {"text": ["a", "b", "c"], "sampling_params": {"n": 2}}) == 6
    assert sequences(GenerateBody, {"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 3}]}) == 6
    assert sequences(GenerateBody, {"input_ids": [1, 2, 3], "sampling_params": {"n": 4}}) == 4
    assert sequences(CompletionBody, {"prompt": ["a", "b"], "n": 3}) == 6
    assert sequences(ChatBody, {**CHAT, "n": 2}) == 2


def _obj(**fields):
    """One prompt of a GenerateReqInput as SGLang's per-request validation sees it."""
    defaults = {"sampling_params": {}, "top_logprobs_num": 0, "token_ids_logprob": None, "logprob_start_len": -1,
                "kv_hints": None}
    return SimpleNamespace(**{**defaults, **fields})


@pytest.mark.parametrize("fields, message", [
    ({"top_logprobs_num": 10_000_000}, "top_logprobs_num: 10000000 is outside [0, 20]"),
    ({"token_ids_logprob": list(range(21))}, "token_ids_logprob: 21 entries, over the limit of 20"),
    ({"logprob_start_len": 5}, "logprob_start_len: 5 is not -1 or a position inside the 5-token prompt"),
    ({"sampling_params": {"stop_regex": "(a+)+b"}}, f"sampling_params.stop_regex: {request_bounds.STOP_REGEX_REFUSAL}"),
    ({"sampling_params": {"stop_regex": ["x"]}}, f"sampling_params.stop_regex: {request_bounds.STOP_REGEX_REFUSAL}"),
    ({"sampling_params": {"n": 64}}, "sampling_params.n: 64 is outside [1, 4]"),
    ({"sampling_params": {"beam_width": 5}}, "sampling_params.beam_width: 5 is outside [1, 4]"),
    ({"sampling_params": {"stop": ["x"] * 17}}, "sampling_params.stop: 17 entries, over the limit of 16"),
    ({"sampling_params": {"stop": "x" * 300}},
     "sampling_params.stop: a stop string of 300 characters, over the limit of 256"),
    ({"sampling_params": {"stop_token_ids": list(range(65))}},
     "sampling_params.stop_token_ids: 65 entries, over the limit of 64"),
    ({"sampling_params": {"json_schema": "x" * 40_000}},
     "sampling_params.json_schema: 40000 characters, over the limit of 32768"),
    ({"kv_hints": link_hints("naive", [(i, i + 1) for i in range(MAX_CHUNK_SPANS + 1)])},
     f"kv_hints: {MAX_CHUNK_SPANS + 1} chunk spans, over the limit of {MAX_CHUNK_SPANS}"),
])
def test_the_engine_refuses_what_could_crash_or_stall_its_scheduler(fields, message):
    with pytest.raises(ValueError) as refused:
        request_bounds.check_request(_obj(**fields), list(range(5)))
    assert str(refused.value) == message


def test_the_engine_admits_ordinary_requests():
    for fields in ({}, {"top_logprobs_num": 20, "logprob_start_len": 4, "token_ids_logprob": [1, 2]},
                   {"sampling_params": {"n": 4, "stop": ["\n"] * 16, "stop_regex": None, "regex": "a+"}},
                   {"kv_hints": link_hints("naive", [(0, 2), (2, 4)])}):
        request_bounds.check_request(_obj(**fields), list(range(5)))


def _counting_generate(seen: list[dict]):
    async def generate(request: Request) -> Response:
        seen.append(json.loads(await request.body()))
        return JSONResponse({"text": "ok", "meta_info": {}})
    return generate


def test_the_frontend_refuses_before_the_runtime_and_forwards_bodies_as_sent(default_model_dir):
    seen: list[dict] = []
    with fake_runtime(default_model_dir, _counting_generate(seen)) as (fake, runtime_url), \
            frontend(runtime_url) as url, httpx.Client(base_url=url, timeout=60) as client:
        refused = client.post("/generate", json={"text": "hi", "top_logprobs_num": 10_000_000})
        chat = client.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 10_000_000})
        completion = client.post("/v1/completions", json={"prompt": "hi", "logprobs": 10_000_000})
        unlisted = client.post("/generate", json={"text": "hi", "sampling_params": {"stream_interval": 0}})
        sent = b'{"text": "hi",  "sampling_params": {"max_new_tokens": 1, "stop": null}}'
        forwarded = client.post("/generate", content=sent, headers={"content-type": "application/json"})
    assert (refused.status_code, refused.json()["error"]["message"]) == (
        400, "top_logprobs_num: Input should be less than or equal to 20")
    assert (chat.status_code, chat.json()["error"]["message"]) == (
        400, "top_logprobs: Input should be less than or equal to 20")
    assert (completion.status_code, completion.json()["error"]["message"]) == (
        400, "logprobs: Input should be less than or equal to 20")
    assert unlisted.status_code == 400 and unlisted.json()["error"]["message"].startswith(
        "sampling_params.stream_interval: not a field picrag forwards")
    assert fake.calls["/v1/chat/completions"] == fake.calls["/v1/completions"] == 0
    assert forwarded.status_code == 200 and fake.bodies["/generate"] == sent and len(seen) == 1


def test_unlisted_fields_pass_through_when_the_server_allows(default_model_dir):
    with fake_runtime(default_model_dir) as (fake, runtime_url), \
            frontend(runtime_url, pass_unlisted_fields=True) as url, httpx.Client(base_url=url, timeout=60) as client:
        passed = client.post("/generate", json={"text": "hi", "sampling_params": {"stream_interval": 2}})
        bounded = client.post("/generate", json={"text": "hi", "sampling_params": {"stream_interval": 2, "n": 64}})
    assert passed.status_code == 200 and json.loads(fake.bodies["/generate"])["sampling_params"] == {
        "stream_interval": 2}
    assert bounded.status_code == 400 and fake.calls["/generate"] == 1


def test_n_takes_a_slot_per_sequence(default_model_dir):
    """`n` and batches are counted against --max-inflight: with 4 slots and 3 sequences running,
    a request for 2 or 4 is a 503 (the slots are taken at once or not at all) and one for 5 a 400
    (never runnable); once the 3 are done, one for 4 runs."""
    release = asyncio.Event()
    started: list[dict] = []
    loop_of_runtime: list[asyncio.AbstractEventLoop] = []

    async def held(request: Request) -> Response:
        started.append(json.loads(await request.body()))
        loop_of_runtime.append(asyncio.get_running_loop())
        await release.wait()
        return JSONResponse({"text": "ok", "meta_info": {}})

    async def scenario(url: str) -> tuple[list[int], int]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            three = asyncio.create_task(client.post("/generate", json={"text": ["a", "b", "c"]}))
            while not started:
                await asyncio.sleep(0.01)
            statuses = [(await client.post("/generate", json={"text": "x", "sampling_params": {"n": n}})).status_code
                        for n in (2, 4)]
            too_many = await client.post("/generate", json={"text": ["a"] * 5})
            loop_of_runtime[0].call_soon_threadsafe(release.set)
            statuses.append((await three).status_code)
            statuses.append((await client.post("/generate", json={"text": "x", "sampling_params": {"n": 4}}))
                            .status_code)
            return statuses, too_many.status_code

    with fake_runtime(default_model_dir, held) as (_fake, runtime_url), \
            frontend(runtime_url, max_inflight=4, max_queue=0) as url:
        statuses, too_many = asyncio.run(scenario(url))
    assert statuses == [503, 503, 200, 200] and too_many == 400
