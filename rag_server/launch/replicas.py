"""Several engines behind SGLang's model gateway, started and stopped as one runtime.

`picrag serve --replicas N` starts N SGLang runtimes (each with picrag's plugin, as
rag_server/launch/runtime.py starts one, each in its own process group, one GPU each on CUDA,
an equal share of the cores on CPU) and the model gateway (rag_server/launch/gateway.py) in
front of them; the frontend talks to the gateway. `--worker-url` puts the gateway in front of
engines started elsewhere (`picrag serve --engines-only` on each GPU node), and `--runtime-url`
points the frontend at a gateway or engine that is already running.

The replicas share the chunk store `--chunk-store` names (a folder: on one machine a local one,
across machines a shared filesystem; or a Mooncake store, whose master `--start-mooncake-master`
starts on this machine: rag_server/launch/mooncake_master.py): a chunk compiled on one replica is
loaded, not recomputed, on another. A replica that dies is left to the gateway, which routes around it; the
server ends (for a supervisor to restart it) only when the gateway or every replica is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from rag_server.launch.gateway import Gateway, GatewayConfig
from rag_server.launch.ports import free_port
from rag_server.launch.runtime import LaunchedThenWaited, RuntimeConfig, SGLangRuntime

logger = logging.getLogger(__name__)


def replica_configs(config: RuntimeConfig, replicas: int) -> list[RuntimeConfig]:
    """Each replica's share of `config`: its own port (`config.port` + its index when one was
    given, else a free one outside the ephemeral range), its own GPU on CUDA, 1/`replicas` of the
    cores on CPU, and 1/`replicas` of the chunk store's size bound (each replica bounds the files
    it wrote or read, so together they keep the bound)."""
    resolved = config.resolved()
    threads = config.threads
    if resolved.device == "cpu" and threads is None:
        threads = max(1, (os.cpu_count() or 1) // replicas)
    max_bytes = config.chunk_store_max_bytes
    ports: list[int] = []
    for index in range(replicas):
        ports.append(config.port + index if config.port else free_port(taken=ports))
    gpu = (lambda index: ["--base-gpu-id", str(index)]) if resolved.device == "cuda" else (lambda index: [])
    return [dataclasses.replace(
        config,
        port=port,
        threads=threads,
        chunk_store_max_bytes=max_bytes // replicas if max_bytes is not None else None,
        extra_args=[*config.extra_args, *gpu(index)],
    ) for index, port in enumerate(ports)]


def _log_of(log_file: Path | None, name: str) -> Path | None:
    """`server.log` -> `server.<name>.log` beside it."""
    return None if log_file is None else log_file.with_name(f"{log_file.stem}.{name}{log_file.suffix}")


def _check_gpus(config: RuntimeConfig, replicas: int) -> None:
    if config.resolved().device != "cuda":
        return
    import torch

    if replicas > torch.cuda.device_count():
        raise ValueError(f"{replicas} replicas need {replicas} GPUs (one each); "
                                f"this machine has {torch.cuda.device_count()}")


class EngineGroup(LaunchedThenWaited):
    """`replicas` runtimes of `config`, no gateway: what `picrag serve --engines-only` runs on
    a GPU node for a gateway elsewhere."""

    def __init__(self, config: RuntimeConfig, replicas: int, log_file: Path | None = None):
        _check_gpus(config, replicas)
        self.runtimes = [SGLangRuntime(replica, log_file=_log_of(log_file, f"replica{i}"))
                         for i, replica in enumerate(replica_configs(config, replicas))]
        self._dead: dict[int, str] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    @property
    def config(self) -> RuntimeConfig:
        """What every replica runs (ports, GPUs and thread counts aside)."""
        return self.runtimes[0].config

    @property
    def urls(self) -> list[str]:
        return [runtime.url for runtime in self.runtimes]

    def launch(self) -> None:
        """Every replica's server process started, one after another in the calling thread."""
        for runtime in self.runtimes:
            runtime.launch()

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait for every launched replica at once; if one fails (or a signal ends the wait), stop
        them all and raise."""
        errors: list[BaseException] = []

        def waiting(runtime: SGLangRuntime) -> None:
            try:
                runtime.wait_ready(timeout_s)
            except BaseException as exc:
                errors.append(exc)
            if self._stopped.is_set():  # stopped while this one was starting
                runtime.stop()

        # Daemon threads: a signal during the start must not wait for the other replicas' starts.
        threads = [threading.Thread(target=waiting, args=(runtime,), name=f"replica{i}-start", daemon=True)
                   for i, runtime in enumerate(self.runtimes)]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                thread.join()
        except BaseException:
            self.stop()
            raise
        if errors:
            self.stop()
            raise errors[0]
        for i, runtime in enumerate(self.runtimes):
            # tests/test_replicas.py reads this line for the replicas' URLs and process groups.
            logger.info("replica %d ready at %s (process group %d)", i, runtime.url, runtime.process.pid)

    def watch(self, on_all_dead: Callable[[str], None]) -> None:
        """Log each replica's death and stop what is left of it (so that the gateway sees it
        gone); call `on_all_dead(reason)` once none is left."""
        for i, runtime in enumerate(self.runtimes):
            runtime.watch(lambda reason, i=i: self._replica_died(i, reason, on_all_dead))

    def _replica_died(self, index: int, reason: str, on_all_dead: Callable[[str], None]) -> None:
        runtime = self.runtimes[index]
        with self._lock:
            self._dead[index] = reason
            left = len(self.runtimes) - len(self._dead)
        logger.error("replica %d (%s) died (%s): %d of %d replicas left; the gateway routes around it",
                     index, runtime.url, reason, left, len(self.runtimes))
        runtime.stop(grace_s=2.0)
        if not left:
            on_all_dead(f"every replica died (replica {index}: {reason})")

    def stop(self, grace_s: float = 15.0) -> None:
        self._stopped.set()
        stops = [threading.Thread(target=runtime.stop, args=(grace_s,)) for runtime in self.runtimes]
        for thread in stops:
            thread.start()
        for thread in stops:
            thread.join()


class ReplicaSet(LaunchedThenWaited):
    """`replicas` runtimes of `config` behind the model gateway; `url` is the gateway's."""

    def __init__(self, config: RuntimeConfig, replicas: int, log_file: Path | None = None):
        if config.chunk_store is None:
            logger.warning("%d replicas without --chunk-store: a passage moved to another replica "
                           "is computed again there", replicas)
        self.engines = EngineGroup(config, replicas, log_file)
        gateway_port = free_port(taken=[runtime.config.port for runtime in self.engines.runtimes])
        self.gateway = Gateway(GatewayConfig(tuple(self.engines.urls), gateway_port),
                               log_file=_log_of(log_file, "gateway"))
        self._watching = threading.Event()

    @property
    def config(self) -> RuntimeConfig:
        return self.engines.config

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def engine_urls(self) -> tuple[str, ...]:
        """The engines behind the gateway."""
        return tuple(self.engines.urls)

    def launch(self) -> None:
        self.engines.launch()

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """The replicas healthy, then the gateway started in front of them."""
        self.engines.wait_ready(timeout_s)
        try:
            self.gateway.start()
        except BaseException:
            self.engines.stop()
            raise

    def watch(self, on_death: Callable[[str], None], interval_s: float = 1.0) -> None:
        """Call `on_death(reason)` once the gateway or every replica is gone, unless `stop` was
        called first; a replica that dies alone is logged and left to the gateway."""
        reported = threading.Lock()

        def died(reason: str) -> None:
            if not self._watching.is_set() and reported.acquire(blocking=False):
                on_death(reason)

        def watching_gateway() -> None:
            while not self._watching.wait(interval_s):
                if (reason := self.gateway.death()) is not None:
                    died(reason)
                    return

        self.engines.watch(died)
        threading.Thread(target=watching_gateway, name="gateway-watch", daemon=True).start()

    def stop(self, grace_s: float = 15.0) -> None:
        self._watching.set()
        self.gateway.stop()
        self.engines.stop(grace_s)


class ExternalEngines(LaunchedThenWaited):
    """Engines started elsewhere: the gateway in front of `worker_urls`, or (none given) the
    gateway or engine at `runtime_url`, which picrag neither starts nor stops. `config` says
    how the engines were started (the frontend's policy checks read its attention backend)."""

    def __init__(self, config: RuntimeConfig, runtime_url: str | None = None, worker_urls: Sequence[str] = (),
                 log_file: Path | None = None):
        if bool(runtime_url) == bool(worker_urls):
            raise ValueError("give either a runtime URL or worker URLs")
        self.config = config.resolved()
        self.gateway = (Gateway(GatewayConfig(tuple(worker_urls), free_port()),
                                log_file=_log_of(log_file, "gateway"))
                        if worker_urls else None)
        self._runtime_url = runtime_url
        self._worker_urls = tuple(worker_urls)
        self._watching = threading.Event()

    @property
    def url(self) -> str:
        return self.gateway.url if self.gateway is not None else self._runtime_url

    @property
    def engine_urls(self) -> tuple[str, ...]:
        """The engines behind the gateway picrag starts; a `runtime_url` counts as one engine."""
        return self._worker_urls or (self._runtime_url,)

    def launch(self) -> None:
        """Nothing: the engines run elsewhere, and the gateway starts once waited for."""

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        if self.gateway is not None:
            self.gateway.start(timeout_s)

    def watch(self, on_death: Callable[[str], None], interval_s: float = 1.0) -> None:
        """Call `on_death(reason)` if the gateway picrag started exits (the engines are watched
        by the gateway, and a `runtime_url` by the frontend's health probe)."""
        if self.gateway is None:
            return

        def watching() -> None:
            while not self._watching.wait(interval_s):
                if (reason := self.gateway.death()) is not None:
                    on_death(reason)
                    return

        threading.Thread(target=watching, name="gateway-watch", daemon=True).start()

    def stop(self, grace_s: float = 15.0) -> None:
        self._watching.set()
        if self.gateway is not None:
            self.gateway.stop()


Engines = SGLangRuntime | ReplicaSet | ExternalEngines | EngineGroup


def engines_for(config: RuntimeConfig, replicas: int = 1, *, runtime_url: str | None = None,
                worker_urls: Sequence[str] = (), engines_only: bool = False,
                log_file: Path | None = None) -> Engines:
    """What `picrag serve` runs for its flags: one runtime (the default), `replicas` behind the
    gateway, the gateway in front of `worker_urls`, nothing (`runtime_url`), or with
    `engines_only` the runtimes alone. ValueError for flags that contradict each other."""
    if runtime_url and worker_urls:
        raise ValueError("--runtime-url and --worker-url exclude each other")
    elsewhere = "--runtime-url" if runtime_url else "--worker-url" if worker_urls else None
    if elsewhere and (replicas > 1 or engines_only):
        raise ValueError(f"{elsewhere} uses engines started elsewhere: it takes no --replicas or --engines-only")
    if elsewhere:
        return ExternalEngines(config, runtime_url, worker_urls, log_file)
    if engines_only:
        return EngineGroup(config, replicas, log_file)
    if replicas > 1:
        return ReplicaSet(config, replicas, log_file)
    return SGLangRuntime(config, log_file=log_file)


def run_engines(group: EngineGroup, timeout_s: float) -> str | None:
    """Start `group` and keep it running: the reason once every replica died, None after ^C."""
    ended: list[str] = []
    gone = threading.Event()
    try:
        group.start(timeout_s)
        logger.info("engines ready for a gateway: --worker-url %s", " --worker-url ".join(group.urls))
        group.watch(lambda reason: (ended.append(reason), gone.set()))
        while not gone.wait(1.0):
            pass
        logger.error("%s", ended[0])
        return ended[0]
    except KeyboardInterrupt:
        return None
    finally:
        group.stop()
