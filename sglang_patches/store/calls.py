"""Calls into a remote chunk store that can never hold up the engine for long.

A `TimedLane` runs one call at a time on a thread of its own and waits for it at most
`timeout_s`. A call that does not answer in time is left running (a client library call cannot
be interrupted) and the lane refuses every call until it returns, so a dead or slow store costs
each caller at most one timeout, never a pile of stuck threads, and a buffer the stuck call
writes into is never handed to another one. After a timeout the lane also refuses every call
for `backoff_s` (a store that answers, but slower than the timeout, would otherwise cost a
timeout per call it returns from). Every refusal, timeout and error raises
StoreUnavailable (the caller counts it and computes the chunk), except the exceptions the lane
is told are answers (a value the store returned that failed its checks).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

T = TypeVar("T")


class StoreUnavailable(RuntimeError):
    """The store did not answer (timeout, error, an earlier call still stuck, not connected)."""


class TimedLane:
    def __init__(self, name: str, timeout_s: float, answers: tuple[type[Exception], ...] = (),
                 backoff_s: float = 0.0):
        self.name = name
        self.timeout_s = timeout_s
        self.answers = answers
        self.backoff_s = backoff_s
        self._lock = threading.Lock()
        self._in_flight: Future | None = None
        self._skip_until = 0.0  # time.monotonic() before which calls are refused (after a timeout)

    def call(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._in_flight is not None and not self._in_flight.done():
                raise StoreUnavailable(f"chunk store {self.name}: an earlier call has not returned")
            if time.monotonic() < self._skip_until:
                raise StoreUnavailable(f"chunk store {self.name}: skipped for {self.backoff_s:g} s after a timeout")
            self._in_flight = future = Future()
        # A daemon thread per call (one at a time): a call stuck in the client library never
        # holds up the process's exit.
        threading.Thread(target=_run, args=(fn, future), name=f"picrag-store-{self.name}", daemon=True).start()
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            with self._lock:
                self._skip_until = time.monotonic() + self.backoff_s
            raise StoreUnavailable(f"chunk store {self.name}: no answer in {self.timeout_s:g} s") from None
        except (StoreUnavailable, *self.answers):
            raise
        except Exception as exc:  # whatever the client library raises, the chunk is only a miss
            raise StoreUnavailable(f"chunk store {self.name}: {type(exc).__name__}: {exc}") from exc


def _run(fn: Callable[[], T], future: Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:  # handed to the caller, who decides what it means
        future.set_exception(exc)
