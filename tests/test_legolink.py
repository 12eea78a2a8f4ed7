"""LegoLink (EPIC) inside SGLang's forward: exact limits, exact token counts, batched with others
(CacheBlend among them)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from picrag_core.reordered_layout import Fragment, first_k_runs, merge_runs, reordered_layout
from picrag_core.link_hints import LinkHintError, LinkRequest
from picrag_core.policies import parse_policy
from tests.chunk_requests import assert_same_answer, first_token_top, passages_of, picrag_meta, question_tokens, run


def test_layout_moves_link_tokens_behind_the_rests():
    chunks = [(3, 8), (8, 10), (10, 16)]
    lay = reordered_layout(20, chunks, first_k_runs(chunks, 3))
    # head, rests (chunk 2 has none: k covers it), link tokens, question
    assert lay.order == [0, 1, 2, 6, 7, 13, 14, 15, 3, 4, 5, 8, 9, 10, 11, 12, 16, 17, 18, 19]
    assert lay.fragments == [[Fragment(3, 5, 3)], [], [Fragment(5, 8, 3)]]
    tokens = list(range(100, 120))
    assert lay.restore(lay.reorder(tokens)) == tokens


def test_a_selection_splits_chunks_into_kept_runs():
    chunks = [(2, 8), (8, 12)]
    runs = merge_runs([(2, 3), (5, 6), (6, 7), (9, 12), (11, 12)])
    assert runs == [(2, 3), (5, 7), (9, 12)]
    lay = reordered_layout(14, chunks, runs)
    # head, kept runs 3-4 and 7 of chunk 1 and 8 of chunk 2, recomputed 2, 5, 6, 9, 10, 11, question
    assert lay.order == [0, 1, 3, 4, 7, 8, 2, 5, 6, 9, 10, 11, 12, 13]
    assert lay.fragments == [[Fragment(2, 4, 1), Fragment(4, 5, 5)], [Fragment(5, 6, 0)]]


def test_policy_names():
    assert parse_policy("legolink").name == "legolink:16"
    assert parse_policy("legolink:2").name == "legolink:2" and parse_policy("legolink:2").param == 2
    assert parse_policy("naive").name == "naive" and parse_policy("naive").param is None
    for bad in ("legolink:x", "naive:3", "blend"):
        with pytest.raises(LinkHintError):
            parse_policy(bad)
    with pytest.raises(LinkHintError, match="back-to-back"):
        LinkRequest.of("legolink", [(0, 4), (5, 9)]).validate(12)


@pytest.mark.server
def test_legolink_limits_equal_full_and_naive(picrag_server, layout, musique):
    row = musique[50]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2, 3]))
    longest = max(end - start for start, end in prompt.chunks)
    with picrag_server.client() as client:
        full = run(client, prompt, "full", top=True)
        whole = run(client, prompt, f"legolink:{longest}", top=True)
        naive = run(client, prompt, "naive", top=True)
        zero = run(client, prompt, "legolink:0", top=True)
    # k covering every chunk recomputes everything but the head (a true prefix): full prefill.
    assert picrag_meta(whole).computed_tokens == len(prompt.input_ids) - len(layout.head_ids)
    assert_same_answer(whole, full)
    # k = 0 recomputes nothing: naive.
    assert_same_answer(zero, naive, abs_tol=1e-5)


@pytest.mark.server
def test_legolink_16_computes_16_tokens_per_chunk_and_changes_answers(picrag_server, layout, musique):
    row = musique[51]
    ten = layout.build(row["question"], passages_of(row, range(10)))
    assert min(end - start for start, end in ten.chunks) > 16
    changed = False
    with picrag_server.client() as client:
        meta = picrag_meta(run(client, ten, "legolink:16", max_new_tokens=1))
        for row in musique[60:80]:  # one changed answer of 20 is enough: stop at the first
            prompt = layout.build(row["question"], passages_of(row, [0, 1, 2]))
            naive = run(client, prompt, "naive", max_new_tokens=6)
            lego = run(client, prompt, "legolink:16", max_new_tokens=6)
            changed = naive["output_ids"] != lego["output_ids"]
            if changed:
                break
    assert meta.computed_tokens == 10 * 16 + question_tokens(ten)
    assert meta.reused_tokens == len(ten.input_ids) - 10 * 16 - question_tokens(ten)
    assert changed


@pytest.mark.server
def test_mixed_batch_matches_each_request_alone(picrag_server, layout, musique):
    row = musique[52]
    prompts = [layout.build(row["question"], passages_of(row, order)) for order in ([0, 1, 2], [2, 0, 1], [1, 2])]
    jobs = [(p, policy) for p in prompts for policy in ("full", "naive", "legolink:8", "cacheblend", "prefix")]
    with picrag_server.client() as client:
        alone = [run(client, p, policy)["output_ids"] for p, policy in jobs]
        with ThreadPoolExecutor(max_workers=len(jobs)) as workers:
            together = list(workers.map(lambda job: run(client, *job)["output_ids"], jobs))
    assert together == alone


@pytest.mark.server
def test_legolink0_computes_only_the_question_from_sink_compiled_chunks(picrag_server, layout, musique):
    row = musique[53]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2]))
    with picrag_server.client() as client:
        naive = run(client, prompt, "naive", top=True)
        sunk = run(client, prompt, "legolink0", top=True)
        client.post("/flush_cache").raise_for_status()
        cold = run(client, prompt, "legolink0", top=True)
    meta = picrag_meta(sunk)
    assert meta.computed_tokens == question_tokens(prompt) and meta.chunk_hits == 3
    # Chunks computed behind sinks are different KV from naive's, and reproducible from cold.
    assert first_token_top(sunk) != pytest.approx(first_token_top(naive), abs=1e-4)
    assert cold["output_ids"] == sunk["output_ids"]
    assert first_token_top(cold) == pytest.approx(first_token_top(sunk), abs=1e-5)


def input_tops(out: dict) -> list[dict[int, float]]:
    return [{token: logprob for logprob, token, _ in entry} if entry else {}
            for entry in out["meta_info"]["input_top_logprobs"]]


@pytest.mark.server
def test_link_tokens_of_the_first_chunk_see_exactly_what_full_prefill_sees(picrag_server, layout, musique):
    """The first chunk's link tokens run at their true positions in the *reordered* prompt and
    must attend to the head and to the chunk's earlier tokens only, never to the rests placed
    before them: their hidden states (read through input top-logprobs) equal full prefill's."""
    row = musique[58]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2]))
    k = 6
    head = len(layout.head_ids)
    chunks = list(prompt.chunks)
    first_link_row = reordered_layout(len(prompt.input_ids), chunks, first_k_runs(chunks, k)).fragments[-1][-1].end
    with picrag_server.client() as client:
        full = run(client, prompt, "full", top=True, max_new_tokens=1, logprob_start_len=head + 1)
        lego = run(client, prompt, f"legolink:{k}", top=True, max_new_tokens=1,
                   logprob_start_len=first_link_row + 1)
    # Entry i > 0 holds the next-token distribution of row logprob_start_len + i - 1 (entry 0 is
    # empty): entries 1..k-1 are link tokens 1..k-1 of the first chunk in both requests.
    full_rows = input_tops(full)[1:k]
    lego_rows = input_tops(lego)[1:k]
    assert len(full_rows) == len(lego_rows) == k - 1 and all(full_rows)
    for full_top, lego_top in zip(full_rows, lego_rows):
        assert lego_top.keys() == full_top.keys()
        for token, logprob in full_top.items():
            assert lego_top[token] == pytest.approx(logprob, abs=1e-4)
