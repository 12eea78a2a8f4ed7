"""Several training files in one serving-shaped plan, each giving its share of the groups.

A file whose rows all hold one passage (NQ-open oracle) gives groups built around one question's
gold passage with other rows' passages as distractors (`cache_repair.groups`); any other file is
multi-hop, and each of its rows is a group of its own passages (`cache_repair.row_groups`).

`FILE:SHARE` gives the file that fraction of the training and of the validation groups; files
without a share split what the others leave in proportion to their rows (validation) and to the
groups their training rows can give (training: a multi-hop file's rows times its variants per
row, an NQ file's questions). Without a group count, a plan with multi-hop files gives every
training row all its variants, or as many as the file whose rows run out first allows.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cache_repair.groups import SPLITS, GroupsError, GroupShape, gold_passage_rows, plan_groups, training_rows
from cache_repair.row_groups import RowVariants, allocate, held_out_rows, plan_row_groups, training_candidates
from cache_repair.serving_plan import ChunkSource, ServedGroup, ServingPlan
from retrieval.qa_rows import QARow


@dataclass(frozen=True)
class DataSpec:
    path: Path
    share: float | None = None  # of the groups; None: in proportion to the file's questions

    @classmethod
    def parse(cls, text: str) -> DataSpec:
        """`FILE` or `FILE:SHARE`."""
        path, _, share = text.rpartition(":")
        try:
            value = float(share)
        except ValueError:  # no share: a colon, if any, belongs to the path
            return cls(Path(text))
        if not path or not 0.0 < value <= 1.0:
            raise GroupsError(f"--data {text}: the share after the colon must be in (0, 1]")
        return cls(Path(path), value)

    def to_dict(self) -> dict:
        # The file by name: the same run resumed from another checkout must match.
        return {"file": self.path.name, "share": self.share}


@dataclass
class Source:
    spec: DataSpec
    rows: list[QARow]
    questions: int  # the leading rows that carry a question; the rest only stand beside one
    multi_hop: bool


def read_source(spec: DataSpec) -> Source:
    rows = training_rows(spec.path)
    if not rows or any(not row.passages for row in rows):
        raise GroupsError(f"{spec.path}: every row needs its passages")
    if all(len(row.passages) == 1 for row in rows):
        rows = gold_passage_rows(spec.path)
        return Source(spec, rows, len(rows), multi_hop=False)
    return Source(spec, rows, len(rows), multi_hop=True)


def fractions(sources: list[Source], sizes: list[int]) -> list[float]:
    """Each file's fraction of the groups: its share, or its part of what the shares leave in
    proportion to `sizes` (the groups its rows can give)."""
    given = [source.spec.share for source in sources]
    fixed = sum(share for share in given if share is not None)
    free = [i for i, share in enumerate(given) if share is None]
    if (free and fixed >= 1.0) or (not free and not math.isclose(fixed, 1.0)) or fixed > 1.0 + 1e-9:
        raise GroupsError(f"--data shares sum to {fixed:g}: they must sum to 1, or to less with a file "
                          "that has no share")
    rest = sum(sizes[i] for i in free)
    return [share if share is not None else (1.0 - fixed) * sizes[i] / rest for i, share in enumerate(given)]


def plan_mix(sources: list[Source], groups: int | None, val_groups: int, shape: GroupShape,
             variants: RowVariants, seed: int, nq_groups: int,
             similarity: dict[int, np.ndarray] | None = None) -> ServingPlan:
    """The plan over every source. `groups`: training groups (None: see the module docstring;
    `nq_groups` when every file is NQ-like). `similarity[d]`: source d's question-passage
    similarity, for NQ-like sources with retrieved distractors."""
    val_counts = allocate(val_groups, fractions(sources, [source.questions for source in sources]))
    rng = random.Random(seed)
    multi_hop = [d for d, source in enumerate(sources) if source.multi_hop]
    held = {d: held_out_rows(sources[d].rows, val_counts[d], rng) for d in multi_hop}
    held_texts = {p.text for d in multi_hop for r in held[d] for p in sources[d].rows[r].passages}
    # Validation rows hold their own passages, so they are never candidates.
    candidates = {d: training_candidates(sources[d].rows, held_texts) for d in multi_hop}
    weights = fractions(sources, [len(candidates[d]) * variants.variants if d in candidates else source.questions
                                  for d, source in enumerate(sources)])
    if groups is None:
        # The epsilon keeps a file's whole capacity whole through the float division.
        groups = min((math.floor(len(candidates[d]) * variants.variants / weights[d] + 1e-6) for d in multi_hop),
                     default=nq_groups)
    counts = allocate(groups, weights)

    plan = ServingPlan({}, {split: [] for split in SPLITS})
    for d, source in enumerate(sources):
        if source.multi_hop:
            whole = [(r, tuple(range(len(source.rows[r].passages)))) for r in held[d]]
            try:
                trained = plan_row_groups(source.rows, candidates[d], counts[d], variants, rng)
            except GroupsError as exc:
                raise GroupsError(f"{source.spec.path.name}: {exc}") from None
            for split, picked in (("val", whole), ("train", [(g.row, g.passages) for g in trained])):
                for row, passages in picked:
                    keys = tuple(plan.add_chunk(source.rows[row].passages[p], ChunkSource(d, row, p, None))
                                 for p in passages)
                    plan.groups[split].append(ServedGroup(d, row, keys))
        elif counts[d] or val_counts[d]:
            nq = plan_groups(len(source.rows), counts[d], val_counts[d], shape, seed,
                             (similarity or {}).get(d), source.questions)
            for split in SPLITS:
                for group in nq.groups[split]:
                    keys = tuple(plan.add_chunk(source.rows[r].passages[0], ChunkSource(d, r, 0, nq.caps[r]))
                                 for r in group.passages)
                    plan.groups[split].append(ServedGroup(d, group.question, keys))
    plan.check_disjoint([source.rows for source in sources])
    return plan
