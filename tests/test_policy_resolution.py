"""A request's policy is resolved once, where it enters the frontend, and carried from there: the
plan, the link it is sent as and the answer's report all hold that one answer, on every route
and prompt form (a spy on the resolver counts its answers; a fake runtime notes what each link
reached it as)."""

from __future__ import annotations

import httpx
import pytest

from rag_server.linking.policy_resolver import PolicyResolver
from rag_server.linking.reuse_gate import FAILED, Check, ReuseGate, SelfCheckReport
from picrag_core.policies import parse_policy
from tests.fake_runtime import DOCUMENTS, fake_runtime, link_hints_naive, recording
from tests.inprocess_frontend import frontend

FAILED_REPORT = SelfCheckReport((Check("rope_shift", FAILED, "keys differ"),), 0.1)


# The requests of _requests() that ask for a reusing policy, whatever the calibration table says.
REUSING = ("rag_named", "rag_default", "generate_link", "discovered_chat", "discovered_completion",
           "discovered_generate")


@pytest.fixture
def resolutions(monkeypatch) -> list[str]:
    """The policy name of every answer the resolver gives, in order."""
    answers: list[str] = []
    resolve = PolicyResolver.resolve

    def spy(self, named):
        answers.append(named.name)
        return resolve(self, named)

    monkeypatch.setattr(PolicyResolver, "resolve", spy)
    return answers


@pytest.fixture(scope="module")
def passages(musique) -> list[str]:
    """Four real Wikipedia passages: enough passage tokens for discovery to link them."""
    return [p["text"] for row in musique for p in row["passages"] if 60 <= len(p["text"].split()) <= 110][:4]


def _chat(passages: list[str], control: dict | None = None) -> dict:
    body = {"model": "default", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "\n\n".join(passages) + "\n\nQuestion: which island?"}]}
    return body if control is None else {**body, "picrag": control}


def _requests(passages: list[str]) -> dict[str, tuple[str, dict]]:
    """One request of every route and prompt form that takes a policy: name -> (path, body)."""
    text = "\n\n".join(passages) + "\n\nQuestion: which island?\nAnswer:"
    return {
        "rag_named": ("/rag/query", {"question": "Where?", "max_tokens": 2, "policy": "legolink:4",
                                     "documents": DOCUMENTS}),
        "rag_auto": ("/rag/query", {"question": "Where?", "max_tokens": 2, "policy": "auto", "documents": DOCUMENTS}),
        "rag_default": ("/rag/query", {"question": "Where?", "max_tokens": 2, "documents": DOCUMENTS}),
        "generate_link": ("/generate", {"input_ids": [5, 6, 7, 8, 9], "kv_hints": link_hints_naive()}),
        "discovered_chat": ("/v1/chat/completions", _chat(passages)),
        "discovered_chat_auto": ("/v1/chat/completions", _chat(passages, {"discover": True, "policy": "auto"})),
        "discovered_completion": ("/v1/completions", {"model": "default", "prompt": text, "max_tokens": 2}),
        "discovered_generate": ("/generate", {"text": text, "sampling_params": {"max_new_tokens": 2}}),
        "discovered_generate_auto": ("/generate", {"text": text, "sampling_params": {"max_new_tokens": 2},
                                                   "picrag": {"discover": True, "policy": "auto"}}),
    }


@pytest.mark.parametrize("gate", [ReuseGate(), ReuseGate(FAILED_REPORT, "prefix")], ids=["passed", "failed"])
def test_every_request_resolves_its_policy_once(default_model_dir, passages, resolutions, gate):
    sent: list[str] = []
    with fake_runtime(default_model_dir, recording(sent)) as (_fake, runtime_url), \
            frontend(runtime_url, policies=PolicyResolver.start(gate=gate)) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        for name, (path, body) in _requests(passages).items():
            resolutions.clear()
            sent.clear()
            response = client.post(path, json=body)
            assert response.status_code == 200, (name, response.text)
            assert len(resolutions) == 1, (name, resolutions)
            if gate.refusal is not None:  # reuse turned away: nothing reaches the runtime as a reusing link
                assert set(sent) <= {"prefix", "full", "vanilla"}, (name, sent)
            else:  # every one linked, as resolved (`auto` as it chose)
                assert sent[-1] == parse_policy(resolutions[0]).family.name, (name, sent, resolutions)
                assert name not in REUSING or parse_policy(resolutions[0]).family.reuses_chunks, name
            if path == "/rag/query":
                served = response.json()["policy"]
                assert served == ("prefix" if gate.refusal is not None and name != "rag_auto"
                                  else resolutions[0]), (name, served, resolutions)


def test_a_refused_policy_named_for_a_discovered_prompt_is_a_400_with_the_reason(default_model_dir, passages):
    sent: list[str] = []
    with fake_runtime(default_model_dir, recording(sent)) as (_fake, runtime_url), \
            frontend(runtime_url, policies=PolicyResolver.start(gate=ReuseGate(FAILED_REPORT, "refuse"))) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        control = {"discover": True, "policy": "naive"}
        text = "\n\n".join(passages) + "\n\nAnswer:"
        refused = [client.post("/v1/chat/completions", json=_chat(passages, control)),
                   client.post("/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 2,
                                                        "picrag": control}),
                   client.post("/generate", json={"text": text, "picrag": control})]
        plain = client.post("/v1/chat/completions", json=_chat(passages))  # the default: prefix, SGLang's route
    for response in refused:
        assert response.status_code == 400, response.text
        assert "'naive' is unavailable on this server: the start-up self-check failed" in response.text
    assert plain.status_code == 200 and sent == [], sent  # the fake's own chat route answered; no link was sent
