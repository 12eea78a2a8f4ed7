"""`picrag serve`'s start-up self-check: on a small built-in prompt, chunk reuse must give what
computing the prompt gives, before any request is linked with a chunk-reusing policy.

Three checks, each of one fact chunk reuse rests on:
1. rope_shift: keys moved by re-rotation equal fresh keys at the new positions. The engine runs
   it with the model's own rotary embedding when its chunk cache starts
   (sglang_patches.selfcheck) and reports it in the runtime's `/get_server_info`; read from there.
2. reuse_at_offset_0: a passage compiled alone and reused at offset 0 (`naive`) answers like
   SGLang's prefix cache holding the same passage.
3. legolink_covering_chunks: `legolink:K` with K at least every passage's length recomputes every
   passage token in context, so it answers like `full`.
2 and 3 run through the runtime's `/generate` on the frontend's own link pipeline (compile,
then link), and compare the greedy tokens and the first token's top logprobs within a tolerance
of the KV dtype: fp32 runs the same arithmetic in another order (differences ~1e-6), fp16/bf16
round every activation (~1e-2). Each also checks that reuse happened at all (chunk hits, tokens
computed), so a check cannot pass by reusing nothing, nor on a flat first-token distribution,
where every answer would compare equal. 2 and 3 are skipped when 1 failed (reuse
is refused anyway) and 3 when the attention backend cannot run LegoLink.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import httpx

from rag_server.linking.chunk_compiler import ROUTING_KEY_HEADER, ChunkCompiler, passage_set_key
from rag_server.linking.pipeline import GenerationError, LinkPipeline
from rag_server.linking.reuse_gate import FAILED, PASSED, SKIPPED, Check, SelfCheckReport
from retrieval.prompt_layout import PromptLayout, PromptPassage
from picrag_core.engine_report import EngineReport
from picrag_core.link_hints import LinkRequest
from picrag_core.engine_report import SERVER_INFO_KEY

logger = logging.getLogger(__name__)

PASSAGES = (
    PromptPassage("Snowy owl", "The snowy owl is a large white owl of the Arctic tundra. It hunts mostly "
                  "lemmings and other small rodents, and in hard winters some birds fly far south."),
    PromptPassage("Lake Baikal", "Lake Baikal in Siberia is the deepest lake in the world, about 1,640 metres "
                  "at its deepest point, and holds around a fifth of the fresh surface water on Earth."),
)
QUESTION = "What does the snowy owl mostly hunt?"
NEW_TOKENS = 4
TOP_LOGPROBS = 5
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Tolerance:
    logprob: float  # largest first-token logprob difference
    tokens: int  # greedy tokens that must be equal


TOLERANCES = {
    "float32": Tolerance(1e-3, NEW_TOKENS),
    # Half precision: one rounding apart can change a later greedy token; the first must agree.
    "float16": Tolerance(0.05, 1),
    "bfloat16": Tolerance(0.1, 1),
}


class _CheckFailed(Exception):
    pass


def _request_fields() -> dict[str, Any]:
    return {"sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS},
            "return_logprob": True, "top_logprobs_num": TOP_LOGPROBS}


def _top(out: dict) -> dict[int, float]:
    return {token: logprob for logprob, token, _ in out["meta_info"]["output_top_logprobs"][0]}


def difference(out: dict, reference: dict, tolerance: Tolerance) -> Optional[str]:
    """How `out` answers differently from `reference`, or None when it answers the same."""
    top, reference_top = _top(out), _top(reference)
    ranked = sorted(reference_top.values(), reverse=True)
    if len(ranked) > 1 and ranked[0] - ranked[-1] <= tolerance.logprob:
        # Equal answers prove nothing when the model answers nothing: a runtime that computes
        # zeros (SGLang's CPU MoE does) gives every policy the same flat distribution.
        return (f"the reference's {len(ranked)} likeliest first tokens are equally likely ({ranked[0]:.4g}): "
                "the model's output carries nothing to compare")
    tied = len(ranked) > 1 and ranked[0] - ranked[1] <= tolerance.logprob
    n = tolerance.tokens
    if out["output_ids"][:n] != reference["output_ids"][:n] and not (n == 1 and tied):
        return f"greedy tokens {out['output_ids'][:n]} where the reference gives {reference['output_ids'][:n]}"
    best = max(reference_top, key=reference_top.get)
    if best not in top:
        return f"the reference's first token {best} is not among the {TOP_LOGPROBS} likeliest"
    worst = max(abs(top[token] - logprob) for token, logprob in reference_top.items() if token in top)
    if worst > tolerance.logprob:
        return f"first-token logprobs differ by {worst:.3g} (tolerance {tolerance.logprob:g})"
    return None


class SelfCheck:
    def __init__(self, client: httpx.AsyncClient, layout: PromptLayout, unavailable: Mapping[str, str]):
        self.client = client
        self.layout = layout
        self.unavailable = unavailable  # policy family -> why this server cannot run it
        self.pipeline = LinkPipeline(client, ChunkCompiler(client))

    async def run(self) -> SelfCheckReport:
        started = time.perf_counter()
        rope, dtype = await self._rope_check()
        checks = [rope]
        if rope.status != PASSED:
            checks += [Check(name, SKIPPED, "not run: re-rotation failed")
                       for name in ("reuse_at_offset_0", "legolink_covering_chunks")]
        else:
            # Another KV dtype gets the loosest tolerance known; one coarser than bf16 (fp8) may
            # fail the checks and be served as --on-selfcheck-failure says.
            tolerance = TOLERANCES.get(dtype, TOLERANCES["bfloat16"])
            # A clean tree: the checks count tokens that they, not an earlier request, cached.
            # At start-up nothing is, so a flush the runtime refuses only goes in the log.
            flushed = await self.client.post("/flush_cache")
            if flushed.status_code != 200:
                logger.info("self-check: the runtime did not flush its cache (%d)", flushed.status_code)
            # A family the server cannot run (the model or the backend forbids it) has nothing to check.
            for name, family, check in (("reuse_at_offset_0", "naive", self._reuse_at_offset_0),
                                        ("legolink_covering_chunks", "legolink", self._legolink_covering)):
                if family in self.unavailable:
                    checks.append(Check(name, SKIPPED, f"{family} is unavailable here: {self.unavailable[family]}"))
                else:
                    checks.append(await self._checked(name, check(tolerance)))
        return SelfCheckReport(tuple(checks), time.perf_counter() - started)

    async def _rope_check(self) -> tuple[Check, str]:
        info = (await self.client.get("/get_server_info")).json()
        states = info.get("internal_states") or [{}]
        reported = [state.get(SERVER_INFO_KEY) for state in states]
        if any(check is None for check in reported):
            return Check("rope_shift", FAILED, "the runtime reports no re-rotation check: it does not run "
                         "picrag's chunk cache (--radix-cache-backend pic)"), ""
        failed = [check for check in reported if not check["passed"]]
        check = (failed or reported)[0]
        return Check("rope_shift", FAILED if failed else PASSED, check["detail"]), check["dtype"]

    @staticmethod
    async def _checked(name: str, check: Awaitable[str]) -> Check:
        try:
            return Check(name, PASSED, await check)
        except _CheckFailed as exc:
            return Check(name, FAILED, str(exc))
        except (GenerationError, httpx.HTTPError, KeyError, ValueError) as exc:
            return Check(name, FAILED, f"{type(exc).__name__}: {exc}")

    async def _linked(self, input_ids: list[int], link: LinkRequest) -> dict:
        linked = await self.pipeline.generate(input_ids, link, _request_fields())
        body = b"".join([piece async for piece in linked.body()])
        if linked.response.status_code != 200:
            raise _CheckFailed(f"{link.policy} answered {linked.response.status_code}: {body[:300].decode(errors='replace')}")
        return json.loads(body)

    async def _vanilla(self, input_ids: list[int], route: str) -> dict:
        # Behind the model gateway, with the linked request's routing key: to the same replica.
        response = await self.client.post("/generate", json={"input_ids": input_ids, **_request_fields()},
                                          headers={ROUTING_KEY_HEADER: route})
        if response.status_code != 200:
            raise _CheckFailed(f"a plain /generate answered {response.status_code}: {response.text[:300]}")
        return response.json()

    async def _reuse_at_offset_0(self, tolerance: Tolerance) -> str:
        chunk = self.layout.passage_ids(PASSAGES[0])
        input_ids = chunk + self.layout.question_ids(QUESTION)
        link = LinkRequest.of("naive", [(0, len(chunk))])
        naive = await self._linked(input_ids, link)
        # SGLang's prefix cache: the passage alone first, then the prompt, which finds it cached.
        route = passage_set_key(input_ids, link)
        await self._vanilla(chunk, route)
        reference = await self._vanilla(input_ids, route)
        counts = EngineReport.of(naive["meta_info"]).link
        if counts is None or counts.chunk_hits != 1 or counts.reused_tokens < len(chunk):
            hits, reused = (None, None) if counts is None else (counts.chunk_hits, counts.reused_tokens)
            raise _CheckFailed(f"the compiled passage was not reused (chunk hits {hits}, "
                               f"reused tokens {reused} of {len(chunk)})")
        if EngineReport.of(reference["meta_info"]).cached_tokens < len(chunk):
            raise _CheckFailed("SGLang's prefix cache did not hold the passage")
        found = difference(naive, reference, tolerance)
        if found:
            raise _CheckFailed(f"naive at offset 0 against the prefix cache: {found}")
        return f"naive at offset 0 answers like the prefix cache ({len(chunk)} reused tokens)"

    async def _legolink_covering(self, tolerance: Tolerance) -> str:
        prompt = self.layout.build(QUESTION, PASSAGES)
        k = max(end - start for start, end in prompt.chunks)
        lego = await self._linked(prompt.input_ids, LinkRequest.of(f"legolink:{k}", prompt.chunks))
        full = await self._linked(prompt.input_ids, LinkRequest.of("full", prompt.chunks))
        counts = EngineReport.of(lego["meta_info"]).link
        computed = None if counts is None else counts.computed_tokens
        expected = len(prompt.input_ids) - len(self.layout.head_ids)
        if computed != expected:
            raise _CheckFailed(f"legolink:{k} computed {computed} tokens, not the {expected} after the head")
        found = difference(lego, full, tolerance)
        if found:
            raise _CheckFailed(f"legolink:{k} against full: {found}")
        return f"legolink:{k} answers like full ({expected} tokens recomputed at their positions)"


async def self_check(client: httpx.AsyncClient, layout: PromptLayout, unavailable: Mapping[str, str]) -> SelfCheckReport:
    return await SelfCheck(client, layout, unavailable).run()


def self_check_layout(tokenizer_dir: Path) -> PromptLayout:
    """The prompt layout the self-check links with: the served model's tokenizer (a few seconds
    of imports the first time in a process, so `picrag serve` loads it while the runtime starts)."""
    from transformers import AutoTokenizer

    return PromptLayout(AutoTokenizer.from_pretrained(tokenizer_dir))


def run_self_check(runtime_url: str, layout: PromptLayout, unavailable: Mapping[str, str]) -> SelfCheckReport:
    """The self-check against the runtime at `runtime_url`, logged check by check."""

    async def run() -> SelfCheckReport:
        async with httpx.AsyncClient(base_url=runtime_url, timeout=REQUEST_TIMEOUT_S) as client:
            return await self_check(client, layout, unavailable)

    report = asyncio.run(run())
    for check in report.checks:
        logger.log(logging.WARNING if check.status == FAILED else logging.INFO,
                   "self-check %s: %s: %s", check.name, check.status, check.detail)
    logger.info("self-check %s in %.1f s", PASSED if report.passed else FAILED, report.seconds)
    return report
