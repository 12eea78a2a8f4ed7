"""Every script in examples/ runs as written against the server `make serve` starts
(`shipped_checkpoint_server`: the default model whole, its shipped CacheRepair checkpoint), and
its answers are checked where the default policy answers rightly (Big Ben: see the xfail below)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rag_server.bench.batch_qa import read_questions
from rag_server.bench.scoring import mean_scores, score_answer

pytestmark = pytest.mark.server

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(command: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})}, cwd=EXAMPLES.parent)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_curl_example(shipped_checkpoint_server):
    out = run(["bash", str(EXAMPLES / "curl_rag_query.sh"), shipped_checkpoint_server.url])
    answer = json.loads(out.splitlines()[0])
    assert "Paris" in answer["answer"] and [s["title"] for s in answer["sources"]] == ["Eiffel Tower", "Big Ben"]
    events = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("data:")]
    assert events[-1]["type"] == "done" and "Big Ben" in events[-1]["answer"]  # London: see below


def test_python_client_example(shipped_checkpoint_server):
    out = run([sys.executable, str(EXAMPLES / "python_client.py"), shipped_checkpoint_server.url])
    assert "answer: The Eiffel Tower is located in Paris, France." in out
    assert "streamed answer: Big Ben" in out  # London: see below


def test_openai_example(shipped_checkpoint_server):
    out = run([sys.executable, str(EXAMPLES / "openai_chat.py"), shipped_checkpoint_server.url])
    lines = out.splitlines()
    assert lines[0].startswith("plain chat: ")
    assert lines[1].startswith("rag chat: Big Ben")  # London: see below
    assert "sources: ['Eiffel Tower', 'Big Ben']" in lines[2]
    assert lines[3].startswith("rag chat, streamed: ") and "Paris" in lines[3]
    assert lines[4].startswith("documents in the message: ") and lines[6].startswith("documents in the message: ")
    assert lines[5].strip().startswith("3 passages found, reused ") and lines[7] == lines[5]


@pytest.mark.xfail(strict=True, reason=(
    "make serve's default policy (cacherepair, the shipped checkpoint) answers the examples' Big Ben "
    "question 'Big Ben is a legendary iron lattice tower in Paris, France.' on their one-sentence "
    "passages; full, prefix, naive and cacherepair+legolink:8 answer London (2026-12-07, issue 51)"))
def test_the_default_policy_puts_big_ben_in_london(shipped_checkpoint_server):
    """The Big Ben question the examples ask, as they send it: the default policy's answer."""
    from examples.python_client import DOCUMENTS

    with shipped_checkpoint_server.client() as client:
        answer = client.post("/rag/query", json={"question": "Where is Big Ben?", "documents": DOCUMENTS,
                                                 "max_tokens": 16}).json()
    assert answer["policy"] == "cacherepair" and "London" in answer["answer"], answer


def test_dsl_example(shipped_checkpoint_server):
    out = run([sys.executable, str(EXAMPLES / "dsl_rag.py"), shipped_checkpoint_server.url])
    assert "A: The Eiffel Tower is located in Paris, France." in out
    assert out.count("reused ") == 2 and "reused None" not in out
    assert "fork/join: the landmark in Paris is the Eiffel Tower" in out


def test_batch_qa_example_scores_and_resumes(shipped_checkpoint_server, shared_qa, tmp_path):
    answers = tmp_path / "answers.jsonl"
    env = {"OUT": str(answers), "QA_DIR": str(shared_qa), "PICRAG": str(Path(sys.executable).with_name("picrag"))}
    command = ["bash", str(EXAMPLES / "batch_qa.sh"), shipped_checkpoint_server.url, "5"]
    first = run(command, env)
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    questions = read_questions(shared_qa / "hotpotqa.dev.jsonl", limit=5)
    assert [r["id"] for r in rows] == [q.id for q in questions]
    score = mean_scores(score_answer(r["answer"], q.answers) for r, q in zip(rows, questions))
    summary = f"EM {score.em:.4f}  F1 {score.f1:.4f}  over 5 questions with gold answers"
    assert "answered 5/5 questions (5 this run, 0 failed)" in first and summary in first
    assert all(r["em"] == score_answer(r["answer"], r["answers"]).em for r in rows)
    # Supporting passages only: 2 per HotpotQA row.
    assert all(len(r["sources"]) == 2 for r in rows)

    assert "(0 this run, 0 failed)" in run(command, env)  # nothing left to answer
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    resumed = run(command, env)
    assert "answered 5/5 questions (2 this run, 0 failed)" in resumed and summary in resumed
