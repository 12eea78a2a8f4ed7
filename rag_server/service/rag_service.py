"""A RAG request, end to end: passages (given or retrieved), the prompt, the linked generation.

Every entry point (`/rag/query`, the OpenAI chat extension, batch QA through `/rag/query`)
goes through `RagService`, so they all build the same prompt (retrieval/prompt_layout.py)
and take the same compile-then-link path to the runtime.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rag_server.linking.pipeline import LinkPipeline, Linked
from rag_server.linking.policy_resolver import NamedPolicy, PolicyResolver, Served
from rag_server.service.context_window import ContextLimits, PromptTooLong, fit_passages
from rag_server.service.quality import QualityControl, QualitySettings
from retrieval.passage import Passage
from retrieval.prompt_layout import DEFAULT_SYSTEM_PROMPT, CompiledPrompt, PromptLayout, PromptLayoutError, Tokenizer
from picrag_core.engine_report import EngineReport
from picrag_core.link_hints import LinkRequest
from picrag_core.policies import PolicyError

if TYPE_CHECKING:
    from retrieval.retriever import Retriever

DEFAULT_TOP_K = 5


class RagRequestError(ValueError):
    """A request the service cannot serve as asked (HTTP 400)."""


@dataclass(frozen=True)
class RagRequest:
    question: str
    policy: NamedPolicy
    max_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)  # runtime sampling params besides max_new_tokens
    documents: Sequence[Passage] | None = None  # None: retrieve from the loaded index
    top_k: int | None = None
    system_prompt: str | None = None
    history: Sequence[dict[str, str]] = ()  # earlier chat turns


@dataclass
class RagPlan:
    request: RagRequest
    prompt: CompiledPrompt
    passages: list[Passage]
    dropped: list[Passage]
    warnings: list[str]
    retrieval_ms: float
    started: float  # perf_counter() when the request arrived
    policy_reason: str | None = None  # why `auto` served request.policy


@dataclass(frozen=True)
class RagUsage:
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int
    computed_tokens: int


@dataclass(frozen=True)
class RagTimings:
    retrieval_ms: float
    compile_ms: float
    ttft_ms: float
    total_ms: float


@dataclass(frozen=True)
class RagResult:
    answer: str
    finish_reason: str  # "stop" or "length", as OpenAI names them
    usage: RagUsage
    timings: RagTimings


def _usage(meta: dict[str, Any], prompt_tokens: int) -> RagUsage:
    report = EngineReport.of(meta, prompt_tokens)
    return RagUsage(
        prompt_tokens=report.prompt_tokens,
        completion_tokens=report.completion_tokens,
        reused_tokens=report.reused_tokens,
        computed_tokens=report.computed_tokens,
    )


def _finish_reason(meta: dict[str, Any]) -> str:
    reason = meta.get("finish_reason") or {}
    return "length" if reason.get("type") == "length" else "stop"


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def keep_best(passages: Sequence[Passage], k: int) -> list[Passage]:
    """The `k` best-scored passages (the first `k` when unscored), in their given order."""
    ranked = sorted(
        range(len(passages)),
        key=lambda i: (passages[i].score is None, -(passages[i].score or 0.0), i),
    )
    chosen = set(ranked[:k])
    return [p for i, p in enumerate(passages) if i in chosen]


class RagService:
    def __init__(
        self,
        tokenizer: Tokenizer,
        pipeline: LinkPipeline,
        limits: ContextLimits,
        retriever: Retriever | None = None,
        policies: PolicyResolver | None = None,  # None: the default resolver, every policy served
        quality: QualityControl | None = None,  # None: no calibration table, no shadow sampling
    ):
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        self.limits = limits
        self.retriever = retriever
        self.policies = policies or PolicyResolver.start()
        self.layout = PromptLayout(tokenizer)
        self.quality = quality or QualityControl.open(QualitySettings(), None, pipeline)

    def _layout(self, request: RagRequest) -> PromptLayout:
        if request.system_prompt is None and not request.history:
            return self.layout
        return PromptLayout(self.tokenizer, request.system_prompt or DEFAULT_SYSTEM_PROMPT, request.history)

    async def retrieve(self, question: str, k: int) -> tuple[list[Passage], float]:
        if self.retriever is None:
            raise RagRequestError(
                "no passage index is loaded: send `documents` with the request, "
                "or start the server with `picrag serve --index DIR`"
            )
        started = time.perf_counter()
        # Embedding the question is torch work: keep it off the event loop.
        found = await asyncio.to_thread(self.retriever.search, question, k)
        return found, _ms(time.perf_counter() - started)

    async def plan(self, request: RagRequest) -> RagPlan:
        started = time.perf_counter()
        # Resolved before retrieval, so a refused policy costs nothing; `auto` waits for its prompt.
        served = None if request.policy.auto else self.resolve(request.policy)
        if request.documents is None:
            candidates, retrieval_ms = await self.retrieve(request.question, request.top_k or DEFAULT_TOP_K)
        else:
            candidates, retrieval_ms = list(request.documents), 0.0
            if request.top_k is not None:
                candidates = keep_best(candidates, request.top_k)
        budget = self.limits.prompt_budget(request.max_tokens)
        try:
            # Templating and tokenizing a large input (the chat's head included) take a while: off the event loop.
            fitted = await asyncio.to_thread(
                lambda: fit_passages(self._layout(request), request.question, candidates, budget))
        except (PromptLayoutError, PromptTooLong) as exc:
            raise RagRequestError(str(exc)) from exc
        warnings = []
        if fitted.dropped:
            warnings.append(
                f"dropped {len(fitted.dropped)} of {len(candidates)} passages (lowest scores first) "
                f"to fit the context window: {budget} prompt tokens with max_tokens={request.max_tokens}"
            )
        plan = RagPlan(request, fitted.prompt, fitted.kept, fitted.dropped, warnings, retrieval_ms, started)
        return self._served(plan, served or self.serve(request.policy, len(fitted.prompt.input_ids)))

    def resolve(self, named: NamedPolicy) -> Served:
        """The resolver's answer for a request asking for `named` (not `auto`); RagRequestError where refused."""
        try:
            return self.policies.resolve(named)
        except PolicyError as exc:
            raise RagRequestError(str(exc)) from exc

    def serve(self, named: NamedPolicy, prompt_tokens: int) -> Served:
        """What a request asking for `named`, its prompt `prompt_tokens` long, is served with:
        `auto` chooses for the prompt first (rag_server/service/auto_policy.py)."""
        if not named.auto:
            return self.resolve(named)
        choice = self.quality.auto.choose(prompt_tokens, self.policies.auto_excluded)
        return dataclasses.replace(self.resolve(NamedPolicy.of(choice.policy)), reason=choice.reason)

    def plan_prompt(self, request: RagRequest, prompt: CompiledPrompt, started: float, served: Served) -> RagPlan:
        """The plan of a whole prompt whose passages were found in it (rag_server/linking/
        chunk_discovery.py): no retrieval, no layout; `served`: the request's policy, resolved."""
        return self._served(RagPlan(request, prompt, [], [], [], 0.0, started), served)

    @staticmethod
    def _served(plan: RagPlan, served: Served) -> RagPlan:
        """`plan` with the policy it is served with, why `auto` chose it, and why where it is not
        the one asked for."""
        request = dataclasses.replace(plan.request, policy=served.policy)
        warnings = plan.warnings if served.warning is None else [*plan.warnings, served.warning]
        return dataclasses.replace(plan, request=request, policy_reason=served.reason, warnings=warnings)

    async def run(self, plan: RagPlan) -> AsyncIterator[str | RagResult]:
        """Text deltas as the runtime produces them, then the RagResult."""
        request, prompt = plan.request, plan.prompt
        link = LinkRequest.of(request.policy.policy, prompt.chunks, self.pipeline.sink_token, prompt.tail)
        link.validate(len(prompt.input_ids))
        sampling = {**request.sampling, "max_new_tokens": request.max_tokens}
        # Always streamed: the first token is seen when it is produced, so TTFT is measured for
        # streaming and non-streaming clients alike.
        shadow = self.quality.shadow
        shadow.request_started()
        answered = False
        try:
            linked = await self.pipeline.generate(prompt.input_ids, link, {"sampling_params": sampling, "stream": True})
            async for event in self._answer(plan, linked):
                yield event
            answered = True
        finally:
            # Once the answer is complete: the shadow pair runs as requests of its own.
            if answered:
                shadow.answered(prompt.input_ids, link)
            else:
                shadow.request_ended()

    async def _answer(self, plan: RagPlan, linked: Linked) -> AsyncIterator[str | RagResult]:
        prompt = plan.prompt
        answer: list[str] = []
        meta: dict[str, Any] = {}
        first_token_at: float | None = None
        async for delta in linked.deltas():
            meta = delta.meta
            if delta.text:
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                answer.append(delta.text)
                yield delta.text
        finished = time.perf_counter()
        yield RagResult(
            answer="".join(answer),
            finish_reason=_finish_reason(meta),
            usage=_usage(meta, len(prompt.input_ids)),
            timings=RagTimings(
                retrieval_ms=plan.retrieval_ms,
                compile_ms=_ms(linked.compile_s),
                ttft_ms=_ms((first_token_at or finished) - plan.started),
                total_ms=_ms(finished - plan.started),
            ),
        )

    async def answer(self, plan: RagPlan) -> RagResult:
        result = None
        async for event in self.run(plan):
            if isinstance(event, RagResult):
                result = event
        assert result is not None, "run() always ends with a RagResult"
        return result
