"""picrag's frontend app served by uvicorn in a thread of the test process, in front of a runtime."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frontend(runtime_url: str, **options) -> Iterator[str]:
    """`create_app(runtime_url, **options)` on a free port; yields its URL."""
    import uvicorn

    from rag_server.api.app import create_app
    from rag_server.launch.runtime import free_port

    port = free_port()
    # lifespan "on": a failed start-up must fail the test, not leave a frontend without its state.
    server = uvicorn.Server(uvicorn.Config(create_app(runtime_url, **options), host="127.0.0.1",
                                           port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not server.started:
        assert thread.is_alive(), "the in-process frontend failed to start"
        assert time.monotonic() < deadline, "the in-process frontend did not start in 300 s"
        time.sleep(0.2)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)
