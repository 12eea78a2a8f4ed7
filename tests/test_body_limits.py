"""Request bodies are bounded on every route, announced or chunked; chat requests by message
count and length; and tokenizing or templating a large input leaves the event loop free. The
runtime is a fake (tests/fake_runtime.py) that counts the calls reaching it."""

from __future__ import annotations

import json
import select
import socket
import threading
from urllib.parse import urlsplit

import httpx
import pytest

from rag_server.api.body_limit import DEFAULT_MAX_BODY_BYTES
from rag_server.api.message_limits import MAX_MESSAGE_CHARS, MAX_MESSAGES
from tests.fake_runtime import fake_runtime
from tests.inprocess_frontend import frontend

LIMIT = 1 << 20
CHUNK = 64 << 10
OFFERED = 256 << 20  # what the client would send if nobody stopped it


def send_chunked_until_answered(url: str, path: str) -> tuple[bytes, int]:
    """POST `OFFERED` bytes of chunked body to `path`, stopping when the server answers or stops
    reading; (the answer's head, body bytes sent)."""
    address = urlsplit(url)
    sock = socket.create_connection((address.hostname, address.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: picrag\r\nContent-Type: application/json\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    sock.setblocking(False)
    frame = f"{CHUNK:x}\r\n".encode() + b" " * CHUNK + b"\r\n"
    sent = 0
    answer = b""
    try:
        while sent < OFFERED:
            readable, writable, _ = select.select([sock], [sock], [], 30)
            if readable or not writable:
                break
            try:
                sock.sendall(frame)  # non-blocking: may raise once the buffers are full
                sent += CHUNK
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.setblocking(True)
        sock.settimeout(30)
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    finally:
        sock.close()
    return answer.split(b"\r\n\r\n")[0], sent


def send_chunked_regardless(url: str, path: str) -> int:
    """POST `OFFERED` bytes of chunked body to `path` without looking at the answer (as most
    HTTP clients do); the body bytes sent before the server cut the connection."""
    address = urlsplit(url)
    sock = socket.create_connection((address.hostname, address.port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: picrag\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    frame = f"{CHUNK:x}\r\n".encode() + b" " * CHUNK + b"\r\n"
    sent = 0
    try:
        while sent < OFFERED:
            sock.sendall(frame)
            sent += CHUNK
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        sock.close()
    return sent


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions", "/rag/query"])
def test_oversized_chunked_body_is_refused_unread(default_model_dir, path):
    with fake_runtime(default_model_dir) as (fake, runtime_url), frontend(runtime_url, max_body_bytes=LIMIT) as url:
        head, sent = send_chunked_until_answered(url, path)
        sent_regardless = send_chunked_regardless(url, path)
    assert head.startswith(b"HTTP/1.1 413"), head
    # The limit, and what the sockets' buffers took in before the server stopped reading.
    assert sent < 32 << 20, sent
    assert sent_regardless < 32 << 20, sent_regardless  # the server closed the connection
    assert not any(fake.calls[p] for p in ("/generate", "/v1/completions", "/v1/chat/completions"))


def test_chunked_body_within_the_limit_is_relayed_whole(default_model_dir):
    body = json.dumps({"prompt": "x" * (LIMIT - 100)}).encode()

    def pieces():
        for start in range(0, len(body), 4096):
            yield body[start:start + 4096]

    with fake_runtime(default_model_dir) as (fake, runtime_url), frontend(runtime_url, max_body_bytes=LIMIT) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        response = client.post("/v1/completions", content=pieces(), headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    assert fake.bodies["/v1/completions"] == body


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions", "/flush_cache"])
def test_announced_oversized_body_is_refused(default_model_dir, path):
    with fake_runtime(default_model_dir) as (fake, runtime_url), frontend(runtime_url, max_body_bytes=LIMIT) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        response = client.post(path, content=b" " * (LIMIT + 1))
        at_limit = client.post(path, content=b" " * LIMIT)
    assert response.status_code == 413 and f"{LIMIT} bytes" in response.text
    assert at_limit.status_code != 413
    assert fake.calls[path] <= 1  # only the one at the limit went on


def test_rag_routes_keep_their_lower_limit(default_model_dir):
    from rag_server.api.rag_api import MAX_BODY_BYTES

    with fake_runtime(default_model_dir) as (_fake, runtime_url), frontend(runtime_url) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        response = client.post("/rag/query", content=b" " * (MAX_BODY_BYTES + 1))
    assert MAX_BODY_BYTES < DEFAULT_MAX_BODY_BYTES
    assert response.status_code == 413


def messages(count: int, chars: int = 10) -> list[dict]:
    return [{"role": "user", "content": "x" * chars} for _ in range(count)]


@pytest.mark.parametrize("extension", [None, {"documents": [{"text": "The Eiffel Tower is in Paris."}]}])
@pytest.mark.parametrize(("chat", "what"), [
    (messages(MAX_MESSAGES + 1), "messages"),
    (messages(1, MAX_MESSAGE_CHARS + 1), "characters"),
    ([{"role": "user", "content": [{"type": "text", "text": "x" * (MAX_MESSAGE_CHARS + 1)}]}], "characters"),
])
def test_chat_message_count_and_length(default_model_dir, extension, chat, what):
    body = {"model": "fake", "messages": chat, "max_tokens": 2}
    if extension is not None:
        body["picrag"] = extension
    with fake_runtime(default_model_dir) as (fake, runtime_url), frontend(runtime_url) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert what in response.json()["error"]["message"]
    assert fake.calls["/v1/chat/completions"] == 0 and fake.calls["/generate"] == 0


def test_serve_flag_for_body_limit():
    from rag_server.cli import build_parser

    assert build_parser().parse_args(["serve", "--max-body-bytes", "2M"]).max_body_bytes == 2 << 20
    assert build_parser().parse_args(["serve"]).max_body_bytes == DEFAULT_MAX_BODY_BYTES


SENTINEL = "tokenize-me-slowly"


@pytest.mark.parametrize("route", ["rag", "chat_history", "chunk_markers"])
def test_event_loop_stays_free_while_a_large_input_is_tokenized(default_model_dir, monkeypatch, route):
    """Tokenizing is held until /health has answered: on the event loop, /health could not
    answer, and the test would fail on its timeout. (A chat's system prompt is templated and
    then tokenized in one step, so holding the tokenization holds the templating's thread.)"""
    from rag_server.api.chunk_markers import mark_chunk
    from retrieval.prompt_layout import PromptLayout

    entered, release = threading.Event(), threading.Event()

    def held(function):
        def wrapper(self, arg, *args, **kwargs):
            if SENTINEL in json.dumps(arg):
                entered.set()
                assert release.wait(60), "never released"
            return function(self, arg, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(PromptLayout, "encode", held(PromptLayout.encode))
    document = {"title": "t", "text": f"The Eiffel Tower is in Paris. {SENTINEL}"}
    requests = {
        "rag": ("/rag/query", {"question": "Where?", "max_tokens": 2, "documents": [document]}),
        "chat_history": ("/v1/chat/completions", {
            "messages": [{"role": "system", "content": f"Be brief. {SENTINEL}"}, {"role": "user", "content": "Where?"}],
            "max_tokens": 2, "picrag": {"documents": [document]}}),
        "chunk_markers": ("/generate", {"text": "Context: " + mark_chunk(f"Paris. {SENTINEL}") + " Where?",
                                        "sampling_params": {"max_new_tokens": 2}}),
    }
    path, body = requests[route]
    answers: list[httpx.Response] = []
    with fake_runtime(default_model_dir) as (_fake, runtime_url), frontend(runtime_url) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        worker = threading.Thread(target=lambda: answers.append(client.post(path, json=body)))
        worker.start()
        try:
            assert entered.wait(60), "the input was never tokenized"
            health = client.get("/health", timeout=10)
        finally:
            release.set()
            worker.join(60)
    assert health.status_code == 200
    assert len(answers) == 1  # and the held request ended
