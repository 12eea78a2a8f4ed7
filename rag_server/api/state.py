"""What every route of the frontend shares, opened when the app starts: the runtime client, the
link pipeline and the RAG service (`app.state.frontend`)."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
from fastapi import Request

from rag_server.api.chunk_markers import leading_special_tokens
from rag_server.api.forwarded_bodies import ForwardLimits
from rag_server.service.prompt_discovery import PromptDiscovery, generation_defaults
from rag_server.api.upstream import UpstreamTimeouts, runtime_client
from rag_server.linking.chunk_compiler import ChunkCompiler
from rag_server.linking.chunk_discovery import DiscoverySettings
from rag_server.linking.kv_budget import KVBudget, pool_tokens
from rag_server.linking.pipeline import LinkPipeline
from rag_server.linking.policy_resolver import PolicyResolver
from rag_server.service.context_window import ContextLimits
from rag_server.service.quality import QualityControl, QualitySettings
from rag_server.service.rag_service import RagService


logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class FrontendSettings:
    runtime_url: str
    policies: PolicyResolver  # default, availability and fallback of link policies
    model_path: Optional[Path] = None  # default: the runtime's
    index_dir: Optional[Path] = None
    timeouts: UpstreamTimeouts = UpstreamTimeouts()  # every call to the runtime
    quality: QualitySettings = QualitySettings()  # `auto` and shadow sampling
    pass_unlisted_fields: bool = False  # forward fields the allowlist does not list (trusted clients)
    discovery: DiscoverySettings = DiscoverySettings()  # passages found in whole prompts
    engines: int = 1  # engines behind runtime_url, each with its own KV pool (replicas behind the gateway)


@dataclass
class Frontend:
    client: httpx.AsyncClient  # to the runtime
    pipeline: LinkPipeline
    rag: RagService
    model_name: str
    special_prefix: list[int]  # what the tokenizer puts before any text (chunk-marked prompts)
    forward_limits: ForwardLimits  # what a body forwarded to the runtime is checked against
    discovery: PromptDiscovery  # chat, completions and /generate prompts with passages inside
    engine_pool: Optional[int] = None  # one engine's KV pool (tokens); None: the runtime did not say

    def engines_live(self, live: int) -> None:
        """The gateway routes to `live` engines now: linked prompts share their pools only
        (rag_server/linking/kv_budget.py). None live keeps one pool's worth: requests fail at the
        gateway then, and the budget must not stop the first that could run when one is back."""
        budget = self.pipeline.budget
        if budget is None or self.engine_pool is None:
            return
        capacity = self.engine_pool * max(live, 1)
        if capacity != budget.capacity:
            logger.warning("%d engine(s) live behind the gateway: linked prompts now share %d KV tokens (were %d)",
                           live, capacity, budget.capacity)
            budget.resize(capacity)

    @classmethod
    async def open(cls, settings: FrontendSettings) -> Frontend:
        client = runtime_client(settings.runtime_url, settings.timeouts)
        try:
            info = (await client.get("/get_model_info")).json()
            model_dir = Path(settings.model_path or info["model_path"])
            tokenizer = await asyncio.to_thread(_load_tokenizer, Path(info.get("tokenizer_path") or model_dir))
            retriever = await asyncio.to_thread(_open_index, settings.index_dir) if settings.index_dir else None
            server_info = (await client.get("/get_server_info")).json()
            pool = pool_tokens(server_info)
            budget = None if pool is None else KVBudget(pool * settings.engines)
            if budget is None:
                logger.warning("the runtime reports no KV pool size: linked prompts are not admitted by it")
            pipeline = LinkPipeline(client, ChunkCompiler(client), sink_token=tokenizer.bos_token_id, budget=budget)
            rag = RagService(
                tokenizer,
                pipeline,
                _context_limits(server_info, model_dir),
                retriever=retriever,
                policies=settings.policies,
                quality=await asyncio.to_thread(QualityControl.open, settings.quality, model_dir, pipeline),
            )
        except BaseException:
            await client.aclose()
            raise
        special_prefix = leading_special_tokens(tokenizer)
        chat_defaults = await asyncio.to_thread(generation_defaults, model_dir, server_info.get("sampling_defaults"))
        return cls(client, pipeline, rag, info.get("served_model_name") or info["model_path"], special_prefix,
                   ForwardLimits(rag.limits.context_length, settings.pass_unlisted_fields),
                   PromptDiscovery(rag, settings.discovery, special_prefix, chat_defaults), pool)

    async def aclose(self) -> None:
        await self.rag.quality.shadow.aclose()
        await self.client.aclose()


def frontend(request: Request) -> Frontend:
    return request.app.state.frontend


def _context_limits(server_info: dict, model_path: Path) -> ContextLimits:
    context_length = server_info.get("context_length")
    if not context_length:  # not set on the command line: the model's own
        config = json.loads((model_path / "config.json").read_text())
        context_length = config["max_position_embeddings"]
    return ContextLimits(
        context_length=int(context_length),
        max_input_tokens=int(server_info.get("max_req_input_len") or context_length),
    )


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _open_index(index_dir: Path):
    from retrieval.retriever import Retriever

    return Retriever.open(index_dir)
