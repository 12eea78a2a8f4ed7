"""Requests shared by the chunk-cache tests: prompts from MuSiQue rows, linked /generate calls,
picrag's meta_info fields and Prometheus counters."""

from __future__ import annotations

import time

import pytest

from rag_server.api.runtime_metrics import picrag_counters
from retrieval.prompt_layout import PromptPassage
from picrag_core.engine_report import EngineReport, LinkCounts
from picrag_core.link_hints import link_hints


def passages_of(row: dict, picks) -> list[PromptPassage]:
    return [PromptPassage(row["passages"][i]["title"], row["passages"][i]["text"]) for i in picks]


def question_tokens(prompt) -> int:
    """Tokens after a CompiledPrompt's last passage (question and generation prompt): all that a
    chunk policy computes when it reuses every chunk as stored."""
    return len(prompt.input_ids) - prompt.chunks[-1][1]


def generate(client, input_ids, policy=None, chunks=(), max_new_tokens=8, logprobs=False, tail=(), **extra) -> dict:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        "return_logprob": logprobs,
        **extra,
    }
    if policy is not None:
        body["kv_hints"] = link_hints(policy, list(chunks), tail=tail)
    else:  # the reference is SGLang's own route: the frontend would otherwise find the passages
        body.setdefault("picrag", {"discover": False})
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def picrag_meta(out: dict) -> LinkCounts:
    """The link's accounting in a linked /generate answer (fails for an answer without one)."""
    counts = EngineReport.of(out["meta_info"]).link
    assert counts is not None, out["meta_info"]
    return counts


def logprobs_of(out: dict) -> list[float]:
    return [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]


def counters(client) -> dict[str, float]:
    return picrag_counters(client.get("/metrics").text)


def wait_for_counter(client, name: str, at_least: float, timeout_s: float = 60.0) -> dict[str, float]:
    """The counters once `name` reaches `at_least`: chunk saves finish off the request's path."""
    deadline = time.monotonic() + timeout_s
    while (values := counters(client)).get(name, 0) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return values


def run(client, prompt, policy, top=False, max_new_tokens=8, **body_extra) -> dict:
    """A CompiledPrompt through /generate under `policy`; `top`: first-token top-5 logprobs."""
    if top:
        body_extra["top_logprobs_num"] = 5
    return generate(client, prompt.input_ids, policy, prompt.chunks, max_new_tokens=max_new_tokens,
                    logprobs=top, **body_extra)


def first_token_top(out: dict) -> dict[int, float]:
    return {token: logprob for logprob, token, _ in out["meta_info"]["output_top_logprobs"][0]}


def assert_same_answer(out: dict, reference: dict, abs_tol: float = 1e-4) -> None:
    """Same greedy tokens, and the same first-token top-5 with logprobs within `abs_tol`."""
    assert out["output_ids"] == reference["output_ids"]
    top, reference_top = first_token_top(out), first_token_top(reference)
    assert top.keys() == reference_top.keys()
    for token, logprob in reference_top.items():
        assert top[token] == pytest.approx(logprob, abs=abs_tol)
