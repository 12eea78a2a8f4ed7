"""Stopping a child started in its own process group (`start_new_session`): SIGTERM, a grace
period, then SIGKILL to the whole group, so no worker of it outlives the server."""

from __future__ import annotations

import logging
import os
import signal
import subprocess

logger = logging.getLogger(__name__)


def stop_process_group(process: subprocess.Popen, name: str, grace_s: float) -> None:
    # The process group is the child's pid, and outlives the child while a worker of it lives.
    pgid = process.pid
    if process.poll() is None:
        logger.info("Stopping %s (process group %d)", name, pgid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s ignored SIGTERM; killing it", name)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
