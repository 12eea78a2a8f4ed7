"""The transparency fuzzer's view of a test server: its frontend, its runtime and its words."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from rag_server.bench.load import flush_when_idle
from rag_server.bench.transparency_requests import Words
from rag_server.bench.transparency_wire import Wire


@contextmanager
def wire_for(server, tokenizer) -> Iterator[Wire]:
    """A Wire to `server` (a tests.conftest.ServerHandle), with the model's words and BOS."""
    with server.client() as frontend, httpx.Client(base_url=server.runtime_url, timeout=600) as engine:
        yield Wire(frontend, engine, Words.of_tokenizer(tokenizer), tokenizer.bos_token_id)


def flusher(wire: Wire):
    return lambda: flush_when_idle(wire.frontend)
