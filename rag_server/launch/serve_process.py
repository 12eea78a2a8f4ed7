"""`picrag serve` as a child process, for tests, benchmarks and examples that need a live server."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx


class ServeStartError(RuntimeError):
    pass


def start_picrag_serve(port: int, extra_args: list[str], log: Path, timeout_s: float = 600) -> subprocess.Popen:
    """Start `picrag serve` on `port`, its output and the runtime's in `log`; wait for /health."""
    cmd = [sys.executable, "-m", "rag_server.cli", "serve", "--port", str(port),
           "--runtime-log", str(log), *extra_args]
    with open(log, "ab") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise ServeStartError(f"picrag serve exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise ServeStartError(f"picrag serve not healthy after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(1)
