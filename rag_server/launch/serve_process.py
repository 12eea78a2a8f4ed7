"""`picrag serve` as a child process, for tests, benchmarks and examples that need a live server.

Two guards keep a caller from measuring a server it did not start: the port must be free before
the child starts (otherwise the old server would answer the health check while the new one dies
on the taken port), and on Linux the child is stopped when its parent dies, even by SIGKILL, so
an interrupted benchmark leaves no server holding the port.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Callable

import httpx


class ServeStartError(RuntimeError):
    pass


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def stop_with_parent() -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM, the server's own orderly stop, once its parent dies
    (or at once if the parent died before it ran). libc is looked up here, in the parent, so the
    forked child runs no loader code that another thread's lock could block.

    Linux sends the signal when the *thread* that forked the child ends, not the process: only
    a caller on a thread that lives as long as the child should (the main thread of a bench or
    test) may use it. That is why picrag serve's SGLang runtimes do not: with replicas each is
    started from a thread that ends once it is up."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def spawn(command: list[str], out: IO[bytes]) -> subprocess.Popen:
    """`command` as a child process writing to `out`, stopped when this thread's process dies."""
    guard = stop_with_parent() if sys.platform.startswith("linux") else None
    return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, preexec_fn=guard)


def start_picrag_serve(port: int, extra_args: list[str], log: Path, timeout_s: float = 600,
                       start: Callable[[list[str], IO[bytes]], subprocess.Popen] = spawn,
                       on_timeout: Callable[[subprocess.Popen], None] | None = None) -> subprocess.Popen:
    """Start `picrag serve` on `port`, its output and the runtime's in `log`; wait for /health.
    `start` runs the command (the test suite forks it from a process that imported it once,
    tests/zygote.py); `on_timeout` sees the process still running when /health never answered,
    before it is killed (the suite has every process of a hung start write its stacks)."""
    if port_in_use(port):
        raise ServeStartError(f"port {port} is already in use (another picrag serve?): stop it or choose another port")
    cmd = [sys.executable, "-m", "rag_server.cli", "serve", "--port", str(port),
           "--runtime-log", str(log), *extra_args]
    with open(log, "ab") as out:
        process = start(cmd, out)
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
            if on_timeout is not None:
                on_timeout(process)
            process.kill()
            raise ServeStartError(f"picrag serve not healthy after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.25)
