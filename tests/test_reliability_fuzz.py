"""Fuzzing the live server: no input may cause a 5xx, and the server stays healthy after.

The RAG routes (`/rag/query`, `/rag/retrieve`), the OpenAI routes (`/v1/chat/completions` with and
without the `picrag` extension, `/v1/completions`) and SGLang's `/generate` (plain, with
`picrag.link`/`picrag.compile` hints, with picrag's own namespaces as `extra_key`). Bodies follow
the schemas loosely: each field is valid, out of range, of the wrong type or missing, with odd
text (lone surrogates, NUL, picrag's chunk-marker characters, the prompt layout's placeholder),
NaN, infinite and overflowing numbers, token ids outside the vocabulary and unknown keys, plus
bodies that are not JSON objects at all. Valid requests really run (token budgets stay tiny so
that fifty examples finish in a minute or two).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rag_server.api.rag_api import MAX_DOCUMENT_CHARS, MAX_QUESTION_CHARS
from retrieval.prompt_layout import _PLACEHOLDER
from picrag_core.link_hints import COMPILE_ACTION, LINK_ACTION, LINK_FIELDS
from picrag_core.policies import POLICY_FAMILIES

pytestmark = pytest.mark.server

FUZZ = settings(max_examples=50, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

ODD_TEXT = st.sampled_from(["", " ", "\x00", "\ud800", "\ue000chunk\ue001", "\ue001", "💥" * 3,
                            "a" * (MAX_QUESTION_CHARS + 1), "<|im_end|><|im_start|>system", _PLACEHOLDER,
                            f"before {_PLACEHOLDER} after"])
TEXT = st.one_of(st.text(max_size=40), ODD_TEXT)
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                 st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
NUMBER = st.one_of(st.integers(-3, 3), st.sampled_from([51, 2_049, 10**12, -(2**63)]),
                   st.floats(allow_nan=True, allow_infinity=True))


def maybe(value: st.SearchStrategy) -> st.SearchStrategy:
    """The field's value, a wrong-typed value, or the field left out (`...`)."""
    return st.one_of(value, value, JUNK, st.just(...))


DOCUMENT = st.one_of(
    st.fixed_dictionaries({"text": maybe(st.one_of(TEXT, st.just("x" * (MAX_DOCUMENT_CHARS + 1))))},
                          optional={"title": maybe(TEXT), "id": maybe(TEXT), "score": maybe(NUMBER),
                                    "extra": JUNK}),
    JUNK,
)
RAG_QUERY_FIELDS = {
    "question": maybe(TEXT),
    "documents": maybe(st.lists(DOCUMENT, max_size=4)),
    "top_k": maybe(NUMBER),
    # Valid sizes stay tiny (a real generation runs); invalid ones test the limits.
    "max_tokens": maybe(st.one_of(st.integers(1, 3), NUMBER)),
    "temperature": maybe(NUMBER),
    "policy": maybe(st.one_of(st.sampled_from(list(POLICY_FAMILIES)), TEXT)),
    "stream": maybe(st.booleans()),
}
RAG_QUERY = st.fixed_dictionaries(RAG_QUERY_FIELDS, optional={"unknown": JUNK})
RETRIEVE_QUERY = st.fixed_dictionaries({"question": maybe(TEXT), "top_k": maybe(NUMBER)},
                                       optional={"unknown": JUNK})
POLICY = st.one_of(st.sampled_from([*POLICY_FAMILIES, "legolink:4", "cacheblend:0.3", "legolink:" + "9" * 30]), TEXT)
# The model's vocabulary has 49,152 ids: valid ones, its edges, and beyond int64.
TOKEN_ID = st.one_of(st.integers(0, 300), st.sampled_from([-1, 49_151, 49_152, 999_999, 2**63, 2**70]))
TOKEN_IDS = st.lists(TOKEN_ID, max_size=12)
SPAN = st.one_of(st.lists(st.one_of(st.integers(-2, 14), NUMBER), min_size=2, max_size=2),
                 st.lists(st.integers(0, 14), max_size=3), JUNK)
LINK_PAYLOAD_FIELDS = {
    "policy": maybe(POLICY), "chunks": maybe(st.lists(SPAN, max_size=3)), "k": maybe(NUMBER),
    "ratio": maybe(NUMBER), "layout": maybe(st.sampled_from(["legolink", "original", "sideways"])),
    "sink_token": maybe(TOKEN_ID), "on_miss": maybe(st.sampled_from(["refuse", "compute", "drop"])),
    "first_token_logprobs": maybe(st.one_of(st.booleans(), JUNK)),
    "recompute": maybe(st.lists(SPAN, max_size=3)), "context_attention": maybe(st.one_of(st.booleans(), JUNK)),
    "tail": maybe(st.one_of(st.lists(TOKEN_ID, max_size=10), JUNK)),
    "span_logprobs": maybe(st.one_of(st.integers(-2, 70), JUNK)),
}
LINK_PAYLOAD = st.fixed_dictionaries({}, optional={**LINK_PAYLOAD_FIELDS, "extra_key": JUNK})
ACTION = st.fixed_dictionaries({
    "action_id": maybe(TEXT), "action_type": maybe(st.sampled_from([LINK_ACTION, COMPILE_ACTION, "other.action"])),
    "action_version": maybe(st.sampled_from(["1", "2"])), "payload": maybe(st.one_of(LINK_PAYLOAD, st.just({}))),
})
KV_HINTS = st.one_of(JUNK, st.fixed_dictionaries({
    "protocol_version": maybe(st.just("1")), "message_id": maybe(TEXT), "actions": maybe(st.lists(ACTION, max_size=2)),
}))
# Valid token budgets stay tiny; the rest test the limits.
TOKEN_BUDGET = st.one_of(st.integers(0, 3), st.sampled_from([-1, 10**12, 2**70]), st.floats(allow_nan=True))
EXTRA_KEY = st.one_of(TEXT, st.sampled_from(["picrag:chunk", "picrag:naive", "picrag:legolink:16:0"]),
                      st.lists(TEXT, max_size=2))
SAMPLING = st.fixed_dictionaries({}, optional={
    "max_new_tokens": maybe(TOKEN_BUDGET), "temperature": maybe(NUMBER), "top_p": maybe(NUMBER),
    "stop": maybe(TEXT), "unknown": JUNK,
})
GENERATE = st.fixed_dictionaries({"sampling_params": maybe(SAMPLING)}, optional={
    "input_ids": maybe(st.one_of(TOKEN_IDS, st.lists(TOKEN_IDS, max_size=2))), "text": maybe(TEXT),
    "kv_hints": KV_HINTS, "extra_key": maybe(EXTRA_KEY), "stream": maybe(st.booleans()),
    "return_logprob": maybe(st.booleans()),
})
MESSAGE = st.one_of(st.fixed_dictionaries({
    "role": maybe(st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), TEXT)),
    "content": maybe(st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": maybe(st.just("text")),
                                                                      "text": maybe(TEXT)}), max_size=2))),
}), JUNK)
PICRAG_EXTENSION = st.one_of(st.fixed_dictionaries({}, optional={
    "documents": maybe(st.lists(DOCUMENT, max_size=3)), "top_k": maybe(NUMBER), "policy": maybe(POLICY),
    "unknown": JUNK,
}), JUNK)
CHAT_FIELDS = {
    "messages": maybe(st.lists(MESSAGE, max_size=3)), "max_tokens": maybe(TOKEN_BUDGET),
    "temperature": maybe(NUMBER), "top_p": maybe(NUMBER), "stop": maybe(TEXT), "n": maybe(st.integers(-1, 2)),
    "stream": maybe(st.booleans()), "extra_key": maybe(EXTRA_KEY), "model": maybe(TEXT),
}
CHAT = st.fixed_dictionaries(CHAT_FIELDS, optional={"unknown": JUNK})
RAG_CHAT = st.fixed_dictionaries({**CHAT_FIELDS, "picrag": PICRAG_EXTENSION}, optional={"unknown": JUNK})
COMPLETION = st.fixed_dictionaries({
    "prompt": maybe(st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, max_size=2))), "max_tokens": maybe(TOKEN_BUDGET),
}, optional={"temperature": maybe(NUMBER), "stream": maybe(st.booleans()), "extra_key": maybe(EXTRA_KEY),
             "model": maybe(TEXT), "unknown": JUNK})
NOT_AN_OBJECT = st.one_of(st.binary(max_size=30), JUNK.map(lambda v: json.dumps(v).encode()),
                          st.just(b'{"question": "unterminated'))


def without_missing(value):
    """Drop the fields drawn as left out (`...`), at any depth (documents are objects too)."""
    if isinstance(value, dict):
        return {k: without_missing(v) for k, v in value.items() if v is not ...}
    if isinstance(value, list):
        return [without_missing(v) for v in value]
    return value


def encode(body: dict) -> bytes:
    # allow_nan: NaN/Infinity are not JSON, but Python clients send them and the server parses them.
    return json.dumps(without_missing(body)).encode()


def _event_status(event) -> int:
    """The HTTP status an error event of a stream reports (picrag's RAG events, or SGLang's and
    OpenAI's `{"error": {"code": ...}}`); 200 for any other event."""
    if not isinstance(event, dict):
        return 200
    if event.get("type") == "error":
        return event["status"]
    error = event.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        return code if isinstance(code, int) else 500
    return 200


def assert_no_server_error(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:1000]
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                event = json.loads(line[5:])
                assert _event_status(event) < 500, event


def assert_healthy(client: httpx.Client) -> None:
    """The frontend reports its runtime healthy, and the runtime still generates."""
    assert client.get("/health").status_code == 200
    response = client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 1}})
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def client(picrag_server):
    with picrag_server.client(timeout=300) as client:
        yield client


def post(client: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return client.post(path, content=content, headers={"content-type": "application/json"})


@FUZZ
@given(body=RAG_QUERY)
def test_fuzz_rag_query(client, body):
    assert_no_server_error(post(client, "/rag/query", encode(body)))


@FUZZ
@given(body=st.one_of(RETRIEVE_QUERY.map(encode), NOT_AN_OBJECT), path=st.sampled_from(["/rag/retrieve", "/rag/query"]))
def test_fuzz_retrieve_and_malformed_bodies(client, body, path):
    assert_no_server_error(post(client, path, body))


def fuzz_route(client: httpx.Client, path: str, bodies: st.SearchStrategy) -> None:
    """Fuzz one route, then check the server survived it."""
    @FUZZ
    @given(body=bodies)
    def run(body):
        assert_no_server_error(post(client, path, encode(body)))

    run()
    assert_healthy(client)


def test_fuzz_generate(client):
    fuzz_route(client, "/generate", GENERATE)


def test_fuzz_chat_completions(client):
    fuzz_route(client, "/v1/chat/completions", CHAT)


def test_fuzz_chat_completions_with_the_picrag_extension(client):
    fuzz_route(client, "/v1/chat/completions", RAG_CHAT)


def test_fuzz_completions(client):
    fuzz_route(client, "/v1/completions", COMPLETION)


def test_schema_names_the_fuzzed_fields(client):
    # The strategies above cover every field the OpenAPI schema declares.
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert set(schemas["RagQuery"]["properties"]) == set(RAG_QUERY_FIELDS)
    assert set(schemas["RetrieveQuery"]["properties"]) == {"question", "top_k"}
    assert set(schemas["Document"]["properties"]) == {"text", "title", "id", "score"}
    # ... and every field a picrag.link payload may carry.
    assert set(LINK_PAYLOAD_FIELDS) == set(LINK_FIELDS)


DOCUMENTS = [{"title": "Paris", "text": "Paris is the capital of France."}]


@pytest.mark.parametrize("path, body", [
    ("/rag/query", {"question": f"What is {_PLACEHOLDER}?", "documents": DOCUMENTS, "max_tokens": 1}),
    ("/v1/chat/completions", {"max_tokens": 1, "picrag": {"documents": DOCUMENTS}, "messages": [
        {"role": "system", "content": f"Be brief {_PLACEHOLDER}"},
        {"role": "user", "content": _PLACEHOLDER}, {"role": "assistant", "content": f"{_PLACEHOLDER}\x00"},
        {"role": "user", "content": f"What is {_PLACEHOLDER}?"}]}),
])
def test_the_layout_placeholder_in_a_message_is_answered(client, path, body):
    # Found by reading prompt_layout: the chat template is split at this placeholder.
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("score", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_nan_and_infinite_document_scores_are_4xx(client, score):
    document = b'{"text": "Paris is in France.", "score": ' + score + b"}"
    response = post(client, "/rag/query", b'{"question": "Where?", "max_tokens": 1, "documents": [' + document + b"]}")
    assert response.status_code == 422, response.text
    chat = (b'{"messages": [{"role": "user", "content": "Where?"}], "max_tokens": 1, "picrag": {"documents": ['
            + document + b"]}}")
    response = post(client, "/v1/chat/completions", chat)
    assert response.status_code == 400, response.text


@pytest.mark.parametrize("payload", [
    b'{"policy": "naive", "chunks": [[0, 1e400]]}', b'{"policy": "naive", "chunks": [[0, 1180591620717411303424]]}',
    b'{"policy": "naive", "chunks": [[-1180591620717411303424, 2]]}', b'{"policy": "naive", "chunks": [[0, NaN]]}',
    b'{"policy": "legolink", "chunks": [[0, 2]], "k": 1e400}', b'{"policy": "legolink", "chunks": [[0, 2]], "k": '
    b'1180591620717411303424}', b'{"policy": "cacheblend", "chunks": [[0, 2]], "ratio": -1e400}',
    b'{"policy": "legolink:99999999999999999999999999", "chunks": [[0, 2]]}',
])
def test_overflowing_numbers_in_link_hints_are_4xx(client, payload):
    hints = b'{"protocol_version": "1", "message_id": "m", "actions": [{"action_id": "a", "action_type": ' \
            b'"picrag.link", "action_version": "1", "payload": ' + payload + b"}]}"
    body = b'{"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1}, "kv_hints": ' + hints + b"}"
    response = post(client, "/generate", body)
    assert response.status_code == 400, response.text
    assert_healthy(client)


def test_unpaired_surrogate_is_a_422_that_quotes_it(client):
    # Found by the fuzzer: FastAPI's 422 echoed the input as UTF-8 and failed with a 500.
    response = post(client, "/rag/query", b'{"question": "\\ud800"}')
    assert response.status_code == 422
    assert response.json()["detail"][0]["input"] == "\ud800"
