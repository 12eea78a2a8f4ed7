"""Which chunk store a server uses: `--chunk-store file://DIR` (or a bare DIR) or
`--chunk-store mooncake://HOST:PORT[?options]`, and how that choice reaches the engine's
scheduler processes (environment variables, read by sglang_patches.plugin).

Mooncake options (query parameters): `metadata` (the transfer engine's metadata service:
`http://HOST:PORT/metadata` or `P2PHANDSHAKE`; default the master host's HTTP metadata server on
Mooncake's default port 8080), `segment` (bytes of this engine's RAM it lends to the
distributed store, e.g. 4G; default 1G), `protocol` (tcp or rdma; default tcp), `device` (the
RDMA device) and `local` (the address other nodes reach this engine's segment at; default
SGLang's: MOONCAKE_LOCAL_HOSTNAME or LOCAL_HOSTNAME, else localhost).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

# What the engine's scheduler processes read (set by rag_server/launch/runtime.py).
STORE_DIR_ENV = "PICRAG_CHUNK_STORE_DIR"  # a file store's directory
MOONCAKE_ENV = "PICRAG_CHUNK_STORE_MOONCAKE"  # a Mooncake store's URL
MAX_BYTES_ENV = "PICRAG_CHUNK_STORE_MAX_BYTES"  # a file store's bound on one server's files (all its ranks)
HOST_BYTES_ENV = "PICRAG_CHUNK_HOST_BYTES"  # the host-memory tier's bound; 0 turns it off
TIMEOUT_ENV = "PICRAG_CHUNK_STORE_TIMEOUT_S"  # the bound on each call into a remote store
MOONCAKE_METADATA_PORT = 8080  # mooncake_master's --http_metadata_server_port default
DEFAULT_SEGMENT_BYTES = 1 << 30
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """Bytes, as a count with an optional K, M, G or T (binary) suffix: 500M, 20G."""
    number = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = _UNITS.get(number[-1:], 1)
    try:
        value = int(float(number[:-1] if unit > 1 else number) * unit)
    except (ValueError, OverflowError):
        raise ValueError(f"not a size: {text!r} (e.g. 500M, 20G)") from None
    if value <= 0:
        raise ValueError(f"must be more than 0 bytes, not {text!r}")
    return value


@dataclass(frozen=True)
class MooncakeSpec:
    master: str  # HOST:PORT of mooncake_master's RPC service
    metadata: str
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    protocol: str = "tcp"
    device: str = ""
    local_hostname: str | None = None
    url: str = ""  # as given, for the environment and the logs

    @property
    def host(self) -> str:
        return self.master.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.master.rpartition(":")[2])

    def extra_config(self) -> dict[str, object]:
        """SGLang's MooncakeStore configuration (its `extra_config` keys)."""
        config: dict[str, object] = {
            "master_server_address": self.master, "metadata_server": self.metadata,
            "global_segment_size": self.segment_bytes, "protocol": self.protocol, "device_name": self.device,
            "check_server": False,
        }
        if self.local_hostname:
            config["local_hostname"] = self.local_hostname
        return config

    def __str__(self) -> str:
        return self.url


ChunkStoreSpec = Path | MooncakeSpec


def parse_chunk_store(text: str) -> ChunkStoreSpec:
    """`file://DIR` or a bare DIR: the directory; `mooncake://HOST:PORT?...`: a MooncakeSpec.
    ValueError for anything else."""
    if "://" not in text:
        return Path(text)
    parts = urlsplit(text)
    if parts.scheme == "file":
        return Path(parts.netloc + parts.path)
    if parts.scheme != "mooncake":
        raise ValueError(f"unknown chunk store {text!r}: file://DIR or mooncake://HOST:PORT")
    if not parts.hostname or parts.port is None:
        raise ValueError(f"{text!r}: a Mooncake store needs the master's HOST:PORT")
    options = {name: values[-1] for name, values in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = set(options) - {"metadata", "segment", "protocol", "device", "local"}
    if unknown:
        raise ValueError(f"{text!r}: unknown option(s) {', '.join(sorted(unknown))}")
    return MooncakeSpec(
        master=f"{parts.hostname}:{parts.port}",
        metadata=options.get("metadata") or f"http://{parts.hostname}:{MOONCAKE_METADATA_PORT}/metadata",
        segment_bytes=byte_size(options["segment"]) if "segment" in options else DEFAULT_SEGMENT_BYTES,
        protocol=options.get("protocol") or "tcp",
        device=options.get("device", ""),
        local_hostname=options.get("local") or None,
        url=text,
    )


def store_env(spec: ChunkStoreSpec) -> dict[str, str]:
    """The environment that hands `spec` to the engine."""
    if isinstance(spec, MooncakeSpec):
        return {MOONCAKE_ENV: spec.url}
    return {STORE_DIR_ENV: str(spec)}


def spec_from_env(environ: dict[str, str] | None = None) -> ChunkStoreSpec | None:
    environ = os.environ if environ is None else environ
    if environ.get(MOONCAKE_ENV):
        return parse_chunk_store(environ[MOONCAKE_ENV])
    if environ.get(STORE_DIR_ENV):
        return Path(environ[STORE_DIR_ENV])
    return None
