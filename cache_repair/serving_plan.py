"""The plan of a serving-shaped pairs run, as plain data: which chunks, which groups.

A chunk is one passage cut to one token cap in one form (`cache_repair.passage_forms`), named by
its identity (a digest of the passage's serving text, plus the cap when there is one and the form
when it is not `alone`), so a passage that recurs, in several groups or in several rows of a
file, has one chunk and one stale KV file, as the chunk store holds it. A group is a question (a
data file's row) and its chunks in prompt order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from cache_repair.groups import SPLITS, GroupsError
from cache_repair.passage_forms import ALONE, group_form
from retrieval.prompt_layout import PromptPassage, passage_text
from retrieval.qa_rows import QARow


def chunk_key(passage: PromptPassage, cap: int | None, form: str = ALONE) -> str:
    """The chunk's name: the exact serving text decides its tokens (no whitespace folding), the
    cap where it is cut, the form its separator takes."""
    digest = hashlib.sha256(passage_text(passage).encode("utf-8")).hexdigest()[:16]
    return _in_form(digest if cap is None else f"{digest}-{cap}", form)


def _in_form(key: str, form: str) -> str:
    return key if form == ALONE else f"{key}-{form}"


@dataclass(frozen=True)
class ChunkSource:
    data: int  # index of the data file
    row: int  # index of the row among that file's rows as read
    passage: int  # index among the row's passages
    cap: int | None  # token cap; None: the whole passage
    form: str = ALONE  # how its separator is tokenized (cache_repair.passage_forms)


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

    def in_form(self, form: str) -> ServingPlan:
        """The plan with each group's passages in its form under `--passage-form form`
        (`passage_forms.group_form`): a group in another form than `alone` reads chunks of its
        own, keyed apart, since their tokens differ."""
        chunks, groups = dict(self.chunks), {}
        for split in SPLITS:
            groups[split] = []
            for index, group in enumerate(self.groups[split]):
                chosen = group_form(form, index)
                if chosen == ALONE:
                    groups[split].append(group)
                    continue
                keys = tuple(_in_form(key, chosen) for key in group.chunks)
                for key, formed in zip(group.chunks, keys):
                    chunks.setdefault(formed, replace(self.chunks[key], form=chosen))
                groups[split].append(replace(group, chunks=keys))
        # A passage every group reads found has no alone chunk left to prefill.
        used = {key for split in SPLITS for group in groups[split] for key in group.chunks}
        return ServingPlan({key: source for key, source in chunks.items() if key in used}, groups)

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
        return {"chunks": {key: [c.data, c.row, c.passage, c.cap] + ([c.form] if c.form != ALONE else [])
                           for key, c in sorted(self.chunks.items())},
                "groups": {split: [{"data": g.data, "row": g.row, "chunks": list(g.chunks)} for g in self.groups[split]]
                           for split in SPLITS}}
