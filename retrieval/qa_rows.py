"""The shared QA format, read in one place: JSONL rows of `id`, `question`, optional gold
`answers`, optional `passages` of `{"title", "text", "is_supporting"}`.

`picrag ask`, `picrag bench quality|load` and CacheRepair's training data all read their
questions and passages through `read_qa_rows`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from retrieval.prompt_layout import PromptPassage


class QARowError(ValueError):
    """A row that is not in the shared QA format (the message names the file and line)."""


@dataclass(frozen=True)
class QARow:
    id: str
    question: str
    answers: tuple[str, ...] = ()
    passages: tuple[PromptPassage, ...] = ()
    supporting: tuple[bool, ...] = ()  # per passage: the dataset marks it supporting
    kind: str = ""  # the dataset's question type (HotpotQA's and 2Wiki's `type`, MuSiQue's `hops`), if any

    @property
    def supporting_passages(self) -> tuple[PromptPassage, ...]:
        return tuple(p for p, keep in zip(self.passages, self.supporting) if keep)


def _row(record: Any) -> QARow:
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    try:
        qid, question = str(record["id"]), record["question"]
    except KeyError as exc:
        raise ValueError(f"a row needs `id` and `question` (no {exc})") from None
    if not isinstance(question, str):
        raise ValueError(f"`question` must be a string, got {question!r}")
    passages = record.get("passages") or []
    if not isinstance(passages, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                 for p in passages):
        raise ValueError("`passages` must be a list of objects with a string `text`")
    meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
    return QARow(qid, question, tuple(str(a) for a in record.get("answers") or ()),
                 tuple(PromptPassage(str(p.get("title") or ""), p["text"]) for p in passages),
                 tuple(bool(p.get("is_supporting")) for p in passages),
                 str(meta.get("type") or meta.get("hops") or ""))


def iter_qa_rows(path: Path) -> Iterator[QARow]:
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield _row(json.loads(line))
            except ValueError as exc:  # JSON errors too
                raise QARowError(f"{path}:{number}: {exc}") from None


def read_qa_rows(path: Path, limit: Optional[int] = None) -> list[QARow]:
    """The rows of a shared-QA JSONL file (the first `limit`), in file order."""
    rows = []
    for row in iter_qa_rows(path):
        if limit is not None and len(rows) >= limit:
            break
        rows.append(row)
    return rows
