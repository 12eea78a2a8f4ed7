"""The plan of a serving-shaped pairs run, as plain data: which chunks, which groups.

A chunk is one passage cut to one token cap, named by its identity (a digest of the passage's
serving text, plus the cap when there is one), so a passage that recurs, in several groups or in
several rows of a file, has one chunk and one stale KV file, as the chunk store holds it. A group
is a question (a data file's row) and its chunks in prompt order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cache_repair.groups import SPLITS, GroupsError
from retrieval.prompt_layout import PromptPassage, passage_text
from retrieval.qa_rows import QARow


def chunk_key(passage: PromptPassage, cap: int | None) -> str:
    """The chunk's name: the exact serving text decides its tokens (no whitespace folding), the
    cap where it is cut."""
    digest = hashlib.sha256(passage_text(passage).encode("utf-8")).hexdigest()[:16]
    return digest if cap is None else f"{digest}-{cap}"


@dataclass(frozen=True)
class ChunkSource:
    data: int  # index of the data file
    row: int  # index of the row among that file's rows as read
    passage: int  # index among the row's passages
    cap: int | None  # token cap; None: the whole passage


@dataclass(frozen=True)
class ServedGroup:
    data: int
    row: int  # the question's row
    chunks: tuple[str, ...]  # chunk keys in prompt order


@dataclass
class ServingPlan:
    chunks: dict[str, ChunkSource]
    groups: dict[str, list[ServedGroup]]

    def add_chunk(self, passage: PromptPassage, source: ChunkSource) -> str:
        key = chunk_key(passage, source.cap)
        self.chunks.setdefault(key, source)  # a recurring passage keeps its first source: same text
        return key

    def chunk_keys(self, split: str) -> set[str]:
        return {key for group in self.groups[split] for key in group.chunks}

    def check_disjoint(self, rows: list[list[QARow]]) -> None:
        """Refuse a plan whose validation groups share a question or a passage text with training
        ones (`rows[data]`: each data file's rows as read)."""
        questions = {split: {(g.data, g.row) for g in self.groups[split]} for split in SPLITS}
        texts = {split: {self.passage(rows, key).text for key in self.chunk_keys(split)} for split in SPLITS}
        shared = len(questions["train"] & questions["val"]), len(texts["train"] & texts["val"])
        if any(shared):
            raise GroupsError(f"validation groups share {shared[0]} questions and {shared[1]} passages with "
                            "training groups: use fewer groups or another seed")

    def passage(self, rows: list[list[QARow]], key: str) -> PromptPassage:
        source = self.chunks[key]
        return rows[source.data][source.row].passages[source.passage]

    def to_dict(self) -> dict:
        return {"chunks": {key: [c.data, c.row, c.passage, c.cap] for key, c in sorted(self.chunks.items())},
                "groups": {split: [{"data": g.data, "row": g.row, "chunks": list(g.chunks)} for g in self.groups[split]]
                           for split in SPLITS}}
