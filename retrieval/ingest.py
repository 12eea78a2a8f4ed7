"""Read a corpus into documents: JSONL rows, plain-text and Markdown files, or folders of them.

JSONL rows are either one document each (`text`, optional `title`, `id`, `metadata` and any
other keys, which become metadata) or rows of the shared QA format (a `passages` list of
`{"title", "text", ...}`), whose passages each become a document. A document is a Passage
before chunking (retrieval/chunking.py): its `id` is the source's own id, else the content id
of its text.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from retrieval.passage import Passage, passage_id

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = frozenset({".txt", ".md", ".markdown"})
CORPUS_SUFFIXES = TEXT_SUFFIXES | {".jsonl"}
_RESERVED_KEYS = frozenset({"id", "title", "text", "metadata"})
_MARKDOWN_TITLE = re.compile(r"^#\s+(.+?)\s*#*\s*$", re.MULTILINE)


def read_documents(paths: Iterable[str | Path]) -> Iterator[Passage]:
    """Documents of every corpus file under `paths`; folders are walked in sorted order."""
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"corpus path does not exist: {path}")
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in CORPUS_SUFFIXES)
            if not files:
                logger.warning("no %s files under %s", "/".join(sorted(CORPUS_SUFFIXES)), path)
            for file in files:
                yield from read_file(file)
        else:
            yield from read_file(path)


def read_file(path: Path) -> Iterator[Passage]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif suffix in TEXT_SUFFIXES:
        text = path.read_text(encoding="utf-8")
        if text.strip():
            yield Passage(id=passage_id(text), title=_text_file_title(path, text), text=text,
                           metadata={"source": str(path)})
    else:
        raise ValueError(f"unsupported corpus file {path}: expected one of {sorted(CORPUS_SUFFIXES)}")


def _text_file_title(path: Path, text: str) -> str:
    if path.suffix.lower() != ".txt":
        heading = _MARKDOWN_TITLE.search(text)
        if heading:
            return heading.group(1)
    return path.stem


def _read_jsonl(path: Path) -> Iterator[Passage]:
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            if isinstance(row.get("passages"), list):
                yield from _qa_row_documents(row, path, where)
            else:
                document = _document_row(row, path, where)
                if document is not None:
                    yield document


def _document_row(row: dict[str, Any], path: Path, where: str) -> Passage | None:
    text = row.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}: a row needs a string 'text' (or a 'passages' list)")
    if not text.strip():
        return None
    metadata = {"source": str(path)}
    metadata.update({key: value for key, value in row.items() if key not in _RESERVED_KEYS})
    if isinstance(row.get("metadata"), dict):
        metadata.update(row["metadata"])
    doc_id = str(row["id"]) if row.get("id") is not None else passage_id(text)
    return Passage(id=doc_id, title=str(row.get("title") or ""), text=text, metadata=metadata)


def _qa_row_documents(row: dict[str, Any], path: Path, where: str) -> Iterator[Passage]:
    for number, passage in enumerate(row["passages"]):
        text = passage.get("text") if isinstance(passage, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{where}: passage {number} needs a string 'text'")
        if text.strip():
            yield Passage(id=passage_id(text), title=str(passage.get("title") or ""), text=text,
                           metadata={"source": str(path), "qa_id": row.get("id")})
