"""SGLang's native routes that picrag extends: `/generate`, `/flush_cache` and the DSL's
`/concate_and_append_request`.

Every body is first parsed by its typed allowlist (rag_server/api/forwarded_bodies.py), and
counted against --max-inflight by the sequences it asks for. A body with a `picrag.link` hint,
or a text with chunk markers (which becomes one, rag_server/api/chunk_markers.py), is checked
here, once: a well-formed link over a flat `input_ids` prompt in its original order, at most
picrag_core.request_bounds.MAX_CHUNK_SPANS chunks, a policy this server runs, a prompt the runtime would
accept (rag_server/api/client_fields.py refuses token ids outside the vocabulary and picrag's
own cache namespaces in any body, and the link fields only picrag sets). It then takes
the link pipeline (rag_server/linking/pipeline.py), and the runtime's answer is relayed as SGLang
wrote it. Other bodies are forwarded as sent; the pieces of a `picrag.compile` request are
remembered by the compiler once the runtime stored them. A client's link is never offered to
shadow sampling (rag_server/service/shadow.py), which learns only from picrag's own prompts.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from rag_server.api.admission import take_sequences
from rag_server.api.chunk_markers import link_marked_payload
from rag_server.api.client_fields import client_link, refused_field
from rag_server.api.discovery_control import control_of, header_of, without_control
from rag_server.api.forwarded_bodies import GenerateBody, parse_forwarded
from rag_server.api.proxy import forward, forwarded_headers, json_object, loads_bounded, relay
from rag_server.api.state import Frontend, frontend
from rag_server.linking.pipeline import GenerationError
from rag_server.linking.policy_resolver import NamedPolicy, Served
from rag_server.service.prompt_discovery import CONTROL_FIELD, DiscoveredPrompt, DiscoveryControl
from rag_server.service.rag_service import RagRequestError
from rag_server.service.shadow import ShadowSampler
from picrag_core.link_hints import LinkHintError, LinkRequest, parse_link_request
from picrag_core.request_bounds import chunk_count_error

logger = logging.getLogger(__name__)

router = APIRouter()


def _error(status: int, message: str, error_type: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type}}, status)


@router.post("/generate", include_in_schema=False)
async def generate(request: Request) -> Response:
    """SGLang's /generate; prompts with a picrag.link hint get their chunks compiled first."""
    body, payload = await json_object(request)
    if payload is None:
        return await forward(request, body)
    state = frontend(request)
    control, refused = control_of(payload)
    if CONTROL_FIELD in payload:
        payload = without_control(payload)
        body = json.dumps(payload).encode()
    parsed, refused = (None, refused) if refused else parse_forwarded(GenerateBody, payload, state.forward_limits)
    refused = refused or refused_field(payload, len(state.rag.tokenizer))
    if refused:
        return _error(400, refused, "invalid_request")
    busy = take_sequences(request, parsed.sequences(), "sampling_params.n")
    if busy is not None:
        return busy
    if not payload.get("kv_hints"):
        # Tokenizing a long marked text takes a while: off the event loop.
        marked = await asyncio.to_thread(link_marked_payload, payload, state.rag.layout.encode,
                                         state.special_prefix, state.rag.policies.default.policy)
        if marked is None:
            try:
                found = await asyncio.to_thread(_discovered, state, payload, control)
            except RagRequestError as exc:
                return _error(400, str(exc), "invalid_request")
            if found is None:
                return await forward(request, body)
            link = LinkRequest.of(found.served.policy.policy, found.found.chunks, tail=found.found.tail)
            response = await _linked(request, {**_without_prompt(payload), "input_ids": found.input_ids}, link, state,
                                     found.served)
            response.headers.update(header_of(found))
            return response
        payload, body = marked, json.dumps(marked).encode()
    try:
        link = body_link(payload["kv_hints"])
    except LinkHintError as exc:
        return _error(400, str(exc), "invalid_kv_hints")
    if link is None:
        return await forward(request, body)
    if link.compile:
        return await _compile(request, body, payload, state)
    return await _linked(request, payload, link, state)


def _without_prompt(payload: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in payload.items() if key not in ("text", "input_ids")}


def _discovered(state: Frontend, payload: dict[str, Any], control: DiscoveryControl) -> Optional[DiscoveredPrompt]:
    """The passages found in one prompt sent as `text` or flat `input_ids` (a batch is left to the
    prefix cache: one link describes one prompt)."""
    text, input_ids = payload.get("text"), payload.get("input_ids")
    if isinstance(text, str) and input_ids is None:
        return state.discovery.text(text, control)
    if text is None and isinstance(input_ids, list) and input_ids and all(isinstance(t, int) for t in input_ids):
        return state.discovery.token_ids(input_ids, control)
    return None


def body_link(kv_hints: Any) -> Optional[LinkRequest]:
    """The picrag action of a body's `kv_hints` in either of SGLang's forms: one envelope (for
    every prompt of the body), or a list of one per prompt. A link names token spans of one
    prompt, so it comes as one envelope; a list may hold compiles (one per prompt) or no picrag
    action at all. Every envelope is checked: the engine checks each prompt's again."""
    if not isinstance(kv_hints, list):
        return parse_link_request(kv_hints)
    links = [parse_link_request(hints) if hints else None for hints in kv_hints]
    if any(link is not None and not link.compile for link in links):
        raise LinkHintError("a picrag.link hint links one prompt: send it as one kv_hints envelope with a "
                            "flat input_ids, not in a list")
    compiles = sum(link is not None for link in links)
    if compiles and compiles != len(links):
        raise LinkHintError("a batch of picrag.compile requests carries a picrag.compile envelope for every prompt")
    return links[0] if compiles else None


async def _linked(request: Request, payload: dict[str, Any], link: LinkRequest, state: Frontend,
                  served: Optional[Served] = None) -> Response:
    """`link` sent; `served`: its policy resolved (a discovered prompt's), else resolved here."""
    input_ids = payload.get("input_ids")
    try:
        if not (isinstance(input_ids, list) and all(isinstance(t, int) for t in input_ids)):
            raise LinkHintError("picrag.link chunk spans index input_ids: send one prompt as a flat input_ids list")
        link = state.pipeline.with_sink(client_link(link, state.pipeline.sink_token, len(state.rag.tokenizer)))
        link.validate(len(input_ids))
        served = served or state.rag.policies.resolve(NamedPolicy.parse(link.policy_name))
        link = served.link(link)
    except LinkHintError as exc:
        return _error(400, str(exc), "invalid_kv_hints")
    too_many = chunk_count_error(len(link.chunks))  # each one a compile, before the engine sees the link
    if too_many:
        return _error(400, too_many, "invalid_kv_hints")
    too_long = state.rag.limits.refusal(len(input_ids), payload.get("sampling_params"))
    if too_long:
        return _error(400, too_long, "prompt_too_long")
    fields = {k: v for k, v in payload.items() if k not in ("input_ids", "kv_hints")}
    # Counted as load for shadow sampling, never sampled: rag_server/service/shadow.py.
    shadow = state.rag.quality.shadow
    shadow.request_started()
    try:
        linked = await state.pipeline.generate(input_ids, link, fields, headers=forwarded_headers(request),
                                               params=request.query_params)
    except GenerationError as exc:
        shadow.request_ended()
        logger.error("linked /generate failed: %s", exc)
        return _error(exc.status, str(exc), "compile_failed")
    if linked.rest is None:
        shadow.request_ended()
        return relay(linked.response, linked.head)
    return relay(linked.response, _counted(linked.body(), shadow))


async def _counted(body: AsyncIterator[bytes], shadow: ShadowSampler) -> AsyncIterator[bytes]:
    """`body` relayed; the request counts as load for shadow sampling until its last byte."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        shadow.request_ended()


async def _compile(request: Request, body: bytes, payload: dict[str, Any], state: Frontend) -> Response:
    response = await forward(request, body)
    pieces = payload.get("input_ids")
    if response.status_code == 200:
        if isinstance(pieces, list) and pieces and all(isinstance(t, int) for t in pieces):
            pieces = [pieces]
        if isinstance(pieces, list) and all(isinstance(p, list) for p in pieces):
            state.pipeline.compiler.remember_compiled(pieces)
    return response


@router.api_route("/flush_cache", methods=["GET", "POST"], include_in_schema=False)
async def flush_cache(request: Request) -> Response:
    """SGLang's flush; the compiler forgets what it compiled, since nothing is stored now."""
    frontend(request).pipeline.compiler.forget()
    return await forward(request)


@router.post("/concate_and_append_request", include_in_schema=False)
async def concate_and_append_request(request: Request) -> Response:
    """The DSL's `join(mode="concate_and_append")`; SGLang 0.5.23 dropped the route.

    By the time the DSL calls it, it has already appended the forks' texts to the parent's
    text, and every later `/generate` sends that whole text, so acknowledging is enough for
    correct results. The forks' KV is not spliced: the radix cache reuses the common
    prefix, and passages wrapped in `rag_server.dsl.chunk` are reused at any position.
    """
    try:
        payload = loads_bounded(await request.body())
    except ValueError:
        payload = None
    if not (isinstance(payload, dict) and isinstance(payload.get("src_rids"), list)
            and isinstance(payload.get("dst_rid"), str)):
        return JSONResponse({"error": {"message": "expected {\"src_rids\": [...], \"dst_rid\": \"...\"}"}}, 400)
    return JSONResponse({"success": True})
