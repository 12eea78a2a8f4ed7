"""The guards of `start_picrag_serve`: a bench must never measure a server it did not start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from rag_server.bench.common import BenchError, server
from rag_server.launch.ports import free_port
from rag_server.launch.serve_process import ServeStartError, port_in_use, start_picrag_serve


def test_a_taken_port_is_refused_before_anything_starts(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert port_in_use(port)
        with pytest.raises(ServeStartError, match=f"port {port} is already in use"):
            start_picrag_serve(port, [], tmp_path / "serve.log")
        with pytest.raises(BenchError, match="already in use"), server(None, None, port, tmp_path / "bench.log"):
            pass
    assert not (tmp_path / "serve.log").exists()  # nothing was started
    assert not port_in_use(port)


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_child_is_stopped_when_its_parent_is_killed():
    # A parent that starts a long-lived child with the same guard, then is killed by SIGKILL.
    script = textwrap.dedent("""
        import subprocess, sys
        from rag_server.launch.serve_process import stop_with_parent
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 preexec_fn=stop_with_parent())
        print(child.pid, flush=True)
        child.wait()
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    assert not _gone(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not _gone(child):
        time.sleep(0.1)
    assert _gone(child)


def test_a_start_that_hangs_has_every_process_write_where_it_stands(tmp_path):
    """A `picrag serve` whose /health never answers: before it is killed, it and the process it
    started write their threads' stacks to the log (the suite's diagnosis of a hung start)."""
    from tests.conftest import write_stacks_of_tree

    script = textwrap.dedent("""
        import os, time
        def runtime_waits_forever():
            time.sleep(600)
        def server_waits_forever():
            time.sleep(600)
        if os.fork() == 0:
            runtime_waits_forever()
        print("both started", flush=True)
        server_waits_forever()
    """)
    log = tmp_path / "serve.log"

    def start(command, out):
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
        process = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT, env=env)
        while "both started" not in log.read_text():
            assert process.poll() is None, log.read_text()
            time.sleep(0.05)
        return process

    with pytest.raises(ServeStartError, match="not healthy after 1 s") as failure:
        start_picrag_serve(free_port(), [], log, timeout_s=1, start=start, on_timeout=write_stacks_of_tree)
    for where in ("runtime_waits_forever", "server_waits_forever"):
        assert where in str(failure.value)
