"""Requests and fixtures shared by the chunk-cache tests: prompts from MuSiQue rows, linked
/generate calls, picrag's meta_info fields and Prometheus counters."""

from __future__ import annotations

import json
import re

import pytest

from rag_server.prompt_layout import PromptLayout, PromptPassage
from sglang_patches.link_hints import link_hints


@pytest.fixture(scope="module")
def layout(default_model_dir) -> PromptLayout:
    from transformers import AutoTokenizer

    return PromptLayout(AutoTokenizer.from_pretrained(default_model_dir))


@pytest.fixture(scope="module")
def musique(shared_qa) -> list[dict]:
    rows = [json.loads(line) for line in (shared_qa / "musique.dev.jsonl").read_text().splitlines()]
    return rows


def passages_of(row: dict, picks) -> list[PromptPassage]:
    return [PromptPassage(row["passages"][i]["title"], row["passages"][i]["text"]) for i in picks]


def generate(client, input_ids, policy=None, chunks=(), max_new_tokens=8, logprobs=False, **extra) -> dict:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        "return_logprob": logprobs,
        **extra,
    }
    if policy is not None:
        body["kv_hints"] = link_hints(policy, list(chunks))
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def picrag_meta(out: dict) -> dict:
    details = out["meta_info"].get("cached_tokens_details") or {}
    return {k.removeprefix("picrag_"): v for k, v in details.items() if k.startswith("picrag_")}


def logprobs_of(out: dict) -> list[float]:
    return [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]


def counters(client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^picrag_(\w+)_total (\S+)$", text, re.M)}
