"""The transparency fuzzer's requests on the wire, their answers, and how two answers compare.

A request becomes the HTTP calls a client of its route makes: the frontend's `/generate` with
`input_ids` and a `picrag.link` hint in the prompt's order (or, for a client-set layout, the
prompt reordered with `"layout": "legolink"`); the runtime's `/generate`, after a
`picrag.compile` of the pieces the link reads (what the frontend does for its clients, with
link_hints.runtime_request's order and hint); `/rag/query` and the chat route with the passages
inline; the plain routes (chat, completions, `/generate` text) with the passages as paragraphs
of the prompt, found by the frontend. An answer keeps what the invariant compares: the status, each prompt's output ids (text
on the RAG routes), and every first-token log-probability the response carried.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
import numpy as np

from rag_server.bench.transparency_requests import (CHAT, COMPILE_ROUTES, ENGINE, ENGINE_COMPILE, PLAIN_CHAT,
                                                    PLAIN_COMPLETION, PLAIN_ROUTES, RAG, VANILLA, Prompt, Request,
                                                    Words)
from rag_server.linking.chunk_compiler import compile_request, segments_to_compile
from picrag_core.engine_report import FIRST_TOKEN_KEY as FULL_LOGPROBS_KEY
from picrag_core.engine_report import decode_floats as decode_logprobs
from picrag_core.link_hints import LinkRequest, hints_of, runtime_request


@dataclass
class Answer:
    """One prompt's answer."""

    output_ids: Optional[tuple[int, ...]]  # None on the RAG routes, which answer text
    text: str
    first_token: dict[int, float]  # first-token log-probabilities the response carried, by token id
    full: Optional[np.ndarray] = None  # the whole-vocabulary distribution (first_token_logprobs)
    policy: Optional[str] = None  # the policy that served it, as reported
    reuse: dict[str, Any] = field(default_factory=dict)  # picrag's cache accounting, as reported

    @property
    def reused_tokens(self) -> int:
        return int(self.reuse.get("picrag_reused_tokens", self.reuse.get("cached_tokens", 0)) or 0)


@dataclass
class Observation:
    status: int
    answers: tuple[Answer, ...] = ()
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def resolved_policy(self) -> Optional[str]:
        return self.answers[0].policy if self.answers else None


@dataclass(frozen=True)
class Difference:
    kind: str  # "" when the answers agree within the tolerance; else "status", "tokens" or "logprobs"
    max_abs: float  # the largest first-token log-probability deviation measured (0: none measured)
    detail: str = ""


@dataclass
class Wire:
    frontend: httpx.Client
    engine: Optional[httpx.Client]  # None: the runtime's URL is unknown, engine routes are not sent
    words: Words
    bos: Optional[int]  # the model's BOS (legolink0's sink token)

    def send(self, request: Request) -> Observation:
        if request.route in (RAG, CHAT):
            return self._text_route(request)
        if request.route in PLAIN_ROUTES:
            return self._plain_route(request)
        client = self.engine if request.route in (ENGINE, ENGINE_COMPILE) else self.frontend
        if client is None:
            raise ValueError(f"route {request.route} needs the runtime's URL")
        if request.route in COMPILE_ROUTES:
            body = compile_request([list(c) for c in request.prompts[0].chunks])
            return _observed(client.post("/generate", json=body), expect_output=False)
        if request.route == ENGINE and request.policy != VANILLA:
            pieces = [piece for prompt in request.prompts
                      for piece in segments_to_compile(prompt.input_ids, self._link(request, prompt))]
            if pieces:
                compiled = client.post("/generate", json=compile_request(pieces))
                if compiled.status_code != 200:
                    return Observation(compiled.status_code, error=f"compile: {compiled.text[:300]}")
        return _observed(client.post("/generate", json=self.generate_body(request)), expect_output=True)

    def _link(self, request: Request, prompt: Prompt) -> LinkRequest:
        link = LinkRequest.of(request.policy, prompt.spans, sink_token=self.bos)
        return dataclasses.replace(link, report_first_token=request.logprobs.full_first_token,
                                   report_span=request.logprobs.span)

    def generate_body(self, request: Request) -> dict[str, Any]:
        """The /generate body of a request of the GENERATE or ENGINE route."""
        prompts = []
        for prompt in request.prompts:
            if request.policy == VANILLA:
                prompts.append((prompt.input_ids, None))
                continue
            link = self._link(request, prompt)
            if request.route == ENGINE or request.client_layout:
                prompts.append(runtime_request(prompt.input_ids, link))
            else:
                prompts.append((prompt.input_ids, hints_of(link)))
        body: dict[str, Any] = {"sampling_params": {"temperature": 0, "max_new_tokens": request.max_new_tokens}}
        ids = [ids for ids, _ in prompts]
        hints = [h for _, h in prompts]
        body["input_ids"] = ids if request.batch else ids[0]
        if hints[0] is not None:
            body["kv_hints"] = hints if request.batch else hints[0]
        logprobs = request.logprobs
        if logprobs.return_logprob:
            body["return_logprob"] = True
            if logprobs.start_len is not None:
                body["logprob_start_len"] = logprobs.start_len
            if logprobs.top:
                body["top_logprobs_num"] = logprobs.top
        if request.extra_key is not None:
            body["extra_key"] = request.extra_key
        return body

    def _documents(self, prompt: Prompt) -> list[dict[str, str]]:
        return [{"text": self.words.text(chunk)} for chunk in prompt.chunks]

    def _text_route(self, request: Request) -> Observation:
        prompt = request.prompts[0]
        question = self.words.text(prompt.question)
        if request.route == RAG:
            response = self.frontend.post("/rag/query", json={
                "question": question, "documents": self._documents(prompt), "policy": request.policy,
                "max_tokens": request.max_new_tokens, "temperature": 0})
            if response.status_code != 200:
                return Observation(response.status_code, error=response.text[:300])
            data = response.json()
            return Observation(200, (Answer(None, data["answer"], {}, policy=data["policy"], reuse=data["usage"]),))
        response = self.frontend.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": question}], "max_tokens": request.max_new_tokens,
            "temperature": 0, "picrag": {"documents": self._documents(prompt), "policy": request.policy}})
        if response.status_code != 200:
            return Observation(response.status_code, error=response.text[:300])
        data = response.json()
        extension = data["picrag"]
        return Observation(200, (Answer(None, data["choices"][0]["message"]["content"], {},
                                        policy=extension["policy"], reuse=extension["usage"]),))


    def plain_text(self, prompt: Prompt) -> tuple[str, str, str]:
        """(head, passages, question) of an unannotated prompt: the passages as paragraphs."""
        return (self.words.text(prompt.head), "\n\n".join(self.words.text(c) for c in prompt.chunks),
                "Question: " + self.words.text(prompt.question))

    def _plain_route(self, request: Request) -> Observation:
        head, passages, question = self.plain_text(request.prompts[0])
        control = {"discover": False} if request.policy == VANILLA else {"discover": True, "policy": request.policy}
        sampling = {"max_tokens": request.max_new_tokens, "temperature": 0, "picrag": control}
        if request.route == PLAIN_CHAT:
            if len(request.prompts[0].question) % 2:
                # LMCache's blend shape: the documents last in the user message, so the link's
                # last passage is stored with the separator of the one before it (its tail).
                system, user = "\n\n".join(filter(None, (head, question))), passages
            else:
                system, user = head, f"{passages}\n\n{question}"
            messages = [{"role": "system", "content": system}] if system else []
            response = self.frontend.post("/v1/chat/completions", json={
                "messages": [*messages, {"role": "user", "content": user}], **sampling})
            return _openai_observed(response, lambda choice: choice["message"]["content"])
        text = f"{head}\n\n{passages}\n\n{question}\nAnswer:" if head else f"{passages}\n\n{question}\nAnswer:"
        if request.route == PLAIN_COMPLETION:
            return _openai_observed(self.frontend.post("/v1/completions", json={"prompt": text, **sampling}),
                                    lambda choice: choice["text"])
        body: dict[str, Any] = {"text": text, "picrag": control,
                                "sampling_params": {"temperature": 0, "max_new_tokens": request.max_new_tokens}}
        if request.logprobs.return_logprob:
            body.update(return_logprob=True, top_logprobs_num=request.logprobs.top)
        return _observed(self.frontend.post("/generate", json=body), expect_output=True)


def _openai_observed(response: httpx.Response, text_of) -> Observation:
    if response.status_code != 200:
        return Observation(response.status_code, error=response.text[:300])
    data = response.json()
    extension = data.get("picrag") or {}
    return Observation(200, (Answer(None, text_of(data["choices"][0]), {}, policy=extension.get("policy"),
                                    reuse=extension.get("usage") or {}),))


def _first_token(meta: dict[str, Any]) -> dict[int, float]:
    """Every first-token log-probability in `meta`: the chosen token's, and the top ones."""
    found: dict[int, float] = {}
    chosen = meta.get("output_token_logprobs") or []
    if chosen and chosen[0][0] is not None:
        found[int(chosen[0][1])] = float(chosen[0][0])
    top = meta.get("output_top_logprobs") or []
    for logprob, token, *_ in (top[0] or []) if top else ():
        if logprob is not None:
            found[int(token)] = float(logprob)
    return found


def _answer(out: dict[str, Any]) -> Answer:
    meta = out.get("meta_info") or {}
    details = meta.get("cached_tokens_details") or {}
    full = details.get(FULL_LOGPROBS_KEY)
    reuse = {k: v for k, v in details.items() if k.startswith("picrag_") and k != FULL_LOGPROBS_KEY}
    reuse["cached_tokens"] = meta.get("cached_tokens", 0)
    return Answer(tuple(out.get("output_ids") or ()), out.get("text", ""), _first_token(meta),
                  None if full is None else decode_logprobs(full), details.get("picrag_policy"), reuse)


def _observed(response: httpx.Response, expect_output: bool) -> Observation:
    if response.status_code != 200:
        return Observation(response.status_code, error=response.text[:300])
    if not expect_output:
        return Observation(200)
    try:
        data = response.json()
    except json.JSONDecodeError:
        return Observation(response.status_code, error=f"not JSON: {response.text[:200]}")
    outputs = data if isinstance(data, list) else [data]
    return Observation(200, tuple(_answer(out) for out in outputs))


def deviation(reference: Answer, observed: Answer) -> float:
    """The largest first-token log-probability difference both answers carry (0: none)."""
    gaps = [abs(reference.first_token[t] - observed.first_token[t])
            for t in reference.first_token.keys() & observed.first_token.keys()]
    if reference.full is not None and observed.full is not None:
        gaps.append(float(np.max(np.abs(reference.full.astype(np.float64) - observed.full.astype(np.float64)))))
    return max(gaps, default=0.0)


def compare(reference: Observation, observed: Observation, tolerance: float) -> Difference:
    """How `observed` differs from `reference`: the same status, the same tokens (text on the RAG
    routes) and first-token log-probabilities within `tolerance`."""
    if reference.status != observed.status or len(reference.answers) != len(observed.answers):
        return Difference("status", 0.0, f"status {reference.status} -> {observed.status} "
                          f"{(reference.error or observed.error)[:200]}")
    worst = 0.0
    for index, (ref, seen) in enumerate(zip(reference.answers, observed.answers)):
        gap = deviation(ref, seen)
        worst = max(worst, gap)
        if (ref.output_ids, ref.text if ref.output_ids is None else "") != \
                (seen.output_ids, seen.text if seen.output_ids is None else ""):
            shown = (ref.output_ids, seen.output_ids) if ref.output_ids is not None else (ref.text, seen.text)
            return Difference("tokens", gap, f"prompt {index}: {shown[0]} -> {shown[1]}")
    if worst > tolerance:
        return Difference("logprobs", worst, f"first-token log-probabilities moved by {worst:.3g}")
    return Difference("", worst)
