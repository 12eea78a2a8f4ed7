"""Serving-shaped training groups: which passages, in which order, cut to which length.

A group is one request as the server would build it: `[head][passage 1]...[passage k][question
+ tail]` with k drawn from [min_passages, max_passages]. Every group is built around one NQ row
whose gold passage is in the group at a random place, so the question is a real one the
passages can answer; the other passages are gold passages of other rows, acting as the
distractors retrieval returns. With `distractors="retrieved"` they are what retrieval would
return: the passages most similar to the question (sentence embeddings, the retriever's model),
so, as in the dev sets' distractor settings, they are on the question's topic and attend to one
another the way served passages do; with `"random"` they are any other rows' passages.
Retrieved distractors may also come from a larger pool of passages that carry no question
(`cache_repair.distractor_pool`).

Each passage has one fixed length cap for the whole plan (a chunk's tokens, and so its stale
KV, are the same in every request that uses it, as in the chunk store); about half of them are
cut shorter than the chunker's limit, so chunk lengths vary the way retrieved chunks do.
Passages recur in several groups (about `reuse` with random distractors, as often as retrieval
picks them otherwise), in different company and at different offsets, which is also how the
chunk store sees them.

Validation groups use their own rows and passages, never seen in training. The plan is plain
data (row indices and caps), seeded; `cache_repair.data_mix` names its chunks and writes it into
the pairs manifest before any prefill.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrieval.prompt_layout import PromptPassage, passage_text
from retrieval.qa_rows import QARow, read_qa_rows

SPLITS = ("train", "val")
DISTRACTORS = ("random", "retrieved")


class GroupsError(ValueError):
    pass


@dataclass(frozen=True)
class GroupShape:
    min_passages: int = 8
    max_passages: int = 20
    max_tokens: int = 192  # the chunker's default limit (retrieval.chunking)
    min_tokens: int = 32
    cut_share: float = 0.5  # passages cut to a random length in [min_tokens, max_tokens]
    reuse: int = 3  # groups each passage appears in, on average ("random" distractors)
    distractors: str = "random"  # or "retrieved": the passages most similar to the question

    def __post_init__(self) -> None:
        if self.distractors not in DISTRACTORS:
            raise GroupsError(f"distractors must be one of {', '.join(DISTRACTORS)}, not {self.distractors!r}")
        if not 1 <= self.min_passages <= self.max_passages:
            raise GroupsError(f"passages per group: need 1 <= {self.min_passages} <= {self.max_passages}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise GroupsError(f"passage tokens: need 1 <= {self.min_tokens} <= {self.max_tokens}")
        if self.reuse < 1:
            raise GroupsError(f"reuse must be at least 1, not {self.reuse}")


@dataclass(frozen=True)
class Group:
    question: int  # row index: the question and its gold passage
    passages: tuple[int, ...]  # row indices of the passages in prompt order (the gold one among them)


@dataclass
class GroupPlan:
    caps: dict[int, int]  # row index -> the passage's token cap
    groups: dict[str, list[Group]]

    def rows(self, split: str) -> set[int]:
        return {row for group in self.groups[split] for row in group.passages}


def training_rows(path: Path) -> list[QARow]:
    """The rows of a shared-QA training file; an evaluation split is refused."""
    if ".dev." in Path(path).name:
        raise GroupsError(f"{path} is an evaluation split: train the repairer on training passages only")
    return read_qa_rows(path)


def gold_passage_rows(path: Path) -> list[QARow]:
    """One row per distinct gold passage (its only passage) of a training file with one passage
    per question (NQ-open oracle): a second question on the same passage would put it twice in a
    group."""
    rows: dict[PromptPassage, QARow] = {}
    for row in training_rows(path):
        if len(row.passages) != 1:
            raise GroupsError(f"{path}: expected one gold passage per question, got {len(row.passages)}")
        rows.setdefault(row.passages[0], row)
    return list(rows.values())


def distractor_rows(passages: list[PromptPassage]) -> list[QARow]:
    """Rows that only stand beside a question: a passage without one."""
    return [QARow("", "", passages=(passage,)) for passage in passages]


def retrieval_similarity(rows: list[QARow], embedder, questions: int | None = None) -> np.ndarray:
    """`[q, p]`: the cosine similarity of row q's question to row p's passage, as the server's
    retriever (retrieval.embedder.Embedder) embeds them; `questions`: how many leading rows carry
    a question (default all)."""
    questions = len(rows) if questions is None else questions
    passages = embedder.embed_documents([passage_text(row.passages[0]) for row in rows], progress=True)
    return embedder.embed_queries([row.question for row in rows[:questions]]) @ passages.T


def plan_groups(rows: int, groups: int, val_groups: int, shape: GroupShape, seed: int,
                similarity: np.ndarray | None = None, questions: int | None = None) -> GroupPlan:
    """`similarity[q, p]`: how well row p's passage answers row q's question as retrieval scores
    it; needed for "retrieved" distractors. `questions`: how many leading rows carry a question
    (default all); the rows after them are distractors only (retrieved distractors only)."""
    questions = rows if questions is None else questions
    if shape.distractors == "retrieved":
        if similarity is None or similarity.shape != (questions, rows):
            raise GroupsError(f"retrieved distractors need a {questions} x {rows} question-passage similarity")
        return _plan_retrieved(rows, groups, val_groups, shape, seed, similarity, questions)
    if questions != rows:
        raise GroupsError("distractor-only passages are for retrieved distractors")
    rng = random.Random(seed)
    order = list(range(rows))
    rng.shuffle(order)
    mean = (shape.min_passages + shape.max_passages) / 2
    # A pool holds every group's distinct passages and one question per group.
    sizes = {split: max(-(-int(count * mean) // shape.reuse), shape.max_passages, count)
             for split, count in (("val", val_groups), ("train", groups))}
    if sizes["val"] + sizes["train"] > rows:
        raise GroupsError(f"{rows} distinct passages are too few for {groups} + {val_groups} groups of "
                          f"{shape.min_passages}-{shape.max_passages} passages each used about {shape.reuse} "
                          "times: use fewer groups or a larger --passage-reuse")
    pools = {"val": order[: sizes["val"]], "train": order[sizes["val"] : sizes["val"] + sizes["train"]]}

    caps: dict[int, int] = {}
    plan: dict[str, list[Group]] = {}
    for split, count in (("val", val_groups), ("train", groups)):
        pool = pools[split]
        questions = rng.sample(pool, count)  # one question per group, each once
        for row in pool:
            cut = row not in questions and rng.random() < shape.cut_share
            caps[row] = rng.randint(shape.min_tokens, shape.max_tokens) if cut else shape.max_tokens
        queue: list[int] = []
        plan[split] = []
        for question in questions:
            # Distractors are used once each before any repeats; the queue is refilled shuffled.
            size = rng.randint(shape.min_passages, shape.max_passages)
            others: list[int] = []
            while len(others) < size - 1:
                if not queue:
                    queue = rng.sample(pool, len(pool))
                row = queue.pop()
                if row != question and row not in others:
                    others.append(row)
            passages = [question, *others]
            rng.shuffle(passages)
            plan[split].append(Group(question, tuple(passages)))
    return GroupPlan(caps, {split: plan[split] for split in SPLITS})


def _plan_retrieved(rows: int, groups: int, val_groups: int, shape: GroupShape, seed: int,
                    similarity: np.ndarray, questions: int) -> GroupPlan:
    """Each group: a question, its gold passage and the passages of its split most similar to the
    question. The rows (question rows and distractor-only rows apart) are split between
    validation and training in proportion to their groups, so each split retrieves from a pool
    as large as it can be; passages recur as often as they are retrieved."""
    rng = random.Random(seed)
    val_share = val_groups / (groups + val_groups)
    order = list(range(questions))
    rng.shuffle(order)
    val_rows = max(shape.max_passages, round(questions * val_share))
    question_pools = {"val": order[:val_rows], "train": order[val_rows:]}
    pools = dict(question_pools)
    if rows > questions:
        extra = list(range(questions, rows))
        rng.shuffle(extra)
        val_extra = round(len(extra) * val_share)
        pools = {"val": pools["val"] + extra[:val_extra], "train": pools["train"] + extra[val_extra:]}
    caps: dict[int, int] = {}
    plan: dict[str, list[Group]] = {}
    for split, count in (("val", val_groups), ("train", groups)):
        pool = pools[split]
        if len(question_pools[split]) < count or len(pool) < shape.max_passages:
            raise GroupsError(f"{questions} questions and {rows} distinct passages are too few for "
                              f"{groups} + {val_groups} groups")
        plan[split] = []
        for question in rng.sample(question_pools[split], count):
            size = rng.randint(shape.min_passages, shape.max_passages)
            ranked = sorted((row for row in pool if row != question), key=lambda row: -similarity[question, row])
            passages = [question, *ranked[: size - 1]]
            rng.shuffle(passages)
            plan[split].append(Group(question, tuple(passages)))
            caps[question] = shape.max_tokens
    questions = set(caps)
    for row in sorted({row for groups_ in plan.values() for g in groups_ for row in g.passages} - questions):
        cut = rng.random() < shape.cut_share
        caps[row] = rng.randint(shape.min_tokens, shape.max_tokens) if cut else shape.max_tokens
    return GroupPlan(caps, {split: plan[split] for split in SPLITS})
