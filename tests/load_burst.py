"""A burst of RAG requests from concurrent clients, with the server's memory sampled throughout."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import cycle, islice

import httpx
import psutil

# Growth of the server's resident memory (frontend + runtime processes) allowed over a burst:
# the KV pool is allocated at start, so growth would be per-request state that is never freed.
MAX_RSS_GROWTH = 256 * 2**20


def server_rss(pid: int) -> int:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def ask(client: httpx.Client, body: dict) -> tuple[str, int, int]:
    response = client.post("/rag/query", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    return result["answer"], result["usage"]["prompt_tokens"], result["usage"]["reused_tokens"]


@dataclass
class Burst:
    answers: list[tuple[int, tuple[str, int, int]]]  # (index into the bodies, ask's result)
    baseline_rss: int
    peak_rss: int
    final_rss: int
    seconds: float

    def report(self) -> str:
        return (f"{len(self.answers)} requests in {self.seconds:.1f} s; server RSS "
                f"{self.baseline_rss / 2**20:.0f} MiB before, {self.peak_rss / 2**20:.0f} peak, "
                f"{self.final_rss / 2**20:.0f} after")


def run_burst(server, bodies: list[dict], requests: int, clients: int) -> Burst:
    """`requests` requests cycling through `bodies`, from `clients` concurrent clients."""
    baseline = server_rss(server.process.pid)
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.5):
            peak = max(peak, server_rss(server.process.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    work = list(islice(cycle(range(len(bodies))), requests))
    started = time.monotonic()
    try:
        with httpx.Client(base_url=server.url, timeout=600, limits=httpx.Limits(max_connections=clients)) as client, \
                ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(lambda i: (i, ask(client, bodies[i])), work))
    finally:
        done.set()
        sampler.join()
    return Burst(answers, baseline, peak, server_rss(server.process.pid), time.monotonic() - started)
