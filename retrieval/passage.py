"""The unit of retrieval: a passage with a stable content id."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import unicodedata
from typing import Any

from retrieval.prompt_layout import PromptPassage

_WHITESPACE = re.compile(r"\s+")


def normalise_text(text: str) -> str:
    """Unicode NFC with whitespace runs collapsed, so ids ignore layout-only differences."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFC", text)).strip()


def passage_id(text: str) -> str:
    """Stable content id: first 16 hex digits of the SHA-256 of the normalised text.

    The id depends on the text only, so the same text never appears twice in an index
    and the id can key the chunk KV cache across indexes and runs.
    """
    return hashlib.sha256(normalise_text(text).encode("utf-8")).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    score: float | None = None

    @classmethod
    def from_text(cls, text: str, title: str = "", metadata: dict[str, Any] | None = None) -> Passage:
        return cls(id=passage_id(text), title=title, text=text, metadata=dict(metadata or {}))

    def embedding_text(self) -> str:
        """What the embedder sees: a later chunk of a long document may never name its subject,
        the title does."""
        return f"{self.title}\n{self.text.strip()}" if self.title else self.text.strip()

    def prompt_passage(self) -> PromptPassage:
        return PromptPassage(self.title, self.text)

    def with_score(self, score: float) -> Passage:
        return dataclasses.replace(self, score=score)

    def to_json(self) -> dict[str, Any]:
        """The stored form; a score belongs to one search, so it is not stored."""
        return {"id": self.id, "title": self.title, "text": self.text, "metadata": self.metadata}

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Passage:
        return cls(id=row["id"], title=row.get("title", ""), text=row["text"], metadata=row.get("metadata", {}))
