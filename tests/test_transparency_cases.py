"""Issue 32's four ways an answer came to depend on what another request did, each as a plain
test: flush; send the victim V; flush; send the attacker A; send V again. V's two answers must
agree: the same status, the same greedy tokens, first-token log-probabilities within the
fuzzer's tolerance (rag_server.bench.transparency). They run on a server with the shipped
CacheRepair checkpoint, since with picrag_server's zero one cacherepair is naive."""

from __future__ import annotations

import random

import pytest

from rag_server.bench.transparency import TOLERANCE
from rag_server.bench.transparency_requests import GENERATE, Logprobs, Prompt, Request
from rag_server.bench.transparency_wire import Observation, Wire, compare
from tests.transparency_server import flusher, wire_for

TOP5 = Logprobs(return_logprob=True, top=5)


@pytest.fixture(scope="module")
def wire(shipped_checkpoint_server, tokenizer):
    with wire_for(shipped_checkpoint_server, tokenizer) as wire:
        yield wire


def words(wire: Wire, count: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    ids = wire.words.ids
    return tuple(rng.choice(ids) for _ in range(count))


def replayed(wire: Wire, victim: Request, attacker: Request) -> tuple[Observation, Observation]:
    """V on a flushed cache, and V again after A on a flushed cache."""
    flush = flusher(wire)
    flush()
    first = wire.send(victim)
    flush()
    wire.send(attacker)
    return first, wire.send(victim)


def assert_same(first: Observation, second: Observation) -> None:
    difference = compare(first, second, TOLERANCE)
    reuse = [(a.reuse, b.reuse) for a, b in zip(first.answers, second.answers)]
    assert difference.kind == "", f"{difference.kind}: {difference.detail} (reuse before/after: {reuse})"


def test_legolink_rest_stored_behind_other_first_tokens(wire):
    head, passage = words(wire, 12, 1), words(wire, 40, 2)
    victim = Request(GENERATE, "legolink:4", (Prompt(head, (passage,), words(wire, 8, 3)),), logprobs=TOP5)
    # The same rest after 4 other first tokens, over the same span.
    attacker = Request(GENERATE, "legolink:4", (Prompt(head, (words(wire, 4, 4) + passage[4:],), words(wire, 8, 5)),),
                       logprobs=TOP5)
    assert_same(*replayed(wire, victim, attacker))


def test_cacherepair_chunk_with_the_same_start_and_another_end(wire):
    head, passage = words(wire, 12, 11), words(wire, 40, 12)
    victim = Request(GENERATE, "cacherepair", (Prompt(head, (passage,), words(wire, 8, 13)),), logprobs=TOP5)
    attacker = Request(GENERATE, "cacherepair", (Prompt(head, (passage[:39] + words(wire, 20, 14),),
                                                        words(wire, 8, 15)),), logprobs=TOP5)
    assert_same(*replayed(wire, victim, attacker))


@pytest.mark.parametrize("policy", ["naive", "cacherepair"])
def test_logprob_start_len_inside_a_chunk(wire, policy):
    head = words(wire, 14, 21)
    prompt = Prompt(head, (words(wire, 40, 22),), words(wire, 14, 23))
    victim = Request(GENERATE, policy, (prompt,), logprobs=TOP5)
    # The same prompt, its input logprobs asked from inside the chunk: SGLang caps the prefix match there.
    attacker = Request(GENERATE, policy, (prompt,), logprobs=Logprobs(return_logprob=True, start_len=len(head) + 20))
    assert_same(*replayed(wire, victim, attacker))


def test_kv_hints_as_a_list_with_a_client_set_layout(wire):
    prompt = Prompt(words(wire, 12, 31), (words(wire, 40, 32),), words(wire, 8, 33))
    # The prompt reordered by the client, "layout": "legolink" in its hint, in SGLang's batch form.
    victim = Request(GENERATE, "legolink:4", (prompt,), batch=True, client_layout=True, logprobs=TOP5)
    # The same prompt linked the ordinary way: the frontend compiles its pieces.
    attacker = Request(GENERATE, "legolink:4", (prompt,), logprobs=TOP5)
    first, second = replayed(wire, victim, attacker)
    assert_same(first, second)
    single = wire.send(victim.singles()[0])
    assert single.status == 400, single
    assert first.status == single.status, f"the batch form is served ({first.status}) where the single form is refused"
