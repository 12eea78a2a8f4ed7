"""SGLang's model gateway in front of several engines: the Shepherd Model Gateway (PyPI `smg`).

The gateway runs `consistent_hashing`: a request that carries a routing key
(`rag_server.linking.chunk_compiler.ROUTING_KEY_HEADER`, which the frontend derives from the
request's passage set) goes to the worker its key hashes to on the gateway's ring, and keeps
going there while that worker is healthy; a request without one goes to a random worker. A
worker that fails a request is routed around at once (the gateway sends a request whose answer
had not begun again to another worker) and is marked unhealthy after HEALTH_FAILURES failed
`/health` probes HEALTH_INTERVAL_S apart; keys that hashed to it move to the next worker on the
ring, the others stay put.

A worker's load never takes it out of routing: smg's own overload protection (on by default in
smg 1.13: a worker whose load report shows 8 queued requests or 0.8 of its KV pool in use is
skipped while another is under both) is switched off. picrag admits load itself, in front of
the gateway (rag_server.api.admission, rag_server.linking.kv_budget); a passage set moved off
its worker for load loses that worker's chunk cache; and with one worker dead, smg refused every
request while the healthy survivor's queue was long (503 `no_available_workers`, "0/2 available
(1 healthy)": the half-hour fault soak's only refusals).

The gateway is a child process group of its own, like each runtime (rag_server/launch/runtime.py).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from rag_server.launch.process_group import died_during_start, start_in_own_group, stop_process_group
from rag_server.launch.ports import free_port

logger = logging.getLogger(__name__)

ROUTING_POLICY = "consistent_hashing"
ROUTED_TO_HEADER = "x-smg-routed-worker-id"  # on each answer, the worker that gave it
HEALTH_INTERVAL_S = 2
HEALTH_FAILURES = 2
# The gateway would wait this long for in-flight requests on SIGTERM (its default is 180 s); the
# frontend stops first and ends its own requests, so what is left is only being torn down.
SHUTDOWN_GRACE_S = 5


class GatewayStartError(RuntimeError):
    pass


@dataclass(frozen=True)
class GatewayConfig:
    worker_urls: tuple[str, ...]
    port: int
    host: str = "127.0.0.1"
    metrics_port: int = 0  # the gateway's own Prometheus port (0: a free one)
    log_level: str = "warn"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "smg", "launch",
            "--worker-urls", *self.worker_urls,
            "--host", self.host, "--port", str(self.port),
            "--policy", ROUTING_POLICY,
            "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
            "--health-failure-threshold", str(HEALTH_FAILURES),
            "--shutdown-grace-period-secs", str(SHUTDOWN_GRACE_S),
            "--disable-worker-overload-protection",  # see the module's docstring
            # Requests reach the engines as token ids or text; the gateway tokenizes nothing.
            "--disable-tokenizer-autoload",
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(self.metrics_port or free_port(taken=[self.port])),
            "--log-level", self.log_level,
        ]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class Gateway:
    def __init__(self, config: GatewayConfig, log_file: Path | None = None):
        self.config = config
        self.log_file = log_file
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return self.config.url

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the gateway and wait until it routes to at least one healthy worker."""
        logger.info("Starting the model gateway (smg, policy %s) at %s over %s",
                    ROUTING_POLICY, self.url, ", ".join(self.config.worker_urls))
        self.process, log_start = start_in_own_group(self.config.command(), self.log_file)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise GatewayStartError(died_during_start(self.process, "model gateway", self.log_file, log_start))
            healthy, total = self.workers()
            if healthy:
                logger.info("model gateway ready: %d of %d workers healthy", healthy, total)
                return
            time.sleep(0.5)
        self.stop()
        raise GatewayStartError(f"model gateway routes to no healthy worker after {timeout_s:.0f} s")

    def workers(self) -> tuple[int, int]:
        """(healthy, registered) workers as the gateway sees them; (0, 0) when it does not answer."""
        try:
            body = httpx.get(f"{self.url}/readiness", timeout=5.0).json()
        except (httpx.HTTPError, ValueError):
            return 0, 0
        return int(body.get("healthy_workers", 0)), int(body.get("total_workers", 0))

    def death(self) -> str | None:
        if self.process is None or self.process.poll() is None:
            return None
        return f"the model gateway (pid {self.process.pid}) exited with code {self.process.returncode}"

    def stop(self, grace_s: float = SHUTDOWN_GRACE_S + 5.0) -> None:
        if self.process is None:
            return
        stop_process_group(self.process, "the model gateway", grace_s)
