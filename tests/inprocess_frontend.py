"""ASGI apps served by uvicorn in a thread of the test process: picrag's frontend in front of a
runtime, or a fake runtime (tests/fake_runtime.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rag_server.api.admission import Admission


@contextmanager
def serving(app, graceful_shutdown_s: float | None = None) -> Iterator[str]:
    """`app` on a free loopback port; yields its URL. `graceful_shutdown_s`: how long requests
    still running at the end may take (None: as long as they need)."""
    import uvicorn

    from rag_server.launch.ports import free_port

    port = free_port()
    # lifespan "on": a failed start-up must fail the test, not leave an app without its state.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=graceful_shutdown_s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not server.started:
        assert thread.is_alive(), "the in-process server failed to start"
        assert time.monotonic() < deadline, "the in-process server did not start in 300 s"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Until `condition()` holds; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def admission_of(app) -> Admission:
    """The app's admission middleware (Starlette builds its middleware at the first request)."""
    from rag_server.api.admission import Admission

    layer = app.middleware_stack
    while not isinstance(layer, Admission):
        layer = layer.app
    return layer


@contextmanager
def frontend(runtime_url: str, **options) -> Iterator[str]:
    """`create_app(runtime_url, **options)` on a free port; yields its URL."""
    from rag_server.api.app import create_app

    with serving(create_app(runtime_url, **options)) as url:
        yield url
