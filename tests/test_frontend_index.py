"""Retrieval through the frontend: `/rag/query` without documents, `/rag/retrieve`, the DSL's
`retrieve`, and `picrag ask` with a local index.

A second frontend with `index_dir` runs in this process (uvicorn in a thread) in front of the
shared server, whose native routes it proxies like a runtime: the code under test is the same
`create_app` that `picrag serve --index DIR` runs, without starting a second model runtime.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from rag_server.bench.batch_qa import AskOptions, run_batch
from rag_server.linking.policy_resolver import DEFAULT_POLICY
from tests.inprocess_frontend import frontend

pytestmark = pytest.mark.server

ROWS = 2  # hotpotqa dev rows whose passages (10 each) make the index


@pytest.fixture(scope="module")
def rows(shared_qa) -> list[dict]:
    with (shared_qa / "hotpotqa.dev.jsonl").open() as lines:
        return [json.loads(next(lines)) for _ in range(ROWS)]


@pytest.fixture(scope="module")
def retriever(rows):
    from retrieval.passage import Passage
    from retrieval.retriever import Retriever

    retriever = Retriever.create()
    retriever.add(Passage.from_text(p["text"], p["title"]) for row in rows for p in row["passages"])
    return retriever


@pytest.fixture(scope="module")
def index_dir(retriever, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("index")
    retriever.save(directory)
    return directory


@pytest.fixture(scope="module")
def index_frontend(picrag_server, index_dir):
    with frontend(picrag_server.runtime_url, index_dir=index_dir) as url:
        yield url


def expected_sources(retriever, question: str, k: int) -> list[dict]:
    return [{"id": p.id, "title": p.title, "score": pytest.approx(p.score, abs=1e-5)}
            for p in retriever.search(question, k)]


def test_rag_query_retrieves_from_the_index(index_frontend, retriever, rows):
    question = rows[0]["question"]
    with httpx.Client(base_url=index_frontend, timeout=600) as client:
        result = client.post("/rag/query", json={"question": question, "top_k": 2, "max_tokens": 8}).json()
    assert result["sources"] == expected_sources(retriever, question, 2)
    scores = [s["score"] for s in result["sources"]]
    assert scores == sorted(scores, reverse=True)
    assert result["timings"]["retrieval_ms"] > 0
    assert result["usage"]["reused_tokens"] > 0 and result["policy"] == DEFAULT_POLICY


def test_streamed_retrieval_reports_sources_in_the_final_event(index_frontend, retriever, rows):
    question = rows[1]["question"]
    with httpx.Client(base_url=index_frontend, timeout=600) as client, client.stream(
        "POST", "/rag/query", json={"question": question, "top_k": 2, "max_tokens": 6, "stream": True}
    ) as response:
        events = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1]["type"] == "done"
    assert events[-1]["sources"] == expected_sources(retriever, question, 2)


def test_retrieve_route_and_dsl_helper(index_frontend, retriever, rows):
    from rag_server.dsl import retrieve

    question = rows[0]["question"]
    expected = retriever.search(question, 3)
    with httpx.Client(base_url=index_frontend, timeout=60) as client:
        retrieved = client.post("/rag/retrieve", json={"question": question, "top_k": 3}).json()
        assert client.post("/rag/retrieve", json={"question": " ", "top_k": 3}).status_code == 422
    assert [p["id"] for p in retrieved["passages"]] == [p.id for p in expected]
    assert retrieved["passages"][0]["text"] == expected[0].text
    assert [p.id for p in retrieve(index_frontend, question, k=3)] == [p.id for p in expected]


def test_ask_with_a_local_index_or_the_servers(index_frontend, picrag_server, index_dir, rows, tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(row) + "\n" for row in rows))
    local, remote = tmp_path / "local.jsonl", tmp_path / "remote.jsonl"
    options = dict(top_k=2, max_tokens=8, policy="naive")
    run_batch(questions, local, AskOptions(url=picrag_server.url, **options), index_dir=index_dir,
              progress=False)
    run_batch(questions, remote, AskOptions(url=index_frontend, server_index=True, **options), progress=False)
    local_rows = [json.loads(line) for line in local.read_text().splitlines()]
    remote_rows = [json.loads(line) for line in remote.read_text().splitlines()]
    assert [r["id"] for r in local_rows] == [r["id"] for r in remote_rows] == [row["id"] for row in rows]
    for here, there in zip(local_rows, remote_rows):
        # The same passages, retrieved here or by the server, give the same prompt and answer.
        assert [s["id"] for s in here["sources"]] == [s["id"] for s in there["sources"]]
        assert here["usage"]["prompt_tokens"] == there["usage"]["prompt_tokens"]
        assert here["answer"] == there["answer"]
