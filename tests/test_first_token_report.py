"""The first answer token's full-vocabulary distribution (`first_token_logprobs` in a link):
what the engine sends is SGLang's own distribution, sent once (in a stream's last event), and the
exact KL computed from it is zero between policies that are equivalent and positive between ones
that are not."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rag_server.linking import sse
from picrag_core.engine_report import EngineReport, decode_floats, encode_floats, exact_kl
from picrag_core.link_hints import LinkHintError, LinkRequest, hints_of, link_hints, parse_link_request
from tests.chunk_requests import first_token_top, passages_of


def test_encoding_round_trip_and_exact_kl():
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    p = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    assert np.array_equal(decode_floats(encode_floats(p)), p.astype("<f4"))
    assert exact_kl(p, p) == 0.0
    q = np.log(np.full(50, 1 / 50))
    expected = float(np.sum(np.exp(p) * (p - q)))
    assert exact_kl(p, q) == pytest.approx(expected, rel=1e-12) and expected > 0
    with pytest.raises(ValueError):
        exact_kl(p, q[:10])


def test_the_request_flag_travels_in_the_link_hints_and_is_parsed_strictly():
    link = LinkRequest.of("naive", [(2, 5)])
    hints = link_hints("naive", [(2, 5)], report_first_token=True)
    assert parse_link_request(hints).report_first_token and parse_link_request(hints_of(link)) == link
    hints["actions"][0]["payload"]["first_token_logprobs"] = "yes"
    with pytest.raises(LinkHintError, match="first_token_logprobs"):
        parse_link_request(hints)


def test_the_distribution_goes_with_the_finished_output_only():
    """SGLang folds the outputs a slow reader has not taken yet into the newest, keeping only its
    meta_info: a one-shot report must ride on the finished output, the one never folded away."""
    from types import SimpleNamespace

    from picrag_core.engine_report import FIRST_TOKEN_KEY
    from sglang_patches.plan.link_plan import PLAN_ATTR
    from sglang_patches.plan.link_state import STATE_ATTR, LinkState, LinkStats
    from sglang_patches.steps.meta_info import add_link_stats

    attached = {PLAN_ATTR: SimpleNamespace(order=None),
                STATE_ATTR: LinkState(LinkStats("naive", first_token_logprobs="encoded"))}
    for stream in (True, False):
        running = SimpleNamespace(stream=stream, finished=lambda: False, **attached)
        done = SimpleNamespace(stream=stream, finished=lambda: True, **attached)
        assert FIRST_TOKEN_KEY not in add_link_stats(None, None, running)
        assert add_link_stats(None, None, done)[FIRST_TOKEN_KEY] == "encoded"


def _body(prompt, policy: str, report: bool, **extra) -> dict:
    return {"input_ids": prompt.input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            "kv_hints": link_hints(policy, list(prompt.chunks), report_first_token=report), **extra}


def _distribution(out: dict):
    return EngineReport.of(out["meta_info"]).first_token_logprobs


@pytest.mark.server
def test_the_distribution_is_sglangs_own_and_the_exact_kl_is_zero_only_between_equivalent_policies(
        picrag_server, layout, musique):
    row = musique[70]
    prompt = layout.build(row["question"], passages_of(row, [3, 0, 2, 1]))
    longest = max(end - start for start, end in prompt.chunks)
    top = {"return_logprob": True, "top_logprobs_num": 5}
    with picrag_server.client() as client:
        outs = {policy: client.post("/generate", json=_body(prompt, policy, True, **top)).json()
                for policy in ("full", f"legolink:{longest}", "naive")}
        silent = client.post("/generate", json=_body(prompt, "naive", False)).json()
    full = _distribution(outs["full"])
    assert full is not None and _distribution(silent) is None
    # The whole vocabulary, normalised, its argmax the token generated, its top-5 SGLang's own.
    assert np.exp(full.astype(np.float64)).sum() == pytest.approx(1.0, abs=1e-4)  # float32 log-softmax
    assert int(np.argmax(full)) == outs["full"]["output_ids"][0]
    for token, logprob in first_token_top(outs["full"]).items():
        assert float(full[token]) == pytest.approx(logprob, abs=1e-5)
    # legolink with k covering every chunk is full prefill; naive is not.
    assert exact_kl(full, _distribution(outs[f"legolink:{longest}"])) < 1e-6
    assert exact_kl(full, _distribution(outs["naive"])) > 1e-3


@pytest.mark.server
def test_a_stream_carries_the_distribution_once_through_the_frontend(picrag_server, layout, musique):
    row = musique[71]
    prompt = layout.build(row["question"], passages_of(row, [1, 0]))
    with picrag_server.client() as client:
        with client.stream("POST", "/generate", json=_body(prompt, "naive", True, stream=True)) as response:
            assert response.status_code == 200
            events = list(sse.events(response.iter_lines()))
        whole = client.post("/generate", json=_body(prompt, "naive", True)).json()
    carrying = [index for index, event in enumerate(events) if _distribution(event) is not None]
    # Once, in the last event: SGLang folds events a slow reader has not taken into the newest,
    # keeping its meta_info alone, so only the last is sure to arrive.
    assert len(events) > 1 and carrying == [len(events) - 1]
    streamed = _distribution(events[-1])
    assert exact_kl(_distribution(whole), streamed) < 1e-6
    assert all(len(json.dumps(event)) < 10_000 for event in events[:-1])


def test_a_span_report_travels_in_the_link_hints_and_stays_after_the_chunks():
    hints = link_hints("naive", [(2, 5)], report_span=4)
    link = parse_link_request(hints)
    assert link.report_span == 4 and parse_link_request(hints_of(link)) == link
    link.validate(9)  # positions 5..8: after the last chunk
    with pytest.raises(LinkHintError, match="after the last chunk: at most 3"):
        link.validate(8)
    for bad, reason in ((True, "whole number"), (65, "1 to 64"), (-1, "1 to 64")):
        hints["actions"][0]["payload"]["span_logprobs"] = bad
        with pytest.raises(LinkHintError, match=reason):
            parse_link_request(hints).validate(100)


def _span_body(input_ids: list[int], prompt, policy: str, span: int) -> dict:
    return {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1},
            "kv_hints": link_hints(policy, list(prompt.chunks), report_first_token=span == 0, report_span=span)}


@pytest.mark.server
@pytest.mark.parametrize("policy", ["full", "naive", "legolink:2", "cacheblend:0.3", "cacherepair"])
def test_each_reported_position_is_the_distribution_a_request_ending_there_gets(picrag_server, layout, musique,
                                                                                policy):
    """Teacher forcing in one request: after the prompt and an answer's first j tokens, the span's
    row j is the first-token distribution of the prompt followed by those j tokens, under the same
    policy; sent twice (the second finds its prompt in the tree), it reports the same rows."""
    row = musique[72]
    prompt = layout.build(row["question"], passages_of(row, [2, 0]))
    positions = 4
    with picrag_server.client() as client:
        answer = client.post("/generate", json={**_span_body(prompt.input_ids, prompt, "full", 0),
                                                "sampling_params": {"temperature": 0, "max_new_tokens": 3}}).json()
        forced = list(prompt.input_ids) + answer["output_ids"][: positions - 1]
        assert len(forced) == len(prompt.input_ids) + positions - 1
        spans = []
        for _ in range(2):
            out = client.post("/generate", json=_span_body(forced, prompt, policy, positions)).json()
            spans.append(EngineReport.of(out["meta_info"]).span_rows(positions))
        singles = [_distribution(client.post("/generate", json=_span_body(forced[: len(prompt.input_ids) + j],
                                                                          prompt, policy, 0)).json())
                   for j in range(positions)]
    for rows in spans:
        assert rows.shape == (positions, len(singles[0]))
        for j in range(positions):
            assert exact_kl(singles[j], rows[j]) < 1e-5, (policy, j)
    if policy == "full":  # full's span follows its own greedy answer
        assert [int(np.argmax(r)) for r in spans[0][:3]] == answer["output_ids"][:3]
