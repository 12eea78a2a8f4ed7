"""One scheduled request of `picrag bench steady`, sent as its route sends it, and what came back.

Every route is streamed; the time to first token counts from the request's scheduled arrival
(so time spent waiting for a free client counts, as an open-loop client's would), and the
reuse comes from the route's own report: `/rag/query`'s `usage`, the chat route's `picrag.usage`,
`/generate`'s `meta_info` (picrag's link accounting, or SGLang's own prefix hits). Stock SGLang
(`VANILLA`) gets every request as a plain `/generate` of the prompt picrag would build.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import httpx

from picrag_core.engine_report import EngineReport
from picrag_core.link_hints import link_hints
from rag_server.bench.steady_schedule import CHAT, DEFAULT_POLICY, RAG, Scheduled
from rag_server.linking import sse
from retrieval.prompt_layout import PromptLayout

VANILLA = "vanilla"  # stock SGLang
PREFIX = "prefix"  # picrag with every request on SGLang's prefix cache
PICRAG = "picrag"  # picrag with the schedule's policy mix


@dataclass
class Outcome:
    index: int
    system: str
    route: str
    policy: str
    at_s: float  # scheduled arrival
    status: int  # HTTP status; 0: no answer (connection error or timeout)
    sent_s: float = 0.0  # when a client took it (>= at_s when clients were all busy)
    ttft_s: Optional[float] = None  # first token, from the scheduled arrival
    done_s: Optional[float] = None  # the last byte, from the run's start
    prompt_tokens: int = 0
    reused_tokens: int = 0
    error: str = ""
    text: str = ""  # the answer as streamed
    sent: bool = True  # False: still waiting for a client when the run ended (a backlog), never sent

    @property
    def answered(self) -> bool:
        return self.status == 200 and not self.error and self.ttft_s is not None


def unsent_outcome(request: Scheduled, system: str) -> Outcome:
    return Outcome(request.index, system, request.route, request.policy, request.at_s, 0, sent=False,
                   error="not sent: every client was busy until the run ended")


def _documents(request: Scheduled) -> list[dict[str, str]]:
    return [{"title": p.title, "text": p.text} for p in request.passages]


def request_of(request: Scheduled, system: str, layout: PromptLayout, max_tokens: int,
               default_policy: str) -> tuple[str, dict[str, Any]]:
    """The (path, body) `system` is sent for `request`. `default_policy`: the server's own, which a
    `/generate` client with hints names (a hint names a concrete policy: `auto` is chosen by the
    frontend on the routes that build the prompt)."""
    policy = PREFIX if system == PREFIX else request.policy
    named = {} if policy == DEFAULT_POLICY else {"policy": policy}
    if system != VANILLA and request.route == RAG:
        return "/rag/query", {"question": request.question, "documents": _documents(request),
                              "top_k": len(request.passages), "max_tokens": max_tokens, "temperature": 0,
                              "stream": True, **named}
    if system != VANILLA and request.route == CHAT:
        return "/v1/chat/completions", {
            "model": "default", "messages": [{"role": "user", "content": request.question}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0,
            "picrag": {"documents": _documents(request), "top_k": len(request.passages), **named}}
    prompt = layout.build(request.question, list(request.passages))
    body: dict[str, Any] = {"input_ids": prompt.input_ids, "stream": True,
                            "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}}
    if system != VANILLA:
        hinted = default_policy if policy in (DEFAULT_POLICY, "auto") else policy
        body["kv_hints"] = link_hints(hinted, list(prompt.chunks), tail=prompt.tail)
    return "/generate", body


def _reuse(route_path: str, event: dict[str, Any]) -> Optional[tuple[int, int]]:
    """(prompt tokens, reused tokens) in a route's final event, or None if it carries none."""
    if route_path == "/rag/query" and event.get("type") == "done":
        usage = event.get("usage") or {}
        return int(usage.get("prompt_tokens", 0)), int(usage.get("reused_tokens", 0))
    if route_path == "/v1/chat/completions" and isinstance(event.get("picrag"), dict):
        usage = event["picrag"].get("usage") or {}
        return int(usage.get("prompt_tokens", 0)), int(usage.get("reused_tokens", 0))
    if route_path == "/generate" and event.get("meta_info"):
        report = EngineReport.of(event["meta_info"])
        return report.prompt_tokens, report.reused_tokens
    return None


def _text(route_path: str, event: dict[str, Any], so_far: str) -> str:
    """The answer after `event` (`/generate` streams the whole text so far, the others deltas)."""
    if route_path == "/rag/query":
        return so_far + (event.get("text") or "" if event.get("type") == "token" else "")
    if route_path == "/v1/chat/completions":
        choices = event.get("choices") or []
        return so_far + ((choices[0].get("delta") or {}).get("content") or "" if choices else "")
    return event.get("text") or so_far


def _error_of(event: dict[str, Any]) -> str:
    if event.get("type") == "error":
        return f"{event.get('status')}: {event.get('message')}"
    if "error" in event:
        return str(event["error"])[:300]
    return ""


def send(client: httpx.Client, request: Scheduled, system: str, layout: PromptLayout, max_tokens: int,
         default_policy: str, started: float) -> Outcome:
    """Send `request` now; `started`: the run's start (time.perf_counter())."""
    path, body = request_of(request, system, layout, max_tokens, default_policy)
    policy = PREFIX if system == PREFIX else request.policy
    outcome = Outcome(request.index, system, request.route if system != VANILLA else "generate", policy,
                      request.at_s, 0, sent_s=time.perf_counter() - started)
    try:
        with client.stream("POST", path, json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = response.read()[:300].decode(errors="replace")
                return outcome
            for event in sse.events(response.iter_lines()):
                outcome.text = _text(path, event, outcome.text)
                if outcome.ttft_s is None and outcome.text:
                    outcome.ttft_s = time.perf_counter() - started - request.at_s
                outcome.error = outcome.error or _error_of(event)
                reuse = _reuse(path, event)
                if reuse is not None:
                    outcome.prompt_tokens, outcome.reused_tokens = reuse
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        outcome.done_s = time.perf_counter() - started
    return outcome
