"""The tree-key rule (sglang_patches.plan.keys): two linked prompts share a cached slot only if
their policy computes the same value for it in both.

The property test states what a slot's value depends on, from the policies' definitions and
independently of how keys are built (`slot_dependencies`), and checks over colliding prompts
(a three-token alphabet, random spans, every family that files linked prompts in the tree)
that equal keys and namespaces always mean equal dependencies for every slot up to there. The
named tests are the instances that broke before the rule: LegoLink rests stored after other
first-K tokens, and CacheRepair chunks that start alike and end differently.
"""

from __future__ import annotations

import dataclasses
from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from picrag_core.chunk_key import StoredChunk
from picrag_core.link_hints import LinkRequest, runtime_request
from sglang_patches.plan.link_plan import LinkPlan, build_plan
from picrag_core.reordered_layout import merge_runs
from sglang_patches.plan.keys import SEGMENT_START, store_key
from sglang_patches.guard.request_guard import RequestShape, admitted_link
from tests.engine_routing import BOS
from tests.test_cache_integrity import ENGINE

# Families whose linked prompts go into the tree, with the parameters drawn for them (the
# selecting ones also recompute drawn positions).
POLICIES = ("naive", "legolink0", "cacherepair", "legolink:0", "legolink:1", "legolink:2",
            "cacherepair+legolink:1", "cacherepair+legolink:2", "select:0.5", "select:0.5,1",
            "cacherepair+select:0.5", "cacherepair+select:0.5,2")
DIGESTS = ("a" * 64, "b" * 64)


def linked(policy: str, chunks: list[tuple[int, int]], recompute: tuple = (), tail: tuple = ()) -> LinkRequest:
    link = LinkRequest.of(policy, chunks, BOS, tail)
    return dataclasses.replace(link, recompute=recompute) if link.family.scored_as else link


def admitted_plan(prompt: list[int], policy: str, chunks: list[tuple[int, int]], repair_digest: str,
                  recompute: tuple = (), tail: tuple = ()) -> LinkPlan:
    """The plan the engine builds for `prompt` linked as the frontend sends it."""
    ids, hints = runtime_request(prompt, linked(policy, chunks, recompute, tail))
    link = admitted_link(hints, RequestShape(len(ids), 8, False), ENGINE)
    return build_plan(ids, link, repair_digest if link.family.repairs else None)[0]


def slot_dependencies(prompt: list[int], policy: str, chunks: list[tuple[int, int]],
                      repair_digest: str, recompute: tuple = (), tail: tuple = ()) -> list[tuple]:
    """What each slot's KV is a function of, beyond the slots before it in the order sent,
    written from the policies' definitions (not from the key code). The last chunk is stored
    with `tail` after it: a causal graft never sees it, the repair network does."""
    link = linked(policy, chunks, recompute, tail)
    stored_as = [tuple(prompt[s:e]) + (tuple(tail) if i == len(chunks) - 1 else ()) for i, (s, e) in enumerate(chunks)]
    family = link.family
    # Recomputed in context: LegoLink's first k of every chunk, and a selection's positions.
    recomputed = set()
    if family.reordered_layout:
        recomputed = {p for start, end in chunks for p in range(start, min(start + link.k, end))}
        recomputed |= {p for start, end in link.recompute for p in range(start, end)}
    order = list(range(len(prompt)))
    if family.reordered_layout and chunks:
        # Kept chunk tokens first, then the recomputed ones, then the question.
        head = list(range(chunks[0][0]))
        kept = [p for start, end in chunks for p in range(start, end) if p not in recomputed]
        order = head + kept + sorted(recomputed) + list(range(chunks[-1][1], len(prompt)))
    chunk_of = {position: index for index, (start, end) in enumerate(chunks) for position in range(start, end)}
    grafted_from = {position: chunk for position, chunk in chunk_of.items() if position not in recomputed}
    dependencies = []
    for position in order:
        # The namespace-level facts: family and parameter, and where a reordered prompt's
        # tokens run (its spans and what it recomputes).
        scope = (family.name, tuple(sorted(recomputed)) if family.reordered_layout else None,
                 tuple(chunks) if family.reordered_layout else None)
        token = prompt[position]
        index = grafted_from.get(position)
        if index is None:
            # Computed in context (head, question, LegoLink's first K tokens): the slots before
            # it, its token and its true position.
            dependencies.append((scope, "computed", token, position))
            continue
        start, end = chunks[index]
        stored = [BOS] * family.sink_tokens + list(stored_as[index])
        local = family.sink_tokens + position - start
        if family.repairs:
            # The network sees every chunk up to this one whole (as stored), in prompt order.
            seen = tuple(stored_as[: index + 1])
            dependencies.append((scope, "repaired", token, position, start, local, seen, repair_digest))
        else:
            dependencies.append((scope, "grafted", token, position, start, local, tuple(stored[: local + 1])))
        assert chunk_of[position] == index
    return dependencies


@st.composite
def linked_prompts(draw):
    length = draw(st.integers(6, 14))
    prompt = draw(st.lists(st.integers(2, 4), min_size=length, max_size=length))
    head = draw(st.integers(0, 2))
    cuts = sorted(draw(st.sets(st.integers(head + 1, length - 2), min_size=1, max_size=3)))
    bounds = [head, *cuts]
    chunks = list(zip(bounds, bounds[1:])) or [(head, head + 1)]
    # Positions a selecting policy recomputes: any chunk tokens, as runs inside chunks.
    chosen = draw(st.sets(st.sampled_from([p for start, end in chunks for p in range(start, end)])))
    recompute = tuple(run for start, end in chunks for run in merge_runs([(p, p + 1) for p in chosen if start <= p < end]))
    tail = tuple(draw(st.lists(st.integers(2, 4), max_size=2)))
    return prompt, chunks, recompute, tail


def _shared_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=400, deadline=None)
@given(first=linked_prompts(), second=linked_prompts(), policies=st.tuples(st.sampled_from(POLICIES),
       st.sampled_from(POLICIES)), digests=st.tuples(st.sampled_from(DIGESTS), st.sampled_from(DIGESTS)))
def test_equal_keys_mean_equal_dependencies(first, second, policies, digests):
    plans, dependencies = [], []
    for (prompt, chunks, recompute, tail), policy, digest in zip((first, second), policies, digests):
        plans.append(admitted_plan(prompt, policy, chunks, digest, recompute, tail))
        dependencies.append(slot_dependencies(prompt, policy, chunks, digest, recompute, tail))
    a, b = plans
    if a.namespace != b.namespace:
        return
    shared = _shared_prefix(a.tree_key, b.tree_key)
    assert dependencies[0][:shared] == dependencies[1][:shared], (a.tree_key[:shared], b.tree_key[:shared])


def _rest_start(plan: LinkPlan, chunk: int) -> int:
    return [seg for seg in plan.segments if seg.is_chunk][chunk].start


def test_legolink_rests_after_other_first_k_tokens_are_other_slots():
    """The issue's first case: the same head and chunk rest, other first K tokens."""
    head, rest, question = [7, 8], list(range(20, 56)), [9, 9]
    victim = [7, 8, 1, 2, 3, 4, *rest, *question]
    attacker = [7, 8, 5, 5, 5, 5, *rest, *question]
    plans = [admitted_plan(p, "legolink:4", [(2, 42)], DIGESTS[0]) for p in (victim, attacker)]
    assert plans[0].namespace == plans[1].namespace
    start = _rest_start(plans[0], 0)
    assert start == len(head)
    assert plans[0].tree_key[:start] == plans[1].tree_key[:start]  # the head is shared
    assert plans[0].tree_key[start] != plans[1].tree_key[start]


def test_repaired_chunks_that_start_alike_and_end_differently_share_nothing():
    """The issue's second case: the repair network saw the whole chunk, so its first tokens differ."""
    chunk = list(range(20, 60))
    victim, attacker = [7, 8, *chunk, 9], [7, 8, *chunk[:39], *range(100, 120), 9]
    spans = [[(2, 42)], [(2, 61)]]
    repaired = [admitted_plan(p, "cacherepair", s, DIGESTS[0]) for p, s in zip((victim, attacker), spans)]
    assert _shared_prefix(repaired[0].tree_key, repaired[1].tree_key) == 2
    # Causal reuse of the common start is right for naive, and is kept.
    naive = [admitted_plan(p, "naive", s, DIGESTS[0]) for p, s in zip((victim, attacker), spans)]
    assert _shared_prefix(naive[0].tree_key, naive[1].tree_key) == 2 + 39


def test_another_repair_checkpoint_is_another_namespace():
    prompt, chunks = [7, 8, *range(20, 30), 9], [(2, 12)]
    namespaces = {admitted_plan(prompt, "cacherepair", chunks, digest).namespace for digest in DIGESTS}
    assert len(namespaces) == 2
    assert admitted_plan(prompt, "naive", chunks, DIGESTS[0]).namespace == admitted_plan(
        prompt, "naive", chunks, DIGESTS[1]).namespace


def test_a_plan_is_the_same_for_the_same_request():
    prompt, chunks = [7, 8, *range(20, 40), 9], [(2, 12), (12, 22)]
    for policy in POLICIES:
        first, second = (admitted_plan(prompt, policy, chunks, DIGESTS[0]) for _ in range(2))
        assert (first.namespace, first.tree_key, first.order) == (second.namespace, second.tree_key, second.order)


def test_stored_chunks_share_no_nodes_not_even_a_common_start():
    """A stored chunk's KV is its own compile's (store_key): a chunk compiled after another that
    starts alike does not read the other's KV for the common part."""
    chunk = list(range(20, 60))
    other = chunk[:39] + list(range(100, 120))
    key, other_key = store_key(StoredChunk.of(chunk)), store_key(StoredChunk.of(other))
    assert key[1:] == array("q", chunk[1:]) and key[0] >= SEGMENT_START
    assert key[0] != other_key[0]
    assert key == store_key(StoredChunk.of(tuple(chunk)))


def test_a_repaired_chunk_after_one_recomputed_whole_depends_on_it():
    """cacherepair+select (or +legolink with K over a whole chunk): the first chunk is recomputed
    whole, so it sits after the second chunk's grafted tokens in the order sent, yet the repair
    network saw it when it repaired the second chunk."""
    first, second = [7, 2, *range(20, 40), 9], [7, 3, *range(20, 40), 9]
    chunks = [(1, 2), (2, 22)]
    plans = [admitted_plan(p, "cacherepair+select:0.1", chunks, DIGESTS[0], ((1, 2),)) for p in (first, second)]
    assert plans[0].namespace == plans[1].namespace
    assert _shared_prefix(plans[0].tree_key, plans[1].tree_key) == 1  # the head only
