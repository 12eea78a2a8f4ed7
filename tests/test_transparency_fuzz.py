"""The cache-transparency fuzzer (rag_server.bench.transparency): its seeded generator, its
comparison, and a CI slice of it against a server with the shipped CacheRepair checkpoint
(picrag_server's zero checkpoint would make cacherepair naive, and its case unreachable)."""

from __future__ import annotations

import json

import numpy as np

from rag_server.bench.transparency import FuzzConfig, fuzz
from rag_server.bench.transparency_requests import (COMPILE_ROUTES, POLICIES, Generator, GeneratorSettings, Prompt,
                                                    Words)
from rag_server.bench.transparency_wire import Answer, Observation, compare
from tests.transparency_server import flusher, wire_for

# The CI slice: one seed, its first episodes, about 90 s of requests. `picrag bench transparency`
# runs the long ones.
SEED = 1
REQUESTS = 400
TIME_BUDGET_S = 70.0  # no episode starts after it; the last one takes up to about 20 s more
MIN_REQUESTS = 20  # a slice that played fewer proves too little


def test_generator_is_seeded_and_its_passages_collide(tokenizer):
    words = Words.of_tokenizer(tokenizer)
    first, again = Generator(words, 5), Generator(words, 5)
    assert first.episodes(60) == again.episodes(60)
    for base, same_start, rest_after_2, rest_after_4 in first.corpus.families:
        assert same_start[:len(base) // 2] == base[:len(base) // 2] and same_start != base
        assert rest_after_2[2:] == base[2:] and rest_after_4[4:] == base[4:] and rest_after_4[:4] != base[:4]
    requests = [r for episode in Generator(words, 6, GeneratorSettings(bos=1)).episodes(400) for r in episode]
    assert {r.policy for r in requests if r.route not in COMPILE_ROUTES} >= set(POLICIES)
    assert any(r.batch for r in requests) and any(r.client_layout for r in requests)
    assert any(r.logprobs.start_len is not None for r in requests) and any(r.extra_key for r in requests)
    assert any(r.logprobs.span for r in requests if r.route not in COMPILE_ROUTES)


def test_prompt_spans_are_back_to_back_after_the_head():
    prompt = Prompt((1, 2), ((3, 4, 5), (6,)), (7, 8))
    assert prompt.input_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert prompt.spans == [(2, 5), (5, 6)]


def _observed(ids, logprobs) -> Observation:
    return Observation(200, (Answer(tuple(ids), "", dict(logprobs), full=np.zeros(3, dtype=np.float32)),))


def test_compare_allows_rounding_and_names_what_moved():
    reference = _observed([5, 6], {5: -1.0, 9: -2.0})
    assert compare(reference, _observed([5, 6], {5: -1.0 + 1e-6, 9: -2.0}), 1e-3).kind == ""
    assert compare(reference, _observed([5, 6], {5: -1.02, 9: -2.0}), 1e-3).kind == "logprobs"
    assert compare(reference, _observed([5, 7], {5: -1.0}), 1e-3).kind == "tokens"
    assert compare(reference, Observation(400, error="refused"), 1e-3).kind == "status"


def test_no_answer_depends_on_what_other_requests_did(shipped_checkpoint_server, tokenizer):
    with wire_for(shipped_checkpoint_server, tokenizer) as wire:
        report = fuzz(wire, flusher(wire), FuzzConfig(seed=SEED, requests=REQUESTS, time_budget_s=TIME_BUDGET_S,
                                                      shrink_per_signature=1, max_reported=20))
    summary = {key: value for key, value in report.as_json().items() if key != "violations"}
    shown = [{k: v[k] for k in ("check", "kind", "detail", "likely_case", "victim", "minimal_attackers")}
             for v in report.as_json()["violations"][:5]]
    assert report.passed, json.dumps({**summary, "first_violations": shown}, indent=1)
    assert report.requests >= MIN_REQUESTS, f"only {report.requests} requests in {report.wall_s:.0f} s"
