"""RAG through OpenAI's chat API: `POST /v1/chat/completions` with a `picrag` extension field.

A body without `picrag` goes to SGLang's own chat endpoint as sent, once its typed allowlist
(rag_server/api/forwarded_bodies.py; `/v1/completions` too) passed, unless passages are found
inside its messages (rag_server/service/prompt_discovery.py; a `picrag` field naming `discover`
controls that): then it is linked and answered here in SGLang's format. With the RAG
extension, the request is answered like `/rag/query` (same prompt layout, same link path):

    {"model": "...", "messages": [...], "max_tokens": 32, "temperature": 0, "stream": false,
     "picrag": {"documents": [{"title": "...", "text": "..."}], "top_k": 3, "policy": "naive"}}

The system message (if any) replaces the default RAG system prompt, earlier turns stay chat
turns before the last one, and the last message, which must be the user's, is the question.
Honoured sampling fields: max_tokens / max_completion_tokens, temperature, top_p, stop.
The response is an ordinary chat completion plus a `picrag` object (sources, dropped, warnings,
reuse counters, timings, policy); streamed, it rides on the chunk carrying `finish_reason`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rag_server.api.admission import take_sequences
from rag_server.api.client_fields import refused_field
from rag_server.api.discovery_control import control_of, header_of, is_control, without_control
from rag_server.api.forwarded_bodies import ChatBody, CompletionBody, OpenAISampling, Stop, parse_forwarded
from rag_server.api.message_limits import MAX_MESSAGES, message_limit_error
from rag_server.api.proxy import forward, json_object
from rag_server.api.rag_api import (MAX_DOCUMENTS, MAX_NEW_TOKENS, MAX_QUESTION_CHARS, MAX_TOP_K, Document,
                                    PolicyName, RagAnswer, sse)
from rag_server.api.state import Frontend, frontend
from rag_server.linking.pipeline import GenerationError
from rag_server.linking.policy_resolver import NamedPolicy
from rag_server.service.prompt_discovery import COMPLETION_MAX_TOKENS, CONTROL_FIELD, DiscoveredPrompt
from rag_server.service.rag_service import RagPlan, RagRequest, RagRequestError, RagResult, RagService

# Without max_tokens an OpenAI model may use the whole window; a RAG answer needs far less,
# and the reservation shrinks the room for passages.
DEFAULT_CHAT_MAX_TOKENS = 256


class PicragExtension(BaseModel):
    model_config = ConfigDict(extra="forbid")

    documents: list[Document] | None = Field(None, min_length=1, max_length=MAX_DOCUMENTS)
    top_k: int | None = Field(None, gt=0, le=MAX_TOP_K)
    policy: PolicyName | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class RagChatRequest(BaseModel):
    # Other OpenAI fields are accepted and ignored, as many OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: str | None = None
    max_tokens: int | None = Field(None, gt=0, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(None, gt=0, le=MAX_NEW_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: Stop | None = None
    n: int = Field(1, ge=1, le=1, description="one choice only")
    stream: bool = False
    stream_options: StreamOptions | None = None
    picrag: PicragExtension

    def to_request(self, default_policy: NamedPolicy) -> RagRequest:
        *earlier, last = self.messages
        if last.role != "user":
            raise RagRequestError("the last message must be the user's question")
        question = last.text().strip()
        if not question:
            raise RagRequestError("the last user message is empty")
        if len(question) > MAX_QUESTION_CHARS:
            raise RagRequestError(f"the question has over {MAX_QUESTION_CHARS} characters")
        system = [m.text() for m in earlier if m.role in ("system", "developer")]
        history = [{"role": m.role, "content": m.text()} for m in earlier if m.role in ("user", "assistant")]
        sampling: dict[str, Any] = {}
        if self.temperature is not None:
            sampling["temperature"] = self.temperature
        if self.top_p is not None:
            sampling["top_p"] = self.top_p
        if self.stop is not None:
            sampling["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        documents = self.picrag.documents
        return RagRequest(
            question=question,
            policy=self.picrag.policy or default_policy,
            max_tokens=self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS,
            sampling=sampling,
            documents=None if documents is None else [d.scored() for d in documents],
            top_k=self.picrag.top_k,
            system_prompt="\n\n".join(system) if system else None,
            history=history,
        )


def openai_error(status: int, message: str, error_type: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": None, "code": status}}, status)


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in exc.errors()
    )


def _picrag_extra(plan: RagPlan, result: RagResult) -> dict[str, Any]:
    answer = RagAnswer.of(plan, result).model_dump()
    return {key: answer[key] for key in ("sources", "dropped", "warnings", "usage", "timings", "policy",
                                               "policy_reason")}


def _openai_usage(result: RagResult) -> dict[str, int]:
    usage = result.usage
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


router = APIRouter()


@router.post("/v1/chat/completions", include_in_schema=False)
async def chat_completions(request: Request) -> Response:
    """SGLang's chat endpoint, or RAG when the body carries a `picrag` extension, or a linked
    prompt when its passages are found in the messages (rag_server/service/prompt_discovery.py)."""
    body, payload = await json_object(request)
    if payload is None:
        return await forward(request, body)
    too_many = message_limit_error(payload)
    if too_many:
        return openai_error(400, too_many)
    state = frontend(request)
    if "picrag" in payload and not is_control(payload["picrag"]):
        return await rag_chat_completion(state.rag, payload, state.model_name)
    control, refused = control_of(payload)
    plain = without_control(payload)
    refused = refused or await _checked(request, ChatBody, plain, plain)
    if refused:
        return refused if isinstance(refused, Response) else openai_error(400, refused)
    try:
        found = await asyncio.to_thread(state.discovery.chat, plain, control)
    except RagRequestError as exc:
        return openai_error(400, str(exc))
    if found is None:
        return await forward(request, body if CONTROL_FIELD not in payload else _json(plain))
    return await _discovered_chat(state, plain, found)


@router.post("/v1/completions", include_in_schema=False)
async def completions(request: Request) -> Response:
    """SGLang's completions endpoint, after the client-field checks `/generate` has (a token
    prompt is checked like `input_ids`), or a linked prompt when its passages are found in it."""
    body, payload = await json_object(request)
    if payload is None:
        return await forward(request, body)
    control, refused = control_of(payload)
    plain = without_control(payload)
    prompt = plain.get("prompt")
    token_prompt = prompt if isinstance(prompt, list) and all(not isinstance(p, str) for p in prompt) else None
    refused = refused or await _checked(request, CompletionBody, plain,
                                        {"extra_key": plain.get("extra_key"), "input_ids": token_prompt}, "prompt")
    if refused:
        return refused if isinstance(refused, Response) else openai_error(400, refused)
    state = frontend(request)
    found = None
    if state.discovery.completion_fields(plain):
        try:
            found = await asyncio.to_thread(state.discovery.text, plain["prompt"], control)
        except RagRequestError as exc:
            return openai_error(400, str(exc))
    if found is None:
        return await forward(request, body if CONTROL_FIELD not in payload else _json(plain))
    return await _discovered_completion(state, plain, found)


def _json(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode()


async def _checked(request: Request, body_type: type[OpenAISampling], payload: dict[str, Any],
                   sglang_fields: dict[str, Any], prompt_field: str = "input_ids") -> Response | str | None:
    """Why `payload` is refused (its allowlist model, the client-field checks on `sglang_fields`,
    its prompt spelled `prompt_field`), or the busy answer; None once its sequences are counted."""
    state = frontend(request)
    parsed, refused = parse_forwarded(body_type, payload, state.forward_limits)
    if not refused:
        refused = refused_field(sglang_fields, len(state.rag.tokenizer))
        refused = refused and refused.replace("input_ids", prompt_field, 1)
    if refused:
        return refused
    return take_sequences(request, parsed.sequences(), "n")


async def _discovered_chat(state: Frontend, payload: dict[str, Any], found: DiscoveredPrompt) -> Response:
    discovery = state.discovery
    try:
        plan = discovery.plan(found, discovery.chat_sampling(payload),
                              payload.get("max_completion_tokens") or payload.get("max_tokens"))
    except RagRequestError as exc:
        return openai_error(400, str(exc))
    options = payload.get("stream_options") or {}
    response = await chat_response(state.rag, plan, payload.get("model") or state.model_name,
                                   bool(payload.get("stream")), bool(options.get("include_usage")),
                                   {"discovered": found.report()})
    response.headers.update(header_of(found))
    return response


async def rag_chat_completion(service: RagService, payload: dict[str, Any], model_name: str) -> Response:
    try:
        chat = RagChatRequest.model_validate(payload)
        plan = await service.plan(chat.to_request(service.policies.default))
    except ValidationError as exc:
        return openai_error(400, _validation_message(exc))
    except RagRequestError as exc:
        return openai_error(400, str(exc))
    include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
    return await chat_response(service, plan, chat.model or model_name, chat.stream, include_usage)


async def chat_response(service: RagService, plan: RagPlan, model: str, stream: bool, include_usage: bool,
                        extra: dict[str, Any] | None = None) -> Response:
    """The chat completion (a stream of chunks, or one object) that answers `plan`; its
    `picrag` object holds the reuse report, and `extra` besides."""
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    if stream:
        return StreamingResponse(_stream(service, plan, completion_id, model, include_usage, extra or {}),
                                 media_type="text/event-stream")
    try:
        result = await service.answer(plan)
    except GenerationError as exc:
        return openai_error(exc.status, str(exc), "server_error" if exc.status >= 500 else "invalid_request_error")
    return JSONResponse({
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": result.answer},
            "finish_reason": result.finish_reason,
            "logprobs": None,
        }],
        "usage": _openai_usage(result),
        "picrag": {**_picrag_extra(plan, result), **(extra or {})},
    })


async def _discovered_completion(state: Frontend, payload: dict[str, Any], found: DiscoveredPrompt) -> Response:
    discovery = state.discovery
    try:
        plan = discovery.plan(found, discovery.completion_sampling(payload),
                              payload.get("max_tokens", COMPLETION_MAX_TOKENS))
    except RagRequestError as exc:
        return openai_error(400, str(exc))
    model = payload.get("model") or state.model_name
    extra = {"discovered": found.report()}
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    if payload.get("stream"):
        options = payload.get("stream_options") or {}
        response: Response = StreamingResponse(
            _completion_stream(state.rag, plan, completion_id, model, bool(options.get("include_usage")), extra),
            media_type="text/event-stream")
    else:
        try:
            result = await state.rag.answer(plan)
        except GenerationError as exc:
            return openai_error(exc.status, str(exc),
                                "server_error" if exc.status >= 500 else "invalid_request_error")
        response = JSONResponse({
            "id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": result.answer, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": _openai_usage(result),
            "picrag": {**_picrag_extra(plan, result), **extra},
        })
    response.headers.update(header_of(found))
    return response


async def _completion_stream(service: RagService, plan: RagPlan, completion_id: str, model: str,
                             include_usage: bool, extra: dict[str, Any]) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(text: str, finish_reason: str | None = None, **more: Any) -> bytes:
        return sse({"id": completion_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
                    **more})

    try:
        async for event in service.run(plan):
            if isinstance(event, RagResult):
                yield chunk("", event.finish_reason, picrag={**_picrag_extra(plan, event), **extra})
                if include_usage:
                    yield sse({"id": completion_id, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": _openai_usage(event)})
            else:
                yield chunk(event)
    except GenerationError as exc:
        yield sse({"error": {"message": str(exc), "type": "server_error", "code": exc.status}})
    yield b"data: [DONE]\n\n"


async def _stream(
    service: RagService, plan: RagPlan, completion_id: str, model: str, include_usage: bool, extra: dict[str, Any]
) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> bytes:
        return sse({
            "id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
            **extra,
        })

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for event in service.run(plan):
            if isinstance(event, RagResult):
                yield chunk({}, event.finish_reason, picrag={**_picrag_extra(plan, event), **extra})
                if include_usage:
                    yield sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                               "model": model, "choices": [], "usage": _openai_usage(event)})
            else:
                yield chunk({"content": event})
    except GenerationError as exc:
        yield sse({"error": {"message": str(exc), "type": "server_error", "code": exc.status}})
    yield b"data: [DONE]\n\n"
