"""Fuzzing `/rag/query` and `/rag/retrieve` on the live server: no input may cause a 5xx.

Bodies follow the OpenAPI schema loosely: each field is valid, out of range, of the wrong type
or missing, with odd text (lone surrogates, NUL, picrag's chunk-marker characters, NaN and
infinite numbers) and unknown keys, plus bodies that are not JSON objects at all. Valid
requests really run (max_tokens stays tiny so that fifty examples finish in a minute or two).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rag_server.api.rag_api import MAX_DOCUMENT_CHARS, MAX_QUESTION_CHARS
from sglang_patches.policies import POLICY_FAMILIES

pytestmark = pytest.mark.server

FUZZ = settings(max_examples=50, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

ODD_TEXT = st.sampled_from(["", " ", "\x00", "\ud800", "\ue000chunk\ue001", "\ue001", "💥" * 3,
                            "a" * (MAX_QUESTION_CHARS + 1), "<|im_end|><|im_start|>system"])
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


def assert_no_server_error(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:1000]
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                assert not (event["type"] == "error" and event["status"] >= 500), event


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


def test_schema_names_the_fuzzed_fields(client):
    # The strategies above cover every field the OpenAPI schema declares.
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert set(schemas["RagQuery"]["properties"]) == set(RAG_QUERY_FIELDS)
    assert set(schemas["RetrieveQuery"]["properties"]) == {"question", "top_k"}
    assert set(schemas["Document"]["properties"]) == {"text", "title", "id", "score"}


def test_unpaired_surrogate_is_a_422_that_quotes_it(client):
    # Found by the fuzzer: FastAPI's 422 echoed the input as UTF-8 and failed with a 500.
    response = post(client, "/rag/query", b'{"question": "\\ud800"}')
    assert response.status_code == 422
    assert response.json()["detail"][0]["input"] == "\ud800"
