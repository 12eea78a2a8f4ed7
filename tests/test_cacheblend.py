"""CacheBlend-r inside SGLang's forward: the r = 1 limit, exact token counts, batching."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_patches.steps.cacheblend import select_rows
from picrag_core.link_hints import LinkHintError, LinkRequest, parse_link_request
from picrag_core.policies import parse_policy
from tests.chunk_requests import assert_same_answer, first_token_top, passages_of, picrag_meta, run


def test_policy_names_and_wire_format():
    assert parse_policy("cacheblend").name == "cacheblend:0.15"
    assert parse_policy("cacheblend:0.3").param == 0.3
    for bad in ("cacheblend:x", "cacheblend:1.5", "cacheblend:-0.1", "cacheblend:nan"):
        with pytest.raises(LinkHintError):
            parse_policy(bad)
    from picrag_core.link_hints import hints_of

    link = LinkRequest.of("cacheblend:0.25", [(2, 5)])
    assert parse_link_request(hints_of(link)) == link


def test_select_rows_keeps_the_top_ratio_the_non_candidates_and_the_last_row():
    candidates = torch.tensor([1, 2, 3, 4, 5, 6])
    deviation = torch.tensor([0.1, 5.0, 0.2, 3.0, 0.3, 0.4])
    # 8 rows: 0 and 7 are not chunk tokens (7 is also the last row).
    assert select_rows(deviation, candidates, 8, ratio=0.33).tolist() == [0, 2, 4, 7]
    assert select_rows(deviation, candidates, 8, ratio=0.0).tolist() == [0, 7]
    assert select_rows(deviation, candidates, 8, ratio=1.0).tolist() == list(range(8))
    # Rows whose input log-probabilities were asked for are computed.
    assert select_rows(deviation, candidates, 8, ratio=0.33, logprob_from=5).tolist() == [0, 2, 4, 5, 6, 7]


@pytest.mark.server
def test_cacheblend_with_ratio_one_equals_full(picrag_server, layout, musique):
    row = musique[54]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2]))
    with picrag_server.client() as client:
        full = run(client, prompt, "full", top=True)
        blend = run(client, prompt, "cacheblend:1.0", top=True)
    assert picrag_meta(blend).computed_tokens == len(prompt.input_ids) - len(layout.head_ids)
    assert_same_answer(blend, full)


@pytest.mark.server
def test_cacheblend_recomputes_the_ratio_of_chunk_tokens_plus_the_question(picrag_server, layout, musique):
    row = musique[55]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2, 3]))
    question_tokens = len(prompt.input_ids) - prompt.chunks[-1][1]
    with picrag_server.client() as client:
        naive = run(client, prompt, "naive", top=True)
        blend = run(client, prompt, "cacheblend:0.15", top=True)
        again = run(client, prompt, "cacheblend:0.15", top=True)
    meta = picrag_meta(blend)
    assert meta.chunk_hits == 4 and meta.chunk_misses == 0
    assert meta.computed_tokens == math.ceil(0.15 * prompt.chunk_tokens) + question_tokens
    assert meta.reused_tokens == len(prompt.input_ids) - meta.computed_tokens
    # Layers 0-1 and the selected tokens are fresh: not naive's KV; nothing is kept between runs.
    assert first_token_top(blend) != pytest.approx(first_token_top(naive), abs=1e-4)
    assert again["output_ids"] == blend["output_ids"]
    assert first_token_top(again) == pytest.approx(first_token_top(blend), abs=1e-5)


@pytest.mark.server
def test_input_logprobs_inside_the_chunks_are_computed_rows(picrag_server, layout, musique):
    """A cacheblend link asking for input log-probabilities from inside its chunks keeps those
    rows computed: the answer carries one per prompt token from there (this request took the
    runtime down when the dropped rows had none)."""
    row = musique[55]
    prompt = layout.build(row["question"], passages_of(row, [0, 1]))
    start = prompt.chunks[0][0] + 5
    with picrag_server.client() as client:
        blend = run(client, prompt, "cacheblend:0.15", top=True, logprob_start_len=start)
        assert client.get("/health").status_code == 200
    meta = picrag_meta(blend)
    assert meta.computed_tokens >= len(prompt.input_ids) - start
    assert len(blend["meta_info"]["input_token_logprobs"]) == len(prompt.input_ids) - start
