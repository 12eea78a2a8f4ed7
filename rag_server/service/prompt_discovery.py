"""Chunk reuse for clients that were not written for picrag: the passages of a whole prompt found
in it (rag_server/linking/chunk_discovery.py) on `/v1/chat/completions`, `/v1/completions` and
`/generate`.

A body that qualifies is served as a linked prompt under the server's default policy: its token
ids are the ones SGLang would compute from it (the chat template rendered, then encoded without
special tokens, as SGLang's chat route does; a text after the tokenizer's leading special
tokens, as its text path does), so `full` through this path is SGLang's own answer. A body
qualifies when discovery is on (`picrag serve --discover-chunks`, the default), the body does not
opt out (`"picrag": {"discover": false}`), the policy reuses chunks, every field it sets is one
this path translates (others, such as tools, logprobs or response formats, keep SGLang's own
route and its prefix cache), and the prompt holds enough reusable passage tokens. Which path a
body takes depends on the body alone, never on what the cache holds, so a client's answer does
not depend on other clients' requests.

`"picrag": {"discover": true, "policy": "naive"}` names the policy; the response reports what was
found in a `picrag` object (OpenAI routes) and in the `x-picrag-discovered` header (every route).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from rag_server.linking.chunk_discovery import (Discovered, DiscoverySettings, content_regions, discover,
                                                tokenized)
from rag_server.linking.policy_resolver import NamedPolicy, Served
from rag_server.service.rag_service import RagPlan, RagRequest, RagRequestError, RagService
from retrieval.prompt_layout import CompiledPrompt

CONTROL_FIELD = "picrag"  # a body's own discovery control, never forwarded
# Chat fields this path translates into /generate sampling parameters; a body setting any other
# keeps SGLang's chat route.
CHAT_FIELDS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "seed", "n",
    "stream", "stream_options", "user", "ignore_eos", "skip_special_tokens", "no_stop_trim", "logprobs",
})
COMPLETION_FIELDS = (CHAT_FIELDS - {"messages", "max_completion_tokens", "logprobs"}) | {"prompt", "echo"}
CHAT_ROLES = frozenset({"system", "user", "assistant"})
# Read from the model's generation_config.json when SGLang's --sampling-defaults is "model" (its
# default): SGLang's chat route fills these in where a request leaves them unset.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
COMPLETION_MAX_TOKENS = 16  # OpenAI's (and SGLang's) completions default


@dataclass(frozen=True)
class DiscoveryControl:
    """What a body asks of discovery (its `picrag` field, rag_server/api/discovery_control.py)."""

    discover: bool = True
    policy: Optional[NamedPolicy] = None


def _fields(payload: dict[str, Any]) -> set[str]:
    return set(payload) - {CONTROL_FIELD}


# What a body asks to be linked with: resolved, or `auto` (resolved once its prompt is known).
Asked = Union[Served, NamedPolicy]


@dataclass(frozen=True)
class DiscoveredPrompt:
    """A prompt whose passages were found, ready to link."""

    input_ids: list[int]
    found: Discovered
    served: Served  # the policy it is linked with, resolved once for it

    def report(self) -> dict[str, int]:
        return {"chunks": len(self.found.chunks), "chunk_tokens": self.found.chunk_tokens,
                "prompt_tokens": len(self.input_ids)}


class PromptDiscovery:
    """Finds the passages of the bodies that qualify (module docstring). `chat`, `text` and
    `token_ids` raise RagRequestError where the policy a body is linked with is refused."""

    def __init__(self, service: RagService, settings: DiscoverySettings, special_prefix: list[int],
                 chat_defaults: dict[str, Any]):
        self.service = service
        self.settings = settings
        self.special_prefix = special_prefix  # what SGLang's text path puts before a text
        self.chat_defaults = chat_defaults
        self.tokenizer = service.tokenizer
        self.found = 0  # prompts served through discovery (picrag_frontend_discovered_prompts)

    def _policy(self, control: DiscoveryControl) -> Optional[Asked]:
        """The policy a discovered prompt is linked with (resolved; `auto` is resolved once its
        prompt is known), None where linking would reuse nothing. RagRequestError: a policy this
        server refuses."""
        if not (self.settings.enabled and control.discover):
            return None
        policy = control.policy or self.service.policies.default
        if policy.auto:
            return policy
        served = self.service.resolve(policy)
        # A policy that reuses nothing (prefix, full; reuse turned away by a failed self-check)
        # gains nothing from a link: SGLang's own route serves it.
        return served if served.policy.family.reuses_chunks else None

    def _found(self, text: str, regions, asked: Asked, expected_ids: Optional[list[int]] = None,
               prefix: list[int] = ()) -> Optional[DiscoveredPrompt]:
        prompt = tokenized(self.tokenizer, text, prefix, regions)
        if prompt is None or (expected_ids is not None and list(prompt.ids) != expected_ids):
            return None
        found = discover(prompt, self._encode, self.settings)
        if not found.chunks:
            return None
        ids = list(prompt.ids)
        served = asked if isinstance(asked, Served) else self.service.serve(asked, len(ids))
        return DiscoveredPrompt(ids, found, served)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat(self, payload: dict[str, Any], control: DiscoveryControl) -> Optional[DiscoveredPrompt]:
        """A chat body's prompt as SGLang's chat route renders it, where it qualifies."""
        policy = self._policy(control)
        if policy is None or not _fields(payload) <= CHAT_FIELDS:
            return None
        if payload.get("n") not in (None, 1) or payload.get("logprobs"):
            return None
        messages = payload["messages"]
        if not all(set(m) <= {"role", "content"} and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)
                   for m in messages):
            return None
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._found(text, content_regions(text, [m["content"] for m in messages]), policy)

    def text(self, text: str, control: DiscoveryControl) -> Optional[DiscoveredPrompt]:
        """A text prompt (/generate `text`, a completions `prompt`) as SGLang's text path tokenizes it."""
        policy = self._policy(control)
        return None if policy is None else self._found(text, None, policy, prefix=self.special_prefix)

    def token_ids(self, input_ids: list[int], control: DiscoveryControl) -> Optional[DiscoveredPrompt]:
        """A token prompt whose decoded text tokenizes back to the very same ids (else none found)."""
        policy = self._policy(control)
        if policy is None:
            return None
        text = self.tokenizer.decode(input_ids, skip_special_tokens=False)
        return self._found(text, None, policy, expected_ids=list(input_ids))

    def completion_fields(self, payload: dict[str, Any]) -> bool:
        """A completions body this path translates: one text prompt, one choice, no logprobs or echo."""
        return (_fields(payload) <= COMPLETION_FIELDS and isinstance(payload.get("prompt"), str)
                and payload.get("n") in (None, 1) and not payload.get("echo"))

    def plan(self, found: DiscoveredPrompt, sampling: dict[str, Any], max_tokens: Optional[int]) -> RagPlan:
        """The RAG plan that links `found` (RagRequestError: a prompt the server cannot take)."""
        limits = self.service.limits
        prompt_tokens = len(found.input_ids)
        new_tokens = max_tokens if max_tokens is not None else max(1, limits.context_length - prompt_tokens)
        too_long = limits.refusal(prompt_tokens, {"max_new_tokens": new_tokens})
        if too_long:
            raise RagRequestError(too_long)
        request = RagRequest(question="", policy=found.served.policy, max_tokens=new_tokens, sampling=sampling,
                             documents=[])
        prompt = CompiledPrompt(found.input_ids, list(found.found.chunks), found.found.tail)
        plan = self.service.plan_prompt(request, prompt, time.perf_counter(), found.served)
        self.found += 1
        return plan

    def chat_sampling(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The /generate sampling parameters SGLang's chat route builds from these fields."""
        sampling = {name: payload.get(name, self.chat_defaults.get(name)) for name in GENERATION_DEFAULTS}
        return _common_sampling(payload, sampling)

    def completion_sampling(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The /generate sampling parameters SGLang's completions route builds from these fields."""
        return _common_sampling(payload, {name: payload.get(name) for name in GENERATION_DEFAULTS})


def _common_sampling(payload: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
    for name in ("frequency_penalty", "presence_penalty", "stop", "stop_token_ids", "ignore_eos",
                 "skip_special_tokens", "no_stop_trim"):
        sampling[name] = payload.get(name)
    sampling["sampling_seed"] = payload.get("seed")
    return {name: value for name, value in sampling.items() if value is not None}


def generation_defaults(model_dir, sampling_defaults: Optional[str]) -> dict[str, Any]:
    """What SGLang's chat route takes from the model's generation config (`--sampling-defaults model`)."""
    if sampling_defaults not in (None, "model"):
        return {}
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(model_dir).to_dict()
    except OSError:  # no generation_config.json
        return {}
    return {name: config[name] for name in GENERATION_DEFAULTS if config.get(name) is not None}
