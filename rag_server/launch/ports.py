"""Free loopback ports for processes that bind them later.

Every port picrag chooses for a child (an SGLang runtime, the model gateway, its metrics listener,
the frontend a test starts) is bound seconds to a minute after it was chosen: a runtime binds its
port only once its model is loaded. Meanwhile the schedulers being started bind dozens of ports from
the kernel's ephemeral range, so a free port chosen there was taken before its owner bound it (a
replica's port, and in one CI run the gateway's). Ports are therefore drawn below that range.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

# From here up to the ephemeral range (SGLang draws the port its scheduler binds later, for NCCL,
# from 22000 to 29999).
PORTS_FROM = 30000


def ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(taken: Collection[int] = (), attempts: int = 64) -> int:
    """A port nothing binds now, below the ephemeral range and not in `taken` (ports chosen for
    processes not started yet); an ephemeral one only if `attempts` draws found none."""
    for port in random.sample(range(PORTS_FROM, ephemeral_low()), attempts):
        if port not in taken and _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
