"""`picrag serve` forked, for the tests that start servers of their own: from one process per test
worker that has imported picrag's frontend and SGLang once.

A `picrag serve` started with `python -m rag_server.cli serve` spends about 50 s of CPU before it
answers /health on these cores (2026-12-07, py-spy): 17 s in the frontend (transformers and torch,
its own modules), 21 s in the runtime's server process (SGLang, transformers and torch again), 10 s
in the scheduler (the model, the start-up self-check's forwards). The suite starts about twenty,
and is bound by its CPU. The zygote here imports the frontend and SGLang once and loads SGLang's
plugins, computes nothing (an OpenMP thread pool does not survive a fork), and forks for each
server a child that runs `rag_server.cli.main(ARGS)`: the same code, arguments and environment.
In that child the runtime's server process, which `picrag serve` starts with
`subprocess.Popen([python, -m, sglang_patches.cpu.launch, ...])`, is forked too, with what that
command runs (`sglang_patches.cpu.launch.run`), its process group, output file and environment:
still a child of `picrag serve`, stopped, watched and reaped as the spawned one is. A runtime the
fork cannot stand for (CUDA; stock SGLang, whose plugins must not load; another thread count or
SGLang setting than the zygote imported with) is spawned as usual. The start itself, spawned, is
tested by tests/test_serve_process.py and by every module that runs `picrag serve` as a command.

Run as `python -m tests.serve_zygote`: one JSON command per line on stdin, one JSON line back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from rag_server.launch.runtime import CPU_LAUNCH_MODULE, NO_PLUGIN, RuntimeConfig

READY = "ready"
CLI_MODULE = "rag_server.cli"


def zygote_env() -> dict[str, str]:
    """The environment the zygote imports with: the worker's, with what a CPU runtime's server
    reads at import (RuntimeConfig.env())."""
    return RuntimeConfig(Path("."), device="cpu").resolved().env()


class ServeZygote:
    """The zygote process, seen from a test worker."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        with open(log_dir / "serve-zygote.log", "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.serve_zygote"], env=zygote_env(), cwd=Path(__file__).resolve().parents[1],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        assert self._read() == READY

    def spawn(self, command: list[str], log) -> "ForkedServe":
        """For rag_server.launch.serve_process.start_picrag_serve: `command` is
        `[python, -m, rag_server.cli, ARGS...]`, run with this process's environment and
        directory, its output to the open file `log`."""
        assert command[1:3] == ["-m", CLI_MODULE], command
        reply = self._ask({"serve": command[3:], "env": dict(os.environ), "cwd": os.getcwd(), "log": log.name})
        return ForkedServe(self, reply["pid"])

    def poll(self, pid: int) -> int | None:
        return self._ask({"poll": pid})["returncode"]

    def close(self) -> None:
        self.process.stdin.close()  # the zygote exits; its children get SIGTERM (their death signal)
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
        assert line, f"the serve zygote exited; see {self.log_dir / 'serve-zygote.log'}"
        return line.strip()


class ForkedServe:
    """What a test holds of a forked `picrag serve`: the subprocess.Popen calls tests make."""

    def __init__(self, zygote: ServeZygote, pid: int):
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


# The zygote's side.

# What `picrag serve`'s frontend imports (its runtime's: tests.forked_runtime.SGLANG_MODULES).
FRONTEND_MODULES = ("rag_server.cli", "rag_server.api.app", "rag_server.launch.selfcheck", "retrieval.index",
                    "uvicorn", "sentence_transformers", "transformers.models.auto.tokenization_auto")
# Modules whose state depends on the environment at their import, which a forked runtime must
# import again: prometheus_client picks in-process or multiprocess counters when imported, and
# SGLang's server sets PROMETHEUS_MULTIPROC_DIR only as it starts (the frontend imported it before).
REIMPORTED = ("prometheus_client",)


def _import_everything() -> None:
    import importlib

    from tests.forked_runtime import import_sglang

    import_sglang()
    for module in FRONTEND_MODULES:
        importlib.import_module(module)


def _forkable(command: list[str], env: dict[str, str] | None) -> bool:
    """Whether a runtime started with `command` and `env` can be forked from this process: the
    plugin-loading CPU launcher, with every setting read at import as this process read it."""
    if command[1:3] != ["-m", CPU_LAUNCH_MODULE] or env is None or env.get("SGLANG_PLUGINS") == NO_PLUGIN:
        return False
    read_at_import = [name for name in {*env, *ZYGOTE_ENV} if name.startswith(("SGLANG_", "OMP_", "TORCH_", "MKL_"))]
    return all(env.get(name) == ZYGOTE_ENV.get(name) for name in read_at_import)


class ForkingPopen(subprocess.Popen):
    """subprocess.Popen in a forked `picrag serve`: the runtime's server command forked (the child
    runs what the command runs, with the standard streams, directory, environment and session
    Popen would give it), any other command spawned. The forked child keeps the other descriptors
    of `picrag serve` (a spawned one has them closed): closing them under live Python objects
    would let their later collection close reused numbers."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        if not _forkable(list(args), env):
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
    setproctitle.setproctitle(f"{sys.executable} -m tests.serve_zygote")
    _import_everything()
    answer = sys.stdout
    answer.write(READY + "\n")
    answer.flush()
    exited: dict[int, int] = {}
    for line in sys.stdin:
        command = json.loads(line)
        if "serve" in command:
            pid = os.fork()
            if pid == 0:
                _run_serve(command["serve"], command["env"], command["cwd"], command["log"])
            reply = {"pid": pid}
        else:
            pid = command["poll"]
            if pid not in exited and (code := _poll(pid)) is not None:
                exited[pid] = code
            reply = {"returncode": exited.get(pid)}
        answer.write(json.dumps(reply) + "\n")
        answer.flush()


if __name__ == "__main__":
    _serve()
