"""When the SGLang runtime dies, `picrag serve` ends its in-flight requests with an error event
and exits with RUNTIME_DIED_EXIT for a supervisor to restart it. A server of its own (the test
kills its runtime's scheduler mid-request), started once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from rag_server.cli import RUNTIME_DIED_EXIT
from tests.conftest import start_picrag_server

LONG_GENERATION = {"text": "Once upon a time", "stream": True,
                   "sampling_params": {"max_new_tokens": 8_000, "ignore_eos": True, "temperature": 0}}


def rag_query(musique: list[dict]) -> dict:
    """A streamed RAG request over many passages: seconds of compiling and prefill on CPU."""
    documents = [{"title": p["title"], "text": p["text"]} for row in musique[:4] for p in row["passages"]]
    return {"question": musique[0]["question"], "documents": documents[:64], "max_tokens": 2048, "stream": True,
            "policy": "naive"}


def scheduler_of(server_pid: int) -> psutil.Process:
    schedulers = [p for p in psutil.Process(server_pid).children(recursive=True)
                  if " ".join(p.cmdline()).startswith("sglang::scheduler")]
    assert len(schedulers) == 1, schedulers
    return schedulers[0]


@pytest.mark.slow
def test_dead_runtime_ends_in_flight_requests_with_errors_and_the_server_exits(tmp_path, musique):
    server = start_picrag_server(tmp_path / "server.log", ["--max-total-tokens", "8192", "--health-interval", "1"])
    processes = psutil.Process(server.process.pid).children(recursive=True)
    rag_events: list[dict] = []
    rag_started = threading.Event()

    def read_rag_stream() -> None:
        with httpx.Client(base_url=server.url, timeout=600) as rag_client, \
                rag_client.stream("POST", "/rag/query", json=rag_query(musique)) as response:
            assert response.status_code == 200
            rag_started.set()
            rag_events.extend(json.loads(line[len("data:"):]) for line in response.iter_lines()
                              if line.startswith("data:"))

    try:
        with server.client(timeout=600) as client, \
                client.stream("POST", "/generate", json=LONG_GENERATION) as generation:
            lines = generation.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            rag = threading.Thread(target=read_rag_stream)
            rag.start()
            assert rag_started.wait(300), "the RAG request never started"
            time.sleep(1.0)  # its passages are being compiled
            os.kill(scheduler_of(server.process.pid).pid, signal.SIGKILL)
            rest = [line[len("data:"):].strip() for line in lines if line.startswith("data:")]
            rag.join(300)
        exit_code = server.process.wait(120)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    _, left = psutil.wait_procs(processes, timeout=30)
    log = server.log.read_text()

    assert "text" in json.loads(first[len("data:"):])
    # SGLang's own stream format for an error, then the end of the stream.
    error = json.loads(rest[-2])["error"]
    assert error["code"] == 503 and "runtime" in error["message"], error
    assert rest[-1] == "[DONE]"
    assert all("text" in json.loads(line) for line in rest[:-2])
    # /rag/query's documented error event, in place of "done".
    assert rag_events and rag_events[-1]["type"] == "error" and rag_events[-1]["status"] == 503, rag_events[-3:]
    assert not any(event["type"] == "done" for event in rag_events)
    assert exit_code == RUNTIME_DIED_EXIT, log[-3000:]
    assert "SGLang runtime died" in log
    assert not left, f"runtime processes outlived the server: {[p.pid for p in left]}"
