"""Query-aware selection (`select:R[,K]`, `cacherepair+select`): the question's attention over the
linked KV, measured by the engine, picks the chunk tokens recomputed at their true positions.

Limits: R = 1 recomputes every chunk token (full prefill); R = 0 is the base policy with
LegoLink's first K. The measured attention equals an independent transformers computation of
naive linking (chunks attend only within themselves, at their true positions)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rag_server.linking.selection import selected_runs
from picrag_core.engine_report import EngineReport
from picrag_core.link_hints import LinkHintError, LinkRequest, hints_of, parse_link_request
from picrag_core.policies import parse_policy
from tests.chunk_requests import assert_same_answer, generate, passages_of, picrag_meta, question_tokens, run


def test_policy_names_and_wire_format():
    assert parse_policy("select").name == "select:0.15"
    assert parse_policy("select:0.2,16").name == "select:0.2,16" and parse_policy("select:0.2,16").k == 16
    assert parse_policy("cacherepair+select:0.1").family.repairs
    for bad in ("select:2", "select:0.1,x", "legolink:4,2"):
        with pytest.raises(LinkHintError):
            parse_policy(bad)
    link = LinkRequest(policy="select", chunks=((2, 8), (8, 12)), k=1, ratio=0.25, recompute=((4, 6), (9, 12)))
    assert parse_link_request(hints_of(link)) == link
    for recompute, reason in [(((4, 9),), "not inside one chunk"), (((6, 7), (4, 5)), "ascending"),
                              (((1, 2),), "not inside one chunk"), (((5, 5),), "non-empty")]:
        with pytest.raises(LinkHintError, match=reason):
            LinkRequest(policy="select", chunks=((2, 8), (8, 12)), ratio=0.25, recompute=recompute).validate(14)
    with pytest.raises(LinkHintError, match="takes no recompute"):
        LinkRequest(policy="legolink", chunks=((2, 8),), k=2, recompute=((4, 5),)).validate(10)
    with pytest.raises(LinkHintError, match="context_attention is for"):
        LinkRequest(policy="cacheblend", chunks=((2, 8),), ratio=0.2, report_attention=True).validate(10)


def test_the_selection_takes_the_highest_scores_beside_the_first_k():
    chunks = [(2, 6), (6, 10)]
    scores = np.array([9, 9, 5, 1, 8, 2, 7, 3, 6, 0], dtype=np.float32)
    # 8 chunk tokens, R = 0.25: two of them; the first of each chunk (k = 1) are recomputed anyway.
    assert selected_runs(scores, chunks, 1, 0.25) == ((4, 5), (8, 9))
    assert selected_runs(scores, chunks, 0, 0.25) == ((4, 5), (6, 7))
    assert selected_runs(scores, chunks, 0, 0.0) == ()
    assert selected_runs(scores, chunks, 2, 1.0) == ((4, 6), (8, 10))
    assert selected_runs(scores, chunks, 0, 1.0) == ((2, 6), (6, 10))  # never across a chunk boundary
    assert selected_runs(np.zeros(10), chunks, 0, 0.25) == ((2, 4),)  # ties: the earlier positions


def naive_attention_reference(model, input_ids: list[int], chunks: list[tuple[int, int]]) -> np.ndarray:
    """The question's attention under naive linking, in plain transformers: one eager forward at
    true positions where chunk tokens see only their own chunk (each was computed alone) and the
    head and the question see every token before them; summed over layers, heads and question
    tokens."""
    n = len(input_ids)
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for start, end in chunks:
        allowed[start:end, :start] = False
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        out = model(torch.tensor([input_ids]), attention_mask=mask, position_ids=torch.arange(n)[None],
                    output_attentions=True)
    question = chunks[-1][1]
    return sum(layer[0, :, question:, :].sum(dim=(0, 1)) for layer in out.attentions).double().numpy()


@pytest.mark.server
def test_the_question_attention_equals_an_independent_naive_computation(picrag_server, layout, musique,
                                                                        served_model_dir):
    from transformers import AutoModelForCausalLM

    row = musique[3]
    prompt = layout.build(row["question"], passages_of(row, [0, 1]))
    chunks = list(prompt.chunks)
    with picrag_server.client() as client:
        out = generate(client, prompt.input_ids, max_new_tokens=0, kv_hints=hints_of(
            LinkRequest(policy="naive", chunks=tuple(chunks), report_attention=True)))
    served = EngineReport.of(out["meta_info"]).context_attention.astype(np.float64)
    model = AutoModelForCausalLM.from_pretrained(served_model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    reference = naive_attention_reference(model, prompt.input_ids, chunks)
    config = model.config
    # Every question token's weights sum to 1 in every layer and head.
    assert served.sum() == pytest.approx(config.num_hidden_layers * config.num_attention_heads
                                         * question_tokens(prompt), rel=1e-4)
    np.testing.assert_allclose(served, reference, rtol=1e-3, atol=1e-3)


@pytest.mark.server
def test_select_one_is_full_and_zero_is_the_base_policy(picrag_server, layout, musique):
    row = musique[54]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2]))
    with picrag_server.client() as client:
        full = run(client, prompt, "full", top=True)
        whole = run(client, prompt, "select:1.0", top=True)
        lego = run(client, prompt, "legolink:4", top=True)
        select_k = run(client, prompt, "select:0.0,4", top=True)
        naive = run(client, prompt, "naive", top=True)
        select_0 = run(client, prompt, "select:0.0", top=True)
        repaired_0 = run(client, prompt, "cacherepair+select:0.0", top=True)  # the zero checkpoint: naive
    assert picrag_meta(whole).computed_tokens == len(prompt.input_ids) - prompt.chunks[0][0]
    assert_same_answer(whole, full)
    assert_same_answer(select_k, lego, abs_tol=1e-5)
    assert picrag_meta(select_0).computed_tokens == question_tokens(prompt)
    for out in (select_0, repaired_0):
        assert_same_answer(out, naive, abs_tol=1e-5)


@pytest.mark.server
def test_select_recomputes_the_fraction_the_question_attends_to(picrag_server, layout, musique):
    """Through the frontend, the tokens recomputed are the ones the measured attention ranks
    first: the same answer as a link that names them itself."""
    row = musique[56]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2]))
    chunks = list(prompt.chunks)
    chunk_tokens = sum(end - start for start, end in chunks)
    with picrag_server.client() as client:
        selected = run(client, prompt, "select:0.2,2", top=True)
        probe = generate(client, prompt.input_ids, max_new_tokens=0, kv_hints=hints_of(
            LinkRequest(policy="naive", chunks=tuple(chunks), report_attention=True)))
        scores = EngineReport.of(probe["meta_info"]).context_attention
        named = LinkRequest(policy="select", chunks=tuple(chunks), k=2, ratio=0.2,
                            recompute=selected_runs(scores, chunks, 2, 0.2))
        explicit = generate(client, prompt.input_ids, logprobs=True, top_logprobs_num=5, kv_hints=hints_of(named))
    meta = picrag_meta(selected)
    assert meta.policy == "select" and meta.chunk_hits == 3 and meta.chunk_misses == 0
    assert meta.computed_tokens == question_tokens(prompt) + 3 * 2 + math.ceil(0.2 * chunk_tokens)
    assert_same_answer(selected, explicit, abs_tol=1e-5)


def test_policy_lists_keep_a_selecting_familys_k():
    from picrag_core.policies import policy_names

    assert policy_names("naive, select:0.2,16,legolink:4,select:0.1,cacherepair+select:0.3,2") == [
        "naive", "select:0.2,16", "legolink:4", "select:0.1", "cacherepair+select:0.3,2"]
