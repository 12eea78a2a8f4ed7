"""Start and stop SGLang's own HTTP server as the runtime behind the picrag frontend.

The runtime is SGLang's `launch_server` in a child process group on a loopback port; the
frontend proxies SGLang's native routes to it and adds its own. On a machine without CUDA the
runtime runs SGLang's CPU engine (torch_native attention, fp32); with CUDA it uses FlashInfer.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from rag_server.launch.ports import free_port
from rag_server.launch.process_group import died_during_start, start_in_own_group, stop_process_group
from picrag_core.attention_backends import FLASHINFER_BACKEND, NATIVE_BACKEND
from picrag_core.chunk_store_spec import HOST_BYTES_ENV, MAX_BYTES_ENV, TIMEOUT_ENV, ChunkStoreSpec, store_env

logger = logging.getLogger(__name__)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def runtime_env(base: dict[str, str] | None = None, threads: int | None = None) -> dict[str, str]:
    """Environment for any process that runs torch on these small shared CPUs.

    OpenMP's default spin-waiting made torch 4-16x slower on 2 shared cores,
    so PASSIVE must be in the environment before torch is imported.
    """
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


CPU_ATTENTION_BACKEND = NATIVE_BACKEND
CUDA_ATTENTION_BACKEND = FLASHINFER_BACKEND
NO_PLUGIN = "-"
# How a runtime's server process is started: SGLang's own entry point, or on CPU the same with
# its workers forked rather than spawned (sglang_patches.cpu.launch: about 12 s less per start).
LAUNCH_MODULE = "sglang.launch_server"
CPU_LAUNCH_MODULE = "sglang_patches.cpu.launch"


@dataclass
class RuntimeConfig:
    model_path: Path
    port: int = 0
    host: str = "127.0.0.1"
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    radix_cache_backend: str | None = "pic"
    max_total_tokens: int | None = 16384
    context_length: int | None = None
    threads: int | None = None
    log_level: str = "warning"
    chunk_store: ChunkStoreSpec | None = None  # a directory (file store) or a Mooncake store
    chunk_store_max_bytes: int | None = None
    chunk_host_bytes: int | None = None  # the host-memory tier's bound (None: the engine's default)
    chunk_store_timeout_s: float | None = None  # per call into a remote store (None: the engine's default)
    repair_checkpoint: Path | None = None
    plugins: bool = True  # False: stock SGLang, no plugin loaded (the bench's `vanilla` baseline)
    extra_args: list[str] = field(default_factory=list)

    def resolved(self) -> RuntimeConfig:
        on_cuda = cuda_available() if self.device == "auto" else self.device == "cuda"
        device = "cuda" if on_cuda else "cpu"
        return RuntimeConfig(
            model_path=self.model_path,
            port=self.port or free_port(),
            host=self.host,
            device=device,
            # bf16 matmuls ran 3-6x slower than fp32 on AVX2 CPUs without AVX-512/AMX
            dtype=self.dtype if self.dtype != "auto" else ("auto" if on_cuda else "float32"),
            attention_backend=(
                self.attention_backend
                if self.attention_backend != "auto"
                else (CUDA_ATTENTION_BACKEND if on_cuda else CPU_ATTENTION_BACKEND)
            ),
            radix_cache_backend=self.radix_cache_backend,
            max_total_tokens=self.max_total_tokens,
            context_length=self.context_length,
            threads=self.threads or (None if on_cuda else (os.cpu_count() or 1)),
            log_level=self.log_level,
            chunk_store=self.chunk_store,
            chunk_store_max_bytes=self.chunk_store_max_bytes,
            chunk_host_bytes=self.chunk_host_bytes,
            chunk_store_timeout_s=self.chunk_store_timeout_s,
            repair_checkpoint=self.repair_checkpoint,
            plugins=self.plugins,
            extra_args=list(self.extra_args),
        )

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", CPU_LAUNCH_MODULE if self.device == "cpu" else LAUNCH_MODULE,
            "--model-path", str(self.model_path),
            "--host", self.host, "--port", str(self.port),
            "--device", self.device,
            "--dtype", self.dtype,
            "--attention-backend", self.attention_backend,
            "--log-level", self.log_level,
            "--enable-metrics",
            "--enable-cache-report",
        ]
        if self.device == "cpu":
            # The idle scheduler otherwise busy-polls one of the two cores.
            cmd.append("--sleep-on-idle")
        if self.max_total_tokens:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.context_length:
            cmd += ["--context-length", str(self.context_length)]
        if self.radix_cache_backend:
            cmd += ["--radix-cache-backend", self.radix_cache_backend]
        if self.attention_backend == CUDA_ATTENTION_BACKEND:
            # picrag's forward hooks (true positions, CacheBlend's shrink) and the position-masked
            # extends do host-side work per batch, which a captured prefill graph would skip.
            cmd += ["--cuda-graph-backend-prefill", "disabled"]
        return cmd + self.extra_args

    def env(self) -> dict[str, str]:
        env = runtime_env(threads=self.threads)
        # The frontend probes /health at an interval (rag_server/api/health.py) and watches the
        # runtime's processes (SGLangRuntime.watch); a token generated per probe would show up
        # in the runtime's load and cache counters.
        env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
        if self.device == "cpu":
            # Without it SGLang imports vLLM's rotary kernel on CPU and dies.
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            # When a worker exits (a crash, or the stop's SIGTERM to the group) SGLang sleeps 5 s
            # before py-spy-dumping the *other* live schedulers and taking CUDA core dumps: a CPU
            # runtime has one scheduler and no CUDA, so there is nothing to take, and every stop
            # would wait the 5 s.
            env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
            env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
        if not self.plugins:
            # SGLang loads only the plugins this allowlist names; no plugin is named so.
            env["SGLANG_PLUGINS"] = NO_PLUGIN
        if self.chunk_store is not None:
            # Read by sglang_patches.plugin in the scheduler process; unset settings: the engine's defaults.
            env.update(store_env(self.chunk_store))
            for name, value in ((MAX_BYTES_ENV, self.chunk_store_max_bytes), (HOST_BYTES_ENV, self.chunk_host_bytes),
                                (TIMEOUT_ENV, self.chunk_store_timeout_s)):
                if value is not None:
                    env[name] = str(value)
        if self.repair_checkpoint is not None:
            # Read by sglang_patches.steps.kv_repair (REPAIR_CHECKPOINT_ENV) when the chunk cache starts.
            env["PICRAG_REPAIR_CHECKPOINT"] = str(self.repair_checkpoint)
        return env

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class RuntimeStartError(RuntimeError):
    pass


# SGLang names its long-lived worker processes so (setproctitle): sglang::scheduler, sglang::detokenizer.
_WORKER_TITLE = "sglang::"


class LaunchedThenWaited:
    """What starts engines in two steps: `launch` starts their processes and returns, `wait_ready`
    waits for them (picrag serve starts its own threads in between, rag_server/cli.py)."""

    def launch(self) -> None:
        raise NotImplementedError

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        raise NotImplementedError

    def start(self, timeout_s: float = 600.0) -> None:
        self.launch()
        self.wait_ready(timeout_s)


class SGLangRuntime(LaunchedThenWaited):
    """SGLang's server in its own process group, so stopping it leaves no children behind."""

    def __init__(self, config: RuntimeConfig, log_file: Path | None = None):
        self.config = config.resolved()
        self.log_file = log_file
        self.process: subprocess.Popen | None = None
        self._log_start = 0  # where this start's lines begin in the log (died_during_start)
        self._workers: list[tuple[psutil.Process, str]] = []  # SGLang's workers and titles, once up
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # a death is reported, or the runtime stopped on purpose

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def engine_urls(self) -> tuple[str, ...]:
        """The engines that serve requests: this one."""
        return (self.url,)

    def launch(self) -> None:
        """Start the runtime's server process and return (`wait_ready` waits for it)."""
        c = self.config
        logger.info(
            "Starting SGLang runtime: model=%s device=%s dtype=%s attention=%s radix-cache=%s "
            "max-total-tokens=%s chunk-store=%s url=%s",
            c.model_path, c.device, c.dtype, c.attention_backend,
            c.radix_cache_backend or "sglang-default", c.max_total_tokens, c.chunk_store or "off", c.url,
        )
        self.process, self._log_start = start_in_own_group(c.command(), self.log_file, env=c.env())

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait for the launched runtime's /health; RuntimeStartError (the runtime stopped) if it
        exits first or is not healthy within `timeout_s`."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeStartError(died_during_start(self.process, "SGLang runtime", self.log_file,
                                                          self._log_start))
            if self.healthy():
                self._workers = _workers_of(self.process.pid)
                logger.info("SGLang runtime ready in %.0f s (workers: %s)", time.monotonic() - started,
                            ", ".join(f"{title} {p.pid}" for p, title in self._workers) or "none found")
                return
            time.sleep(1.0)
        self.stop()
        raise RuntimeStartError(f"SGLang runtime not healthy after {timeout_s:.0f} s")

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def death(self) -> str | None:
        """Why the runtime is dead (its server process or one of its workers exited), or None."""
        if self.process is None:
            return None
        if self.process.poll() is not None:
            return f"its server process {self.process.pid} exited with code {self.process.returncode}"
        for worker, title in self._workers:
            if not _alive(worker):
                return f"its {title} process {worker.pid} exited"
        return None

    def watch(self, on_death: Callable[[str], None], interval_s: float = 1.0) -> threading.Thread:
        """Call `on_death(reason)` from a daemon thread once the started runtime dies, unless
        `stop` was called first."""

        def watching() -> None:
            while not self._stopping.wait(interval_s):
                reason = self.death()
                if reason is None:
                    continue
                with self._lock:
                    if self._stopping.is_set():
                        return
                    self._stopping.set()
                on_death(reason)
                return

        thread = threading.Thread(target=watching, name="sglang-runtime-watch", daemon=True)
        thread.start()
        return thread

    def stop(self, grace_s: float = 15.0) -> None:
        with self._lock:
            self._stopping.set()
        if self.process is None:
            return
        stop_process_group(self.process, "SGLang runtime", grace_s)


def runtime_url_under(pid: int) -> str | None:
    """The URL of an SGLang runtime that a process (`picrag serve`) started, from its server
    process's command line; None if it has none."""
    for child in psutil.Process(pid).children(recursive=True):
        try:
            command = child.cmdline()
            # Forked workers show their server's command line until they set their titles; the
            # server alone leads its process group (start_in_own_group).
            leader = os.getpgid(child.pid) == child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
        if leader and "-m" in command and command[command.index("-m") + 1] in (LAUNCH_MODULE, CPU_LAUNCH_MODULE):
            return f"http://127.0.0.1:{command[command.index('--port') + 1]}"
    return None


def _workers_of(pid: int) -> list[tuple[psutil.Process, str]]:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    titled = [(p, _title(p)) for p in children]
    return [(p, title) for p, title in titled if title.startswith(_WORKER_TITLE)]


def _title(process: psutil.Process) -> str:
    try:
        return " ".join(" ".join(process.cmdline()).split())  # setproctitle pads the title with spaces
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
