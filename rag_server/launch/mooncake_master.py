"""A local Mooncake master for a one-machine trial: `picrag serve --chunk-store mooncake://HOST:PORT
--start-mooncake-master` starts `mooncake_master` (from the mooncake-transfer-engine wheel) with
its RPC service on PORT and its HTTP metadata server on the port of the store URL's `metadata`
option, in its own process group, before the engines, and stops it after them.

The master keeps only metadata: the chunks live in the segments the engines lend to the store
(`segment=`), so a chunk lives as long as the engine whose segment holds it. Across machines,
run the master on one host yourself (docs/deployment.md) and point every engine at it.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from rag_server.launch.ports import free_port
from rag_server.launch.process_group import died_during_start, start_in_own_group, stop_process_group
from picrag_core.chunk_store_spec import MooncakeSpec

logger = logging.getLogger(__name__)

BINARY = "mooncake_master"


class MooncakeMasterError(RuntimeError):
    pass


def _binary() -> str:
    beside_python = Path(sys.executable).parent / BINARY  # the virtual environment's own
    found = str(beside_python) if beside_python.exists() else shutil.which(BINARY)
    if found is None:
        raise MooncakeMasterError(f"{BINARY} not found: `make setup` installs it (mooncake-transfer-engine-non-cuda)")
    return found


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


class MooncakeMaster:
    def __init__(self, spec: MooncakeSpec, log_file: Path | None = None):
        metadata = urlsplit(spec.metadata)
        if metadata.scheme != "http" or metadata.port is None:
            raise MooncakeMasterError(f"--start-mooncake-master serves the metadata itself: give the store URL "
                                      f"metadata=http://HOST:PORT/metadata, not {spec.metadata!r}")
        self.spec = spec
        self.metadata_port = metadata.port
        self.log_file = log_file
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [_binary(), f"--rpc_port={self.spec.port}", f"--rpc_address={self.spec.host}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_host={self.spec.host}",
                f"--http_metadata_server_port={self.metadata_port}",
                f"--metrics_port={free_port(taken=[self.spec.port, self.metadata_port])}"]

    def start(self, timeout_s: float = 60.0) -> None:
        self.process, log_start = start_in_own_group(self.command(), self.log_file)
        deadline = time.monotonic() + timeout_s
        while not (_answers(self.spec.host, self.spec.port) and _answers(self.spec.host, self.metadata_port)):
            if self.process.poll() is not None:
                raise MooncakeMasterError(died_during_start(self.process, BINARY, self.log_file, log_start))
            if time.monotonic() > deadline:
                self.stop()
                raise MooncakeMasterError(f"{BINARY} not answering on {self.spec.master} after {timeout_s:.0f} s")
            time.sleep(0.2)
        # tests/test_mooncake_store.py reads this line for the master's process group.
        logger.info("mooncake master ready at %s, metadata on port %d (process group %d)",
                    self.spec.master, self.metadata_port, self.process.pid)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is not None:
            stop_process_group(self.process, BINARY, grace_s)
