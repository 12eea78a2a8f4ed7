"""Calls into a remote chunk store that can never hold up the engine for long.

A `TimedLane` runs one call at a time on a thread of its own and waits for it at most
`timeout_s`. A call that does not answer in time is left running (a client library call cannot
be interrupted) and the lane refuses every call until it returns, so a dead or slow store costs
each caller at most one timeout, never a pile of stuck threads, and a buffer the stuck call
writes into is never handed to another one. Every refusal, timeout and error raises
StoreUnavailable (the caller counts it and computes the chunk), except the exceptions the lane
is told are answers (a value the store returned that failed its checks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

T = TypeVar("T")


class StoreUnavailable(RuntimeError):
    """The store did not answer (timeout, error, an earlier call still stuck, not connected)."""


class TimedLane:
    def __init__(self, name: str, timeout_s: float, answers: tuple[type[Exception], ...] = ()):
        self.name = name
        self.timeout_s = timeout_s
        self.answers = answers
        self._lock = threading.Lock()
        self._in_flight: Future | None = None

    def call(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._in_flight is not None and not self._in_flight.done():
                raise StoreUnavailable(f"chunk store {self.name}: an earlier call has not returned")
            self._in_flight = future = Future()
        # A daemon thread per call (one at a time): a call stuck in the client library never
        # holds up the process's exit.
        threading.Thread(target=_run, args=(fn, future), name=f"picrag-store-{self.name}", daemon=True).start()
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
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
