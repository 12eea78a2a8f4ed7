"""Shadow sampling: a sampled request served by a chunk-reusing policy is also run as `full`, for
one token, in the background, to measure the policy's first-token quality on live traffic.

After the user's answer has ended, a fraction `rate` of the RAG requests whose policy reuses chunks
(`/rag/query` and the chat extension: prompts picrag built itself) gets a shadow pair: `full` for one greedy token, then
the user's own link (same prompt, same policy) for one token, each with its first token's
log-probabilities over the whole vocabulary (sglang_patches.steps.first_token_report). Their exact
first-token KL and agreement go to the QualityRecord (rag_server/service/first_token_quality.py).
Nothing of this touches the user's request: the shadow starts once the answer is complete, runs
as its own requests, and its failures are only counted.

What `auto` learns from must not be a client's to choose: a client's own `/generate` links count
as load but are never sampled (their prompt, chunks and layout are the client's: links whose
KL is 0 by construction would steer `auto`'s calibration), and samples are filed under a bounded
set of names (`sample_name`): the policies of the calibration table, or else the policy family,
so that a client naming `legolink:<k>` for every k cannot grow the record or the metric labels.

Cost bound: SGLang 0.5.23 takes a request `priority`, but its scheduler ignores it unless started
with --enable-priority-scheduling (which also changes how every other request is scheduled), so
shadows are kept low-priority by capacity instead: at most `max_concurrent` shadow pairs run at
once, and none starts while more than `busy_requests` linked requests are in flight; a sampled
request refused for either reason is counted as skipped. The full prefill of the prompt is the
cost of a pair (the policy side computes only what the policy computes); both are counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from rag_server.linking.pipeline import GenerationError, LinkPipeline
from rag_server.service.first_token_quality import QualityRecord, Sample
from picrag_core.engine_report import EngineReport, exact_kl
from picrag_core.link_hints import LinkRequest

logger = logging.getLogger(__name__)

DEFAULT_SHADOW_RATE = 0.02
DEFAULT_MAX_CONCURRENT = 1
DEFAULT_BUSY_REQUESTS = 2


@dataclass(frozen=True)
class ShadowSettings:
    # Fraction of reuse-policy requests shadowed. Off unless asked (`picrag serve` asks for
    # DEFAULT_SHADOW_RATE): an embedding app or a test sees no requests it did not send.
    rate: float = 0.0
    max_concurrent: int = DEFAULT_MAX_CONCURRENT  # shadow pairs running at once
    busy_requests: int = DEFAULT_BUSY_REQUESTS  # no shadow starts while more RAG requests run

    def __post_init__(self):
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"shadow rate must be within [0, 1], not {self.rate}")
        if self.max_concurrent < 1 or self.busy_requests < 0:
            raise ValueError(f"bad shadow settings: {self}")


@dataclass(frozen=True)
class FirstToken:
    token: int  # the greedy first token
    logprobs: np.ndarray  # its distribution over the whole vocabulary
    computed_tokens: int  # prompt tokens the runtime computed


def first_token(body: bytes) -> FirstToken:
    """The first token of a non-streamed /generate answer to a link asked with
    `report_first_token`."""
    data = json.loads(body)
    out = data[0] if isinstance(data, list) else data
    report = EngineReport.of(out["meta_info"])
    if report.first_token_logprobs is None:
        raise KeyError("the runtime sent no first-token distribution")
    return FirstToken(token=int(out["output_ids"][0]), logprobs=report.first_token_logprobs,
                      computed_tokens=report.computed_tokens)


def sample_name(link: LinkRequest, calibrated: Collection[str]) -> str:
    """The name a sample of `link` is filed under: its policy where `calibrated` (the calibration
    table's policies) lists it, else its policy family."""
    name = link.policy_name
    return name if name in calibrated else link.family.name


class ShadowSampler:
    def __init__(self, pipeline: LinkPipeline, record: QualityRecord, settings: ShadowSettings = ShadowSettings(),
                 rng: Optional[random.Random] = None, calibrated: Collection[str] = ()):
        self.pipeline = pipeline
        self.record = record
        self.settings = settings
        self.calibrated = frozenset(calibrated)  # policy names samples are filed under (else: the family)
        self._rng = rng or random.Random()
        self._tasks: set[asyncio.Task] = set()
        self.in_flight = 0  # linked requests being answered: shadows wait for a quieter moment

    def request_started(self) -> None:
        """A linked request (any route) is being answered."""
        self.in_flight += 1

    def request_ended(self) -> None:
        """It ended without being offered for sampling (a client's link, or a failed answer)."""
        self.in_flight -= 1

    def answered(self, input_ids: Sequence[int], link: LinkRequest) -> bool:
        """A RAG request ended, answered in full: offered for sampling (True when a shadow started)."""
        self.request_ended()
        return self.offer(input_ids, link, self.in_flight)

    def offer(self, input_ids: Sequence[int], link: LinkRequest, in_flight: int) -> bool:
        """Maybe start a shadow pair for a request answered with `link`, `in_flight` linked
        requests running; True when one started."""
        if not (link.family.reuses_chunks and link.chunks) or self._rng.random() >= self.settings.rate:
            return False
        if len(self._tasks) >= self.settings.max_concurrent or in_flight > self.settings.busy_requests:
            self.record.cost.skipped_capacity += 1
            return False
        task = asyncio.create_task(self._shadow(list(input_ids), link, sample_name(link, self.calibrated)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def drain(self) -> None:
        """Wait for the running shadows (tests; shutdown)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.drain()

    async def _shadow(self, input_ids: list[int], link: LinkRequest, policy: str) -> None:
        cost = self.record.cost
        cost.sent += 1
        try:
            full = await self._one_token(input_ids, LinkRequest.of("full", link.chunks))
            cost.prefilled_tokens += full.computed_tokens
            probe = await self._one_token(input_ids, link)
            cost.prefilled_tokens += probe.computed_tokens
            kl = exact_kl(full.logprobs, probe.logprobs)
        except (GenerationError, ValueError, KeyError, IndexError, TypeError) as exc:
            cost.failed += 1
            logger.warning("shadow sample of %s failed: %s", policy, exc)
            return
        self.record.add(Sample(policy, len(input_ids), kl, probe.token == full.token))

    async def _one_token(self, input_ids: list[int], link: LinkRequest) -> FirstToken:
        fields = {"sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "stream": False}
        linked = await self.pipeline.generate(input_ids, dataclasses.replace(link, report_first_token=True), fields)
        if linked.response.status_code != 200:
            raise GenerationError(f"runtime answered {linked.response.status_code}: "
                                  f"{linked.head[:300].decode(errors='replace')}")
        return first_token(linked.head)
