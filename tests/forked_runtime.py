"""SGLang runtimes forked from one process that has imported SGLang once: for tests that start a
runtime per model (the model matrix, one tiny model per decoder family).

A runtime that `picrag serve` starts on CPU imports SGLang once, in its server process, and forks
its scheduler and detokenizer (sglang_patches.cpu.launch): about 17 s on two cores, most of it
that import. The zygote here imports SGLang's server, scheduler, detokenizer and model classes
once and loads the plugins, computes nothing (an OpenMP thread pool does not survive a fork), and
forks for each runtime a child that runs what `python -m sglang_patches.cpu.launch` runs, with
`RuntimeConfig.command()`'s arguments and `RuntimeConfig.env()`'s environment: the same SGLang
code, arguments and plugins, and no import per runtime (about 10 s a start).

Run as `python -m tests.forked_runtime`: it reads one JSON command per line on stdin and
answers one JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rag_server.launch.runtime import RuntimeConfig

READY = "ready"
START_TIMEOUT_S = 300.0


class RuntimeZygote:
    """The zygote process, seen from the test: starts and stops forked runtimes."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        # The environment every runtime is forked with, from the one place runtimes get theirs:
        # what SGLang reads at import (CPU engine, OpenMP policy) must be set before the zygote imports it.
        env = RuntimeConfig(Path("."), device="cpu").resolved().env()
        with open(log_dir / "zygote.log", "ab") as log:  # the zygote holds its own copy of the handle
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.forked_runtime"], env=env, cwd=Path(__file__).resolve().parents[1],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self._expect(READY)
        self.running: set[int] = set()

    def start(self, config: RuntimeConfig, name: str) -> ForkedRuntime:
        """A runtime for `config`, forked and healthy; its log is `<log_dir>/<name>.log`."""
        config = config.resolved()
        assert config.device == "cpu", "forked runtimes run on CPU only (CUDA does not survive a fork)"
        log = self.log_dir / f"{name}.log"
        # command() starts with `python -m <launch module>`; the child gets the arguments after.
        pid = self._ask({"start": config.command()[3:], "env": config.env(), "log": str(log)})["pid"]
        self.running.add(pid)
        runtime = ForkedRuntime(self, pid, config.url, log)
        try:
            runtime.wait_healthy()
        except BaseException:
            runtime.stop()
            raise
        return runtime

    def stop(self, pid: int) -> None:
        self._ask({"stop": pid})
        self.running.discard(pid)

    def close(self) -> None:
        """Every runtime still running stopped, then the zygote."""
        for pid in list(self.running):
            self.stop(pid)
        self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _ask(self, command: dict) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return json.loads(self._expect(None))

    def _expect(self, what: str | None) -> str:
        line = self.process.stdout.readline()
        assert line, f"the runtime zygote exited; see {self.log_dir / 'zygote.log'}"
        line = line.strip()
        assert what is None or line == what, line
        return line


class ForkedRuntime:
    def __init__(self, zygote: RuntimeZygote, pid: int, url: str, log: Path):
        self.zygote, self.pid, self.url, self.log = zygote, pid, url, log

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            assert _running(self.pid), f"the forked runtime exited during start:\n{self._log_tail()}"
            assert time.monotonic() < deadline, f"the forked runtime is not healthy:\n{self._log_tail()}"
            time.sleep(0.2)

    def stop(self) -> None:
        self.zygote.stop(self.pid)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# The zygote's side.

# What a runtime's three processes import: the server's entry point (run_server), its HTTP
# server, scheduler and detokenizer, and every model class (the registry imports them all).
SGLANG_MODULES = ("sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
                  "sglang.srt.managers.detokenizer_manager", "sglang.srt.models.registry")


def import_sglang() -> None:
    """SGLang imported and the plugins loaded: the forked processes find `load_plugins`' guard
    set and keep the hooks registered here."""
    import importlib

    for module in SGLANG_MODULES:
        importlib.import_module(module)
    from sglang.srt.plugins import load_plugins

    load_plugins()


def _run_runtime(argv: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: what `python -m sglang_patches.cpu.launch ARGV` runs after its imports."""
    from sglang.srt.utils import kill_process_tree

    from sglang_patches.cpu import launch as cpu_launch

    os.setsid()  # its own process group, stopped whole
    with open(os.devnull, "rb") as nothing:
        os.dup2(nothing.fileno(), 0)  # the zygote's command pipe is not the runtime's
    with open(log, "ab") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        cpu_launch.run(argv)
    except BaseException:  # the child must never return into the zygote's loop
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
        os._exit(code)


def _stop(pid: int) -> None:
    """The runtime's whole process group killed and its server reaped. Not SIGTERM: SGLang's
    shutdown then waits 5 s for crash diagnostics, and a test has nothing to drain."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def _serve() -> None:
    import_sglang()
    answer = sys.stdout
    answer.write(READY + "\n")
    answer.flush()
    for line in sys.stdin:
        command = json.loads(line)
        if "start" in command:
            pid = os.fork()
            if pid == 0:
                _run_runtime(command["start"], command["env"], command["log"])
            reply = {"pid": pid}
        else:
            _stop(command["stop"])
            reply = {"stopped": command["stop"]}
        answer.write(json.dumps(reply) + "\n")
        answer.flush()


if __name__ == "__main__":
    _serve()
