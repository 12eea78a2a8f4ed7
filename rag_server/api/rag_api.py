"""`POST /rag/query` and `POST /rag/retrieve`: the HTTP edge of the RAG service.

Requests are validated here (pydantic; limits keep one request from monopolising a small
server), then turned into the service's dataclasses. Streaming answers are server-sent
events, each `data:` line one JSON object:

    {"type": "token", "text": "..."}                       as the model produces text
    {"type": "done", ...the RagQueryResponse fields...}    last
    {"type": "error", "status": 502, "message": "..."}    instead of "done" if the runtime fails
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, InstanceOf, WithJsonSchema, field_validator

from rag_server.api.request_stats import Answered, RequestStats, request_stats
from rag_server.api.state import frontend
from rag_server.linking.pipeline import GenerationError
from rag_server.linking.policy_resolver import NamedPolicy
from rag_server.service.rag_service import DEFAULT_TOP_K, RagPlan, RagRequest, RagRequestError, RagResult, RagService
from retrieval.passage import Passage, passage_id
from picrag_core.policies import PolicyError

logger = logging.getLogger(__name__)

MAX_QUESTION_CHARS = 4_000
MAX_DOCUMENTS = 64
MAX_DOCUMENT_CHARS = 20_000
MAX_TITLE_CHARS = 500
MAX_TOP_K = 50
MAX_NEW_TOKENS = 2_048
DEFAULT_MAX_TOKENS = 64
# Above every valid request (64 documents of 20,000 characters, JSON-escaped): refused unread.
MAX_BODY_BYTES = 4 * 1024 * 1024


def _parse_policy(name: Any) -> Any:
    if isinstance(name, NamedPolicy):
        return name
    if not isinstance(name, str):
        raise ValueError("a policy is named by a string ('naive', 'legolink:4')")
    try:
        return NamedPolicy.parse(name)
    except PolicyError as exc:
        raise ValueError(str(exc)) from exc


# A policy name in a request body, parsed once, here: an unknown name is a 422 with the reason.
PolicyName = Annotated[InstanceOf[NamedPolicy], BeforeValidator(_parse_policy), WithJsonSchema({"type": "string"})]


def check_question(question: str) -> str:
    if not question.strip():
        raise ValueError("question is empty")
    return question.strip()


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, max_length=MAX_DOCUMENT_CHARS)
    title: str = Field("", max_length=MAX_TITLE_CHARS)
    id: str | None = Field(None, max_length=200, description="default: content id of the text")
    # NaN and infinities order nothing, and no JSON answer could quote them back.
    score: float | None = Field(None, allow_inf_nan=False, description=(
        "relevance; the lowest-scored go first when the context window is full (unscored: the last "
        "given go first)"))

    def scored(self) -> Passage:
        return Passage(self.id or passage_id(self.text), self.title, self.text, score=self.score)


class RagQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1, max_length=MAX_QUESTION_CHARS)
    top_k: int | None = Field(None, gt=0, le=MAX_TOP_K, description=(
        f"passages to retrieve (default {DEFAULT_TOP_K}); with `documents`, keep the best top_k of them"))
    documents: list[Document] | None = Field(None, min_length=1, max_length=MAX_DOCUMENTS, description=(
        "passages to answer from; omit to retrieve from the server's index"))
    policy: PolicyName | None = Field(None, description=(
        "KV link policy (default: the server's); `auto`: the cheapest within the server's quality target"))
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, gt=0, le=MAX_NEW_TOKENS)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    stream: bool = False

    _question = field_validator("question")(check_question)

    def to_request(self, default_policy: NamedPolicy) -> RagRequest:
        return RagRequest(
            question=self.question,
            policy=self.policy or default_policy,
            max_tokens=self.max_tokens,
            sampling={"temperature": self.temperature},
            documents=None if self.documents is None else [d.scored() for d in self.documents],
            top_k=self.top_k,
        )


class Source(BaseModel):
    id: str
    title: str
    score: float | None

    @classmethod
    def of(cls, passage: Passage) -> Source:
        return cls(id=passage.id, title=passage.title, score=passage.score)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int = Field(description="prompt tokens whose KV came from a cache")
    computed_tokens: int = Field(description="prompt tokens computed for this request")


class Timings(BaseModel):
    retrieval_ms: float
    compile_ms: float = Field(description="making sure every passage's KV is in the chunk store")
    ttft_ms: float = Field(description="request arrival to the first generated token")
    total_ms: float


class RagAnswer(BaseModel):
    answer: str
    finish_reason: Literal["stop", "length"]
    sources: list[Source]
    dropped: list[Source] = Field(description="passages left out to fit the context window")
    warnings: list[str]
    usage: Usage
    timings: Timings
    policy: str = Field(description="the policy that served the answer (`auto`: the one it chose)")
    policy_reason: str | None = Field(None, description="why `auto` chose it; null for a named policy")

    @classmethod
    def of(cls, plan: RagPlan, result: RagResult) -> RagAnswer:
        return cls(
            answer=result.answer.strip(),
            finish_reason=result.finish_reason,
            sources=[Source.of(p) for p in plan.passages],
            dropped=[Source.of(p) for p in plan.dropped],
            warnings=plan.warnings,
            usage=Usage(**vars(result.usage)),
            timings=Timings(**vars(result.timings)),
            policy=plan.request.policy.name,
            policy_reason=plan.policy_reason,
        )

    def answered(self) -> Answered:
        return Answered(self.policy, self.timings.ttft_ms, self.usage.reused_tokens, self.usage.computed_tokens)


class RetrieveQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1, max_length=MAX_QUESTION_CHARS)
    top_k: int = Field(DEFAULT_TOP_K, gt=0, le=MAX_TOP_K)

    _question = field_validator("question")(check_question)


class RetrievedPassage(BaseModel):
    id: str
    title: str
    text: str
    score: float | None


class Retrieved(BaseModel):
    passages: list[RetrievedPassage]
    retrieval_ms: float


def sse(event: dict) -> bytes:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def _service(request: Request) -> RagService:
    return frontend(request).rag


async def _plan(service: RagService, query: RagRequest) -> RagPlan:
    try:
        return await service.plan(query)
    except RagRequestError as exc:
        raise HTTPException(400, str(exc)) from exc


router = APIRouter(tags=["rag"])


@router.post("/rag/query", response_model=RagAnswer, responses={200: {"content": {"text/event-stream": {}}}})
async def rag_query(query: RagQuery, request: Request):
    """Answer a question from passages given inline or retrieved from the server's index."""
    service = _service(request)
    plan = await _plan(service, query.to_request(service.policies.default))
    if query.stream:
        return StreamingResponse(_stream(service, plan, request_stats(request)), media_type="text/event-stream")
    try:
        result = await service.answer(plan)
    except GenerationError as exc:
        raise HTTPException(exc.status, str(exc)) from exc
    answer = RagAnswer.of(plan, result)
    request_stats(request).record(answer.answered())
    return answer


async def _stream(service: RagService, plan: RagPlan, stats: RequestStats) -> AsyncIterator[bytes]:
    try:
        async for event in service.run(plan):
            if isinstance(event, RagResult):
                answer = RagAnswer.of(plan, event)
                stats.record(answer.answered())
                yield sse({"type": "done", **answer.model_dump()})
            else:
                yield sse({"type": "token", "text": event})
    except GenerationError as exc:
        # Headers are gone already: the failure travels as the last event.
        logger.error("streamed RAG generation failed: %s", exc)
        yield sse({"type": "error", "status": exc.status, "message": str(exc)})


@router.post("/rag/retrieve", response_model=Retrieved)
async def rag_retrieve(query: RetrieveQuery, request: Request) -> Retrieved:
    """The passages the server's index returns for a question, best first."""
    try:
        passages, retrieval_ms = await _service(request).retrieve(query.question, query.top_k)
    except RagRequestError as exc:
        raise HTTPException(400, str(exc)) from exc
    return Retrieved(
        passages=[RetrievedPassage(id=p.id, title=p.title, text=p.text, score=p.score) for p in passages],
        retrieval_ms=retrieval_ms,
    )
