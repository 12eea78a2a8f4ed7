"""The faults `picrag bench soak` injects into a running `picrag serve`, and what each must cost.

* `bad_input`: a burst of malformed and over-bound bodies on every route (broken and deeply
  nested JSON, wrong types, token ids outside the vocabulary, sampling fields past their bounds, a
  picrag hint the engine does not admit): each must be a 4xx, none may take the server down.
* `slow_clients`: streamed requests whose answers are never read, held open for a while, then
  dropped: the server must go on answering everyone else.
* `master_stop` / `master_restart`: the Mooncake master killed (SIGKILL), later started again on
  the same ports: a store that is down costs chunk reloads (computed, counted), never a request.
* `replica_kill`: one engine of `--replicas 2` killed (SIGKILL): SGLang's gateway routes around it;
  requests it held end with an error, later ones go to the other engine.

A full store needs no event: the soak's Mooncake segment is sized to fill within the run, after
which saves are refused (counted as `disk_write_failures`) and serving goes on.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import httpx

BAD_INPUT, SLOW_CLIENTS, MASTER_STOP, MASTER_RESTART, REPLICA_KILL = (
    "bad_input", "slow_clients", "master_stop", "master_restart", "replica_kill")
# When each fault strikes, as a share of the run.
TIMELINE = ((0.10, BAD_INPUT), (0.20, SLOW_CLIENTS), (0.35, MASTER_STOP), (0.45, MASTER_RESTART),
            (0.60, REPLICA_KILL), (0.75, BAD_INPUT), (0.85, SLOW_CLIENTS))
SLOW_CLIENTS_HELD = 8
SLOW_HOLD_S = 45.0


@dataclass
class FaultRecord:
    kind: str
    at_s: float
    detail: str = ""
    # For bad_input: status -> count; a 5xx or no answer here is a finding.
    statuses: dict[str, int] = field(default_factory=dict)
    ok: bool = True


def bad_bodies(vocab_size: int) -> list[tuple[str, bytes]]:
    """(path, raw body) pairs that each deserve a 4xx."""
    deep = b"[" * 50_000 + b"]" * 50_000
    bodies: list[tuple[str, Any]] = [
        ("/generate", b'{"text": "unclosed'),
        ("/generate", b'{"input_ids": ' + deep + b"}"),
        ("/rag/query", b'{"question": ' + deep + b"}"),
        ("/v1/chat/completions", b"\xff\xfe not json"),
        ("/generate", {"input_ids": [1, 2, vocab_size + 5], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"input_ids": [1, 2, -3], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "top_logprobs_num": 10 ** 9,
                       "return_logprob": True}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop_regex": "(a+)+b" * 500}}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10 ** 9}}),
        ("/generate", {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2},
                       "kv_hints": {"protocol_version": "1", "message_id": "x", "actions": [
                           {"action_id": "l", "action_type": "picrag.link", "action_version": "1",
                            "payload": {"policy": "naive", "chunks": [[3, 1]]}}]}}),
        ("/rag/query", {"question": 7}),
        ("/rag/query", {"question": "q", "documents": [{"title": "t", "text": "x", "score": "NaN"}], "top_k": -1}),
        ("/rag/query", {"question": "q", "max_tokens": -4}),
        ("/v1/chat/completions", {"messages": "not a list"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 9}),
        ("/v1/completions", {"prompt": [[1, 2, vocab_size * 2]], "max_tokens": 2}),
    ]
    return [(path, body if isinstance(body, bytes) else json.dumps(body).encode()) for path, body in bodies]


def send_bad_input(url: str, vocab_size: int, record: FaultRecord) -> None:
    with httpx.Client(base_url=url, timeout=120) as client:
        for path, body in bad_bodies(vocab_size):
            try:
                status = str(client.post(path, content=body, headers={"content-type": "application/json"}).status_code)
            except httpx.HTTPError as exc:
                status = f"no answer ({type(exc).__name__})"
            record.statuses[status] = record.statuses.get(status, 0) + 1
            if not status.startswith("4"):
                record.ok = False
                record.detail += f"{path} got {status}; "


def hold_slow_clients(url: str, record: FaultRecord, stop: threading.Event, hold_s: float) -> None:
    """Streamed questions whose answers are never read, dropped after `hold_s`."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"question": "What is a slow reader?", "max_tokens": 64, "stream": True,
                       "documents": [{"title": "Slow", "text": "A client that never reads its answer. " * 40}]})
    request = (f"POST /rag/query HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    sockets = []
    for _ in range(SLOW_CLIENTS_HELD):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.settimeout(30)
        try:
            sock.connect((host, int(port)))
            sock.sendall(request)
            sockets.append(sock)
        except OSError as exc:
            record.detail += f"connect failed: {exc}; "
            sock.close()
    record.detail += f"{len(sockets)} streams held unread for {hold_s:.0f} s"
    stop.wait(hold_s)
    for sock in sockets:
        sock.close()


@dataclass
class Targets:
    """What the faults act on, read off the server's log as it started."""

    url: str
    vocab_size: int
    replica_groups: list[int]  # process groups of the engines, in replica order
    master_group: Optional[int]
    restart_master: Callable[[], str]  # starts a master on the same ports; returns what it did


def _kill(group: int) -> str:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        return f"process group {group} already gone"
    return f"SIGKILL to process group {group}"


def inject(targets: Targets, kind: str, record: FaultRecord, stop: threading.Event, run_s: float) -> None:
    if kind == BAD_INPUT:
        send_bad_input(targets.url, targets.vocab_size, record)
    elif kind == SLOW_CLIENTS:
        hold_slow_clients(targets.url, record, stop, min(SLOW_HOLD_S, 0.1 * run_s))
    elif kind == MASTER_STOP:
        if targets.master_group is None:
            record.ok, record.detail = False, "no Mooncake master to stop"
            return
        record.detail = _kill(targets.master_group)
    elif kind == MASTER_RESTART:
        record.detail = targets.restart_master()
    elif kind == REPLICA_KILL:
        record.detail = f"engine {len(targets.replica_groups)}: {_kill(targets.replica_groups[-1])}"


def run_timeline(targets: Targets, minutes: float, started: float, stop: threading.Event,
                 records: list[FaultRecord]) -> None:
    """Inject TIMELINE's faults at their share of the run, each in its own thread."""
    threads = []
    for share, kind in TIMELINE:
        at = share * minutes * 60.0
        if stop.wait(max(0.0, at - (time.perf_counter() - started))):
            break
        record = FaultRecord(kind, time.perf_counter() - started)
        records.append(record)
        thread = threading.Thread(target=inject, args=(targets, kind, record, stop, minutes * 60.0),
                                  name=f"fault-{kind}", daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
