"""Serving-shaped groups from multi-hop rows: each row is a natural group, its own passages
behind its own question, as the dev benchmarks serve a row.

A row gives up to `variants` training groups: the first is the row as the dataset orders it, the
others shuffle its passages (an order no earlier variant of the row had), and about
`subset_share` of them also drop some of the passages the row does not mark supporting, so
group sizes vary the way retrieved top-k lists do. The supporting passages always stay, so the
question keeps its answer; a row that marks none is only shuffled, never cut down.

Validation rows give one group each, the row as given; they are drawn first, and a training row
that holds any of their passages (2WikiMultihopQA rows share many) is left out, so validation
never sees a passage or a question used in training.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from cache_repair.groups import GroupsError
from retrieval.prompt_layout import PromptPassage
from retrieval.qa_rows import QARow


@dataclass(frozen=True)
class RowVariants:
    variants: int = 3  # training groups per row at most: the row as given, then shuffles and subsets
    subset_share: float = 0.5  # of the shuffled variants, the share that also drops unmarked passages
    min_passages: int = 2  # the fewest passages a subset keeps

    def __post_init__(self) -> None:
        if self.variants < 1:
            raise GroupsError(f"variants must be at least 1, not {self.variants}")
        if not 0.0 <= self.subset_share <= 1.0:
            raise GroupsError(f"subset share must be in [0, 1], not {self.subset_share}")
        if self.min_passages < 1:
            raise GroupsError(f"a subset keeps at least 1 passage, not {self.min_passages}")


@dataclass(frozen=True)
class RowGroup:
    row: int
    passages: tuple[int, ...]  # indices into the row's passages, in prompt order


def allocate(total: int, weights: list[float]) -> list[int]:
    """`total` split by `weights` (summing to 1) into whole numbers: largest remainders first."""
    exact = [total * weight for weight in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def held_out_rows(rows: list[QARow], count: int, rng: random.Random) -> list[int]:
    """`count` validation rows, stratified by question type (`QARow.kind`: each type gets its
    share of the rows, largest remainders first); within a type, the rows that share passages
    with the fewest others (ties drawn at random). A row that shares a passage with a validation
    row leaves training (`training_candidates`), and in 2WikiMultihopQA's training file one
    passage sits in up to 143 rows: a random draw within each type took half of 2Wiki's training
    rows out, while the fewest-shared rows over all types made 8 of 16 validation groups yes/no
    comparisons."""
    if count > len(rows):
        raise GroupsError(f"{len(rows)} rows are too few for {count} validation groups")
    holders: dict[str, set[int]] = {}
    for i, row in enumerate(rows):
        for passage in row.passages:
            holders.setdefault(passage.text, set()).add(i)
    sharing = [len(set().union(*(holders[p.text] for p in row.passages))) for row in rows]
    by_kind: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_kind.setdefault(row.kind, []).append(i)
    kinds = sorted(by_kind)
    held = []
    for kind, n in zip(kinds, allocate(count, [len(by_kind[kind]) / len(rows) for kind in kinds])):
        ties = {i: rng.random() for i in by_kind[kind]}
        held += sorted(by_kind[kind], key=lambda i: (sharing[i], ties[i]))[:n]
    return sorted(held)


def training_candidates(rows: list[QARow], held_out: set[str]) -> list[int]:
    """The rows that share no passage text with `held_out` (the validation passages' texts)."""
    return [i for i, row in enumerate(rows) if not {p.text for p in row.passages} & held_out]


def plan_row_groups(rows: list[QARow], candidates: list[int], count: int, shape: RowVariants,
                    rng: random.Random) -> list[RowGroup]:
    """`count` training groups from the `candidates` rows: every row's first variant before any
    row's second, so a plan smaller than rows x variants still covers as many rows as it can."""
    if count > len(candidates) * shape.variants:
        raise GroupsError(f"{len(candidates)} training rows give at most {len(candidates) * shape.variants} "
                             f"groups with {shape.variants} variants each, not {count}")
    order = rng.sample(candidates, len(candidates))
    seen: dict[int, list[tuple[PromptPassage, ...]]] = {}
    groups = []
    for j in range(count):
        row = order[j % len(order)]
        orders = seen.setdefault(row, [])
        passages = _variant(rows[row], len(orders), orders, shape, rng)
        orders.append(tuple(rows[row].passages[i] for i in passages))
        groups.append(RowGroup(row, passages))
    return groups


def _variant(row: QARow, index: int, earlier: list[tuple[PromptPassage, ...]], shape: RowVariants,
             rng: random.Random) -> tuple[int, ...]:
    """The passages of the row's variant `index`; `earlier`: the prompts of its earlier variants,
    compared by passage (a 2WikiMultihopQA row may hold one passage twice)."""
    everything = tuple(range(len(row.passages)))
    if index == 0:
        return everything
    keep = [i for i in everything if row.supporting[i]] if row.supporting else []
    others = [i for i in everything if i not in keep]
    if keep and others and rng.random() < shape.subset_share:
        # A proper subset: at least one unmarked passage goes.
        fewest = min(max(shape.min_passages - len(keep), 0), len(others) - 1)
        chosen = keep + rng.sample(others, rng.randint(fewest, len(others) - 1))
    else:
        chosen = list(everything)
    # A few redraws find an order no earlier variant had (a row of 3+ passages has one).
    for _ in range(100):
        rng.shuffle(chosen)
        if tuple(row.passages[i] for i in chosen) not in earlier:
            break
    return tuple(chosen)
