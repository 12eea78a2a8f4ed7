"""`picrag ask`: answer a JSONL file of questions through a running picrag server.

Rows follow the shared QA format (retrieval/qa_rows.py). Passages come, in this order of
preference, from a local index (`--index DIR`, retrieved here and sent inline with their
scores), from the row itself, or from the server's own index. Every answer is appended to
`--out` as soon as it arrives, so an interrupted run resumes where it stopped: ids already in
`--out` are skipped. Scores follow rag_server/bench/scoring.py (SQuAD EM/F1 of the first line).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import httpx
from tqdm import tqdm

from rag_server.bench.scoring import Score, mean_scores, score_answer
from retrieval.qa_rows import QARow, QARowError, read_qa_rows

if TYPE_CHECKING:
    from retrieval.retriever import Retriever

# The papers' convention: greedy decoding, at most 32 new tokens.
DEFAULT_MAX_TOKENS = 32


class BatchError(RuntimeError):
    """A problem that stops the whole run (bad input file, server unreachable)."""


@dataclass(frozen=True)
class AskOptions:
    url: str
    policy: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    top_k: int | None = None
    max_passages: int | None = None  # inline passages: the first N only
    supporting_only: bool = False  # inline passages: only those marked is_supporting
    server_index: bool = False  # ignore the rows' passages: the server retrieves
    timeout_s: float = 600.0


def read_questions(path: Path, limit: int | None = None) -> list[QARow]:
    try:
        questions = read_qa_rows(path, limit)
    except QARowError as exc:
        raise BatchError(str(exc)) from exc
    seen: set[str] = set()
    for question in questions:
        if question.id in seen:
            raise BatchError(f"{path}: id {question.id!r} appears twice (ids make runs resumable)")
        seen.add(question.id)
    return questions


def read_answers(path: Path) -> dict[str, dict[str, Any]]:
    """Rows already in an answers file, by id; a line cut short by an interrupted run is ignored."""
    answers: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return answers
    with path.open(encoding="utf-8") as rows:
        for line in rows:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "id" in row and "answer" in row:
                answers[str(row["id"])] = row
    return answers


class Asker:
    def __init__(self, options: AskOptions, retriever: Retriever | None = None):
        self.options = options
        self.retriever = retriever
        self.client = httpx.Client(base_url=options.url, timeout=options.timeout_s)

    def close(self) -> None:
        self.client.close()

    def documents(self, question: QARow) -> list[dict[str, Any]] | None:
        options = self.options
        if self.retriever is not None:
            found = self.retriever.search(question.question, options.top_k or 5)
            return [{"id": p.id, "title": p.title, "text": p.text, "score": p.score} for p in found]
        if options.server_index or not question.passages:
            return None
        passages = question.supporting_passages if options.supporting_only else question.passages
        if options.max_passages is not None:
            passages = passages[: options.max_passages]
        return [{"title": p.title, "text": p.text} for p in passages] or None

    def ask(self, question: QARow) -> dict[str, Any]:
        body: dict[str, Any] = {"question": question.question, "max_tokens": self.options.max_tokens,
                                "temperature": 0.0}
        documents = self.documents(question)
        if documents is not None:
            body["documents"] = documents
        elif self.options.top_k is not None:
            body["top_k"] = self.options.top_k
        if self.options.policy:
            body["policy"] = self.options.policy
        try:
            response = self.client.post("/rag/query", json=body)
        except httpx.HTTPError as exc:
            raise BatchError(f"cannot reach the picrag server at {self.options.url}: {exc}") from exc
        if response.status_code >= 500 or response.status_code in (404, 405):
            raise BatchError(f"server answered {response.status_code}: {response.text[:300]}")
        if response.status_code != 200:
            raise ValueError(f"question {question.id}: server answered {response.status_code}: {response.text[:300]}")
        result = response.json()
        row = {"id": question.id, "question": question.question, "answer": result["answer"]}
        if question.answers:
            score = score_answer(result["answer"], question.answers)
            row.update(answers=question.answers, em=score.em, f1=score.f1)
        row.update({key: result[key] for key in ("policy", "sources", "dropped", "usage", "timings")})
        return row


@dataclass
class BatchSummary:
    total: int
    answered: int
    new: int
    failed: int
    score: Score | None
    scored: int


def summarise(questions: Iterable[QARow], answers: dict[str, dict[str, Any]], new: int, failed: int) -> BatchSummary:
    questions = list(questions)
    done = [q for q in questions if q.id in answers]
    # Re-scored from the stored answer text, so rows from earlier runs count the same way.
    scores = [score_answer(answers[q.id]["answer"], q.answers) for q in done if q.answers]
    return BatchSummary(
        total=len(questions), answered=len(done), new=new, failed=failed,
        score=mean_scores(scores) if scores else None, scored=len(scores),
    )


def run_batch(questions_path: Path, out_path: Path, options: AskOptions, *, limit: int | None = None,
              index_dir: Path | None = None, progress: bool = True, report: TextIO = sys.stdout) -> BatchSummary:
    questions = read_questions(questions_path, limit)
    answers = read_answers(out_path)
    todo = [q for q in questions if q.id not in answers]
    retriever = None
    if index_dir is not None and todo:
        from retrieval.retriever import Retriever

        retriever = Retriever.open(index_dir)
    asker = Asker(options, retriever)
    failed = 0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with out_path.open("a", encoding="utf-8") as out, tqdm(
            total=len(todo), desc="picrag ask", unit="q", disable=not progress, file=sys.stderr
        ) as bar:
            for question in todo:
                try:
                    row = asker.ask(question)
                except ValueError as exc:  # this question only; the others may still work
                    tqdm.write(f"skipped {exc}", file=sys.stderr)
                    failed += 1
                else:
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")
                    out.flush()
                    answers[question.id] = row
                bar.update()
    finally:
        asker.close()
    summary = summarise(questions, answers, len(todo) - failed, failed)
    print(f"answered {summary.answered}/{summary.total} questions ({summary.new} this run, "
          f"{summary.failed} failed) -> {out_path}", file=report)
    if summary.score is not None:
        print(f"EM {summary.score.em:.4f}  F1 {summary.score.f1:.4f}  over {summary.scored} questions with gold answers",
              file=report)
    return summary
