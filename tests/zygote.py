"""`picrag serve` and SGLang runtimes forked, for the tests that start servers of their own: from
one process per test worker that has imported picrag's frontend and SGLang once.

A `picrag serve` started with `python -m rag_server.cli serve` spends about 50 s of CPU before it
answers /health on these cores (2026-12-07, py-spy): 17 s in the frontend (transformers and torch,
its own modules), 21 s in the runtime's server process (SGLang, transformers and torch again), 10 s
in the scheduler (the model, the start-up self-check's forwards). The suite starts about twenty,
and is bound by its CPU. The zygote here imports the frontend and SGLang once and loads SGLang's
plugins, computes nothing (an OpenMP thread pool does not survive a fork), and forks:

- for each server, a child that runs `rag_server.cli.main(ARGS)`: the same code, arguments and
  environment. In that child the runtime's server process, which `picrag serve` starts with
  `subprocess.Popen([python, -m, sglang_patches.cpu.launch, ...])`, is forked too, with what that
  command runs (`sglang_patches.cpu.launch.run`), its process group, output file and
  environment: still a child of `picrag serve`, stopped, watched and reaped as the spawned one
  is. A runtime the fork cannot stand for (CUDA; stock SGLang, whose plugins must not load;
  another thread count or SGLang setting than the zygote imported with), or started while
  `picrag serve` runs another thread, is spawned as usual.
- for a test that drives a runtime alone (the model matrix, one tiny model per decoder family),
  that runtime's server, as `python -m sglang_patches.cpu.launch` runs it with
  `RuntimeConfig.command()`'s arguments and `RuntimeConfig.env()`'s environment.

The start itself, spawned, is tested by tests/test_serve_process.py and by every module that runs
`picrag serve` as a command.

Run as `python -m tests.zygote`: one JSON command per line on stdin, one JSON line back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import httpx

from rag_server.launch.runtime import CPU_LAUNCH_MODULE, NO_PLUGIN, RuntimeConfig

READY = "ready"
CLI_MODULE = "rag_server.cli"
RUNTIME_START_TIMEOUT_S = 300.0


def zygote_env() -> dict[str, str]:
    """The environment the zygote imports with: the worker's, with what a CPU runtime's server
    reads at import (RuntimeConfig.env())."""
    return RuntimeConfig(Path("."), device="cpu").resolved().env()


class Zygote:
    """The zygote process, seen from a test worker."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        with open(log_dir / "zygote.log", "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.zygote"], env=zygote_env(), cwd=Path(__file__).resolve().parents[1],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        assert self._read() == READY
        self.runtimes: set[int] = set()

    def spawn(self, command: list[str], log) -> "ForkedServe":
        """For rag_server.launch.serve_process.start_picrag_serve: `command` is
        `[python, -m, rag_server.cli, ARGS...]`, run with this process's environment and
        directory, its output to the open file `log`."""
        assert command[1:3] == ["-m", CLI_MODULE], command
        reply = self._ask({"serve": command[3:], "env": dict(os.environ), "cwd": os.getcwd(), "log": log.name})
        return ForkedServe(self, reply["pid"])

    def start_runtime(self, config: RuntimeConfig, name: str) -> "ForkedRuntime":
        """A runtime for `config`, forked and healthy; its log is `<log_dir>/<name>.log`."""
        config = config.resolved()
        assert config.device == "cpu", "forked runtimes run on CPU only (CUDA does not survive a fork)"
        log = self.log_dir / f"{name}.log"
        pid = self._ask({"runtime": config.command(), "env": config.env(), "log": str(log)})["pid"]
        self.runtimes.add(pid)
        runtime = ForkedRuntime(self, pid, config.url, log)
        try:
            runtime.wait_healthy()
        except BaseException:
            runtime.stop()
            raise
        return runtime

    def poll(self, pid: int) -> int | None:
        return self._ask({"poll": pid})["returncode"]

    def stop(self, pid: int) -> None:
        """A forked runtime's whole process group killed and reaped."""
        self._ask({"stop": pid})
        self.runtimes.discard(pid)

    def close(self) -> None:
        """Runtimes still running stopped, then the zygote (its `picrag serve` children get
        SIGTERM, their death signal)."""
        for pid in list(self.runtimes):
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
        return json.loads(self._read())

    def _read(self) -> str:
        line = self.process.stdout.readline()
        assert line, f"the zygote exited; see {self.log_dir / 'zygote.log'}"
        return line.strip()


class ForkedServe:
    """What a test holds of a forked `picrag serve`: the subprocess.Popen calls tests make."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.poll(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"picrag serve (pid {self.pid})", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedRuntime:
    """A runtime forked for a test: its URL, its log, and how to stop it."""

    def __init__(self, zygote: Zygote, pid: int, url: str, log: Path):
        self.zygote, self.pid, self.url, self.log = zygote, pid, url, log

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + RUNTIME_START_TIMEOUT_S
        while not self._healthy():
            assert self.zygote.poll(self.pid) is None, f"the forked runtime exited during start:\n{self._log_tail()}"
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


# The zygote's side.

# What a runtime's three processes import: the server's entry point (run_server), its HTTP
# server, scheduler and detokenizer, and every model class (the registry imports them all).
SGLANG_MODULES = ("sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
                  "sglang.srt.managers.detokenizer_manager", "sglang.srt.models.registry")

# What `picrag serve`'s frontend imports.
FRONTEND_MODULES = ("rag_server.cli", "rag_server.api.app", "rag_server.launch.selfcheck", "retrieval.index",
                    "uvicorn", "sentence_transformers", "transformers.models.auto.tokenization_auto")
# Modules whose state depends on the environment at their import, which a forked runtime must
# import again: prometheus_client picks in-process or multiprocess counters when imported, and
# SGLang's server sets PROMETHEUS_MULTIPROC_DIR only as it starts (the frontend imported it before).
REIMPORTED = ("prometheus_client",)


def _import_everything() -> None:
    """SGLang and the frontend imported and SGLang's plugins loaded: the forked processes find
    `load_plugins`' guard set and keep the hooks registered here."""
    import importlib

    for module in (*SGLANG_MODULES, *FRONTEND_MODULES):
        importlib.import_module(module)
    from sglang.srt.plugins import load_plugins

    load_plugins()


def _forkable(command: list[str], env: dict[str, str] | None) -> bool:
    """Whether a runtime started with `command` and `env` can be forked from this process: the
    plugin-loading CPU launcher, with every setting read at import as this process read it."""
    if command[1:3] != ["-m", CPU_LAUNCH_MODULE] or env is None or env.get("SGLANG_PLUGINS") == NO_PLUGIN:
        return False
    read_at_import = [name for name in {*env, *ZYGOTE_ENV} if name.startswith(("SGLANG_", "OMP_", "TORCH_", "MKL_"))]
    return all(env.get(name) == ZYGOTE_ENV.get(name) for name in read_at_import)


def _forks_here(command: list[str], env: dict[str, str] | None) -> bool:
    """Whether ForkingPopen forks `command` now rather than spawning it: a forkable command, in a
    process that runs no other thread. A thread that holds a lock at the fork (an import, a log
    stream, a library's one-time set-up) leaves it held in the child, with no thread there to
    release it (a replica forked beside another replica's start once never came up). picrag serve
    starts its runtimes before any thread of its own (rag_server/cli.py), so those starts fork."""
    return threading.active_count() == 1 and _forkable(command, env)


class ForkingPopen(subprocess.Popen):
    """subprocess.Popen in a forked `picrag serve`: the runtime's server command forked (the child
    runs what the command runs, with the standard streams, directory, environment and session
    Popen would give it), any other command spawned. The forked child keeps the other descriptors
    of `picrag serve` (a spawned one has them closed): closing them under live Python objects
    would let their later collection close reused numbers."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        if not _forks_here(list(args), env):
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, *rest)
        start_new_session = rest[-2]  # rest: restore_signals, gid, gids, uid, umask, start_new_session, process_group
        pid = os.fork()
        if pid == 0:
            _run_launcher(list(args), env, cwd, start_new_session, (p2cread, c2pwrite, errwrite))
        self.pid = pid
        self._child_created = True
        # The child's ends of pipes Popen made, closed here as Popen closes them (a caller's file is the caller's).
        if p2cread != -1 and p2cwrite != -1 and p2cread != getattr(self, "_dev_null", None):
            os.close(p2cread)
        if c2pwrite != -1 and c2pread != -1:
            os.close(c2pwrite)
        if errwrite != -1 and errread != -1:
            os.close(errwrite)


def _exit_after(run: Callable[[], int | None]) -> None:
    """In a forked child: `run()`, then the process ends with its exit code; it never returns
    into the code that forked it."""
    code = 0
    try:
        code = run() or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_launcher(args: list[str], env, cwd, start_new_session: bool, streams: tuple[int, int, int]) -> None:
    """In the forked child: `python -m sglang_patches.cpu.launch ARGS` after its imports."""
    _exit_after(lambda: _launch(args, env, cwd, start_new_session, streams))


def _launch(args: list[str], env, cwd, start_new_session: bool, streams: tuple[int, int, int]) -> None:
    if start_new_session:
        os.setsid()
    for target, fd in enumerate(streams):
        if fd != -1:  # -1: inherited, as Popen leaves it
            os.dup2(fd, target)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for name in [m for m in sys.modules if m.split(".")[0] in REIMPORTED]:
        del sys.modules[name]
    import setproctitle

    # Its command line as the spawned server shows it (rag_server.launch.runtime.runtime_url_under reads it).
    setproctitle.setproctitle(" ".join(args))
    from sglang.srt.utils import kill_process_tree

    from sglang_patches.cpu import launch as cpu_launch

    try:
        cpu_launch.run(args[3:])
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def _run_runtime(args: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: a runtime's server (`args`: `RuntimeConfig.command()`) in a process
    group of its own, reading nothing, writing to `log`."""
    nothing = os.open(os.devnull, os.O_RDONLY)  # the zygote's command pipe is not the runtime's
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _run_launcher(args, env, None, True, (nothing, out, out))


def _stop(pid: int, reaped: bool) -> None:
    """A forked runtime's whole process group killed and its server reaped (unless a poll has
    already). Not SIGTERM: SGLang's shutdown then waits 5 s for crash diagnostics, and a test
    has nothing to drain."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if not reaped:
        os.waitpid(pid, 0)


def _run_serve(argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In the forked child: `python -m rag_server.cli ARGV`, stopped (SIGTERM) when the zygote dies."""
    _exit_after(lambda: _serve_cli(argv, env, cwd, log))


def _serve_cli(argv: list[str], env: dict[str, str], cwd: str, log: str) -> int:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    with open(os.devnull, "rb") as nothing:
        os.dup2(nothing.fileno(), 0)  # the zygote's command pipe is not the server's
    with open(log, "ab") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    subprocess.Popen = ForkingPopen
    import logging

    # SGLang's imports configured the zygote's logging; picrag serve configures its own
    # (basicConfig, a no-op where the root logger has handlers).
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    sys.argv = [CLI_MODULE, *argv]
    import setproctitle

    setproctitle.setproctitle(" ".join([sys.executable, "-m", CLI_MODULE, *argv]))
    from rag_server.cli import main

    return main(argv)


def _poll(pid: int) -> int | None:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done == 0:
        return None
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


ZYGOTE_ENV = dict(os.environ)


def _serve() -> None:
    import setproctitle

    # setproctitle finds the memory it rewrites on its first call, while this process's
    # environment is the one it started with (a child replaces its environment before it names itself).
    setproctitle.setproctitle(f"{sys.executable} -m tests.zygote")
    _import_everything()
    answer = sys.stdout
    answer.write(READY + "\n")
    answer.flush()
    exited: dict[int, int] = {}
    for line in sys.stdin:
        command = json.loads(line)
        if "serve" in command or "runtime" in command:
            pid = os.fork()
            if pid == 0 and "serve" in command:
                _run_serve(command["serve"], command["env"], command["cwd"], command["log"])
            if pid == 0:
                _run_runtime(command["runtime"], command["env"], command["log"])
            reply = {"pid": pid}
        elif "stop" in command:
            _stop(command["stop"], command["stop"] in exited)
            reply = {"stopped": command["stop"]}
        else:
            pid = command["poll"]
            if pid not in exited and (code := _poll(pid)) is not None:
                exited[pid] = code
            reply = {"returncode": exited.get(pid)}
        answer.write(json.dumps(reply) + "\n")
        answer.flush()


if __name__ == "__main__":
    _serve()
