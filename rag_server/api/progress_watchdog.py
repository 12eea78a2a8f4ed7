"""The scheduler's progress, behind `/health`: a scheduler that has work and makes no progress
for `timeout_s` is stalled, and the server gives up on its runtime.

SGLang's HTTP side answers its own `/health` while its scheduler is stuck (in one forward, or in
Python code that holds the GIL, which also silences SGLang's own watchdog thread), so the runtime's
`/health` cannot show it. What can: the scheduler answers `/server_info`'s state query between
two iterations of its loop, at once when idle and after the current forward when busy. So the
watchdog asks it every `interval_s` on a connection of its own; a query not answered within
`timeout_s` means one iteration took that long: the scheduler had work and made no progress.
`/health` then answers 503, and `on_stall` runs: `picrag serve` stops its runtime and exits with
status 3 for its supervisor (a stuck scheduler cannot process an abort either). `timeout_s` must
exceed the longest legitimate forward (a chunked prefill on a slow CPU takes minutes).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Optional

import httpx

logger = logging.getLogger(__name__)

DEFAULT_WATCHDOG_TIMEOUT_S = 300.0
STATE_QUERY = "/server_info"


class ProgressWatchdog:
    def __init__(self, runtime_url: str, timeout_s: float, interval_s: float, connect_timeout_s: float,
                 on_stall: Optional[Callable[[str], None]] = None):
        if timeout_s <= 0 or interval_s <= 0:
            raise ValueError(f"watchdog timeout and interval must be positive, not {timeout_s}, {interval_s}")
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.on_stall = on_stall
        self.stalled: Optional[str] = None  # why, once the scheduler stalled
        self._client = httpx.AsyncClient(base_url=runtime_url,
                                         timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                                         limits=httpx.Limits(max_connections=1, max_keepalive_connections=0))
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                await self._client.get(STATE_QUERY)
            except httpx.ReadTimeout:
                self.stalled = (f"scheduler stalled: it has work and made no progress for {self.timeout_s:g} s "
                                f"(its state query went unanswered)")
                logger.error("%s", self.stalled)
                if self.on_stall is not None:
                    self.on_stall(self.stalled)
                return
            except httpx.HTTPError:
                pass  # a runtime that is down: the health probe and the process watch report it
            await asyncio.sleep(self.interval_s)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._client.aclose()
