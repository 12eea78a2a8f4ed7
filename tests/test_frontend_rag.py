"""`/rag/query` on the real server: the same tokens as a hand-built prompt, reuse counters,
streaming, and 4xx answers with a message for bad input."""

from __future__ import annotations

import json

import httpx
import pytest

from retrieval.prompt_layout import PromptLayout, PromptPassage
from rag_server.api.rag_api import MAX_BODY_BYTES, MAX_DOCUMENTS, MAX_QUESTION_CHARS
from rag_server.linking.policy_resolver import DEFAULT_POLICY
from retrieval.passage import passage_id
from picrag_core.link_hints import link_hints

pytestmark = pytest.mark.server

DOCUMENTS = [
    {"title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris, France."},
    {"title": "Big Ben", "text": "Big Ben is the nickname for the Great Bell of the clock at the Palace of Westminster in London."},
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(picrag_server):
    with picrag_server.client() as client:
        yield client


def rag_query(client: httpx.Client, **body) -> dict:
    response = client.post("/rag/query", json={"max_tokens": MAX_TOKENS, **body})
    assert response.status_code == 200, response.text
    return response.json()


def built_prompt(layout: PromptLayout, question: str):
    return layout.build(question, [PromptPassage(d["title"], d["text"]) for d in DOCUMENTS])


@pytest.mark.parametrize("policy", ["full", "naive"])
def test_answer_equals_generate_on_the_documented_prompt_layout(client, layout, policy):
    question = f"Where is the Eiffel Tower? ({policy})"
    prompt = built_prompt(layout, question)
    generated = client.post("/generate", json={
        "input_ids": prompt.input_ids, "kv_hints": link_hints(policy, prompt.chunks),
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS},
    }).json()
    result = rag_query(client, question=question, documents=DOCUMENTS, policy=policy)
    assert result["answer"] == generated["text"].strip()
    assert result["policy"] == policy
    assert result["usage"]["prompt_tokens"] == len(prompt.input_ids)
    assert result["usage"]["completion_tokens"] == generated["meta_info"]["completion_tokens"]
    assert result["sources"] == [{"id": passage_id(d["text"]), "title": d["title"], "score": None} for d in DOCUMENTS]
    assert result["dropped"] == [] and result["warnings"] == []


def test_reuse_counters_full_versus_naive(client, layout):
    question = "Which city has the Great Bell?"
    prompt = built_prompt(layout, question)
    linked = len(layout.head_ids) + prompt.chunk_tokens
    full = rag_query(client, question=question, documents=DOCUMENTS, policy="full")
    assert full["usage"]["reused_tokens"] == 0
    assert full["usage"]["computed_tokens"] == len(prompt.input_ids)
    naive = rag_query(client, question=question, documents=DOCUMENTS, policy="naive")
    usage = naive["usage"]
    # Every passage and the head come from the chunk store; the question is computed.
    assert usage["reused_tokens"] >= linked
    assert usage["computed_tokens"] == usage["prompt_tokens"] - usage["reused_tokens"] >= 1
    timings = naive["timings"]
    assert timings["retrieval_ms"] == 0.0
    assert 0 < timings["compile_ms"] <= timings["ttft_ms"] <= timings["total_ms"]


def test_default_policy_is_cacherepair(client):
    assert DEFAULT_POLICY == "cacherepair"
    assert rag_query(client, question="Where is Big Ben?", documents=DOCUMENTS)["policy"] == DEFAULT_POLICY


def test_streaming_sends_tokens_then_a_final_event_equal_to_the_plain_answer(client):
    body = {"question": "Where is Big Ben?", "documents": DOCUMENTS, "max_tokens": MAX_TOKENS, "policy": "full"}
    plain = rag_query(client, **body)
    with client.stream("POST", "/rag/query", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data:"):]) for line in response.iter_lines() if line.startswith("data:")]
    *tokens, done = events
    assert tokens and all(e["type"] == "token" for e in tokens)
    assert done["type"] == "done"
    assert "".join(e["text"] for e in tokens).strip() == done["answer"] == plain["answer"]
    assert done["sources"] == plain["sources"] and done["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert done["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert 0 < done["timings"]["ttft_ms"] <= done["timings"]["total_ms"]


def _error(response: httpx.Response) -> str:
    detail = response.json()["detail"]
    return detail if isinstance(detail, str) else " ".join(f"{e['loc'][-1]}: {e['msg']}" for e in detail)


@pytest.mark.parametrize("body, status, message", [
    ({"question": "   ", "documents": DOCUMENTS}, 422, "question is empty"),
    ({"question": "", "documents": DOCUMENTS}, 422, "at least 1 character"),
    ({"documents": DOCUMENTS}, 422, "question: Field required"),
    ({"question": "Q?", "documents": DOCUMENTS, "policy": "bogus"}, 422, "unknown policy 'bogus'; known: full"),
    ({"question": "Q?", "top_k": 0}, 422, "top_k: Input should be greater than 0"),
    ({"question": "Q?", "top_k": -3}, 422, "greater than 0"),
    ({"question": "Q?", "top_k": 10**6}, 422, "top_k: Input should be less than or equal to 50"),
    ({"question": "Q?", "documents": []}, 422, "documents: List should have at least 1 item"),
    ({"question": "Q?", "documents": [{"title": "no text"}]}, 422, "text: Field required"),
    ({"question": "Q?", "documents": DOCUMENTS, "max_tokens": 0}, 422, "max_tokens"),
    ({"question": "Q?", "documents": DOCUMENTS, "max_tokens": 10**6}, 422, "less than or equal to 2048"),
    ({"question": "Q?", "documents": DOCUMENTS, "temperature": -1}, 422, "temperature"),
    ({"question": "Q?", "documents": DOCUMENTS, "topk": 3}, 422, "topk: Extra inputs are not permitted"),
    ({"question": "x" * (MAX_QUESTION_CHARS + 1), "documents": DOCUMENTS}, 422, "question: String should have at most"),
    ({"question": "Q?", "documents": DOCUMENTS * (MAX_DOCUMENTS // 2 + 1)}, 422, "documents: List should have at most 64"),
    ({"question": "Q?", "documents": [{"text": "x" * 20_001}]}, 422, "text: String should have at most 20000"),
    ({"question": "Where?"}, 400, "no passage index is loaded"),
])
def test_bad_requests_get_4xx_with_a_message(client, body, status, message):
    response = client.post("/rag/query", json=body)
    assert response.status_code == status, response.text
    assert message in _error(response)


def test_malformed_json_and_oversized_bodies(client):
    response = client.post("/rag/query", content=b'{"question": "Q?",', headers={"content-type": "application/json"})
    assert response.status_code == 422 and "JSON decode error" in response.text
    response = client.post("/rag/query", content=b'["not", "an", "object"]', headers={"content-type": "application/json"})
    assert response.status_code == 422
    oversized = json.dumps({"question": "Q?", "documents": [{"text": "x" * (MAX_BODY_BYTES + 1)}]})
    response = client.post("/rag/query", content=oversized, headers={"content-type": "application/json"})
    assert response.status_code == 413 and f"over {MAX_BODY_BYTES} bytes" in response.json()["detail"]


def test_openapi_documents_the_rag_routes(client):
    schema = client.get("/openapi.json").json()
    assert {"/rag/query", "/rag/retrieve"} <= set(schema["paths"])
    assert "question" in schema["components"]["schemas"]["RagQuery"]["properties"]
    assert client.get("/docs").status_code == 200
