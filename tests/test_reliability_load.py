"""200 RAG requests from 16 concurrent clients over shared passages: none lost, every answer
the one the same request gets alone, and the server's memory stays bounded.

The shared server's KV pool (16,384 tokens) holds every passage here: eviction under load is
not exercised (tests/test_chunk_cache_eviction.py covers eviction, serially, on a tiny pool).
Filler passages exceeding the pool made every request recompute one and took 10 minutes here.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import cycle, islice

import httpx
import psutil
import pytest

pytestmark = pytest.mark.server

REQUESTS = 200
CLIENTS = 16
# Growth of the server's resident memory (frontend + runtime processes) allowed over the burst:
# the KV pool is allocated at start, so growth would be per-request state that is never freed.
MAX_RSS_GROWTH = 256 * 2**20

PASSAGES = {
    "eiffel": {"title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron tower in Paris, France."},
    "ben": {"title": "Big Ben", "text": "Big Ben is the bell of the clock tower in London."},
    "opera": {"title": "Sydney Opera House", "text": "The Sydney Opera House is a theatre in Sydney."},
}
QUESTIONS = ["Where is the Eiffel Tower?", "Where is Big Ben?", "Which city has the opera house?",
             "What is Big Ben?"]
ARRANGEMENTS = [["eiffel", "ben"], ["ben", "opera", "eiffel"], ["opera", "eiffel"]]


def variants() -> list[dict]:
    """Every question with every arrangement: the same passages at different positions."""
    return [{"question": question, "documents": [PASSAGES[name] for name in names],
             "policy": "naive", "max_tokens": 4, "temperature": 0}
            for question in QUESTIONS for names in ARRANGEMENTS]


def server_rss(pid: int) -> int:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def ask(client: httpx.Client, body: dict) -> tuple[str, int, int]:
    response = client.post("/rag/query", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    return result["answer"], result["usage"]["prompt_tokens"], result["usage"]["reused_tokens"]


def test_concurrent_answers_equal_serial_answers_and_memory_stays_bounded(picrag_server):
    bodies = variants()
    with picrag_server.client(timeout=600) as client:
        serial = [ask(client, body) for body in bodies]  # also warms the chunk cache and allocator
    baseline = server_rss(picrag_server.process.pid)
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.5):
            peak = max(peak, server_rss(picrag_server.process.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    work = list(islice(cycle(range(len(bodies))), REQUESTS))
    started = time.monotonic()
    limits = httpx.Limits(max_connections=CLIENTS)
    try:
        with httpx.Client(base_url=picrag_server.url, timeout=600, limits=limits) as client, \
                ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(lambda i: (i, ask(client, bodies[i])), work))
    finally:
        done.set()
        sampler.join()
    elapsed = time.monotonic() - started

    final = server_rss(picrag_server.process.pid)
    print(f"{REQUESTS} requests in {elapsed:.1f} s; server RSS {baseline / 2**20:.0f} MiB before, "
          f"{peak / 2**20:.0f} peak, {final / 2**20:.0f} after")
    assert len(answers) == REQUESTS
    mismatches = [(bodies[i]["question"], got, serial[i]) for i, got in answers if got[:2] != serial[i][:2]]
    assert not mismatches, mismatches[:5]
    # The passages were compiled by the serial pass: every concurrent request reused them.
    assert all(reused > 0 for _, (_, _, reused) in answers)
    assert peak - baseline < MAX_RSS_GROWTH
