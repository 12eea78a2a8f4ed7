"""A child started in its own process group (`start_new_session`): stopping it (SIGTERM, a grace
period, then SIGKILL to the whole group, so no worker of it outlives the server), and saying why
it died during its start."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)

START_LOG_LINES = 15
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # the gateway colours its log even into a file


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


def start_in_own_group(command: list[str], log_file: Path | None,
                       env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """The child started in its own process group, its stdout and stderr appended to `log_file`
    (a restart keeps the earlier runs' lines; None: inherited), and the byte offset where this
    run's lines begin in the log, for `died_during_start`."""
    if log_file is None:
        return subprocess.Popen(command, env=env, start_new_session=True), 0
    with open(log_file, "ab") as log:  # the child holds its own copy of the handle
        start = log.tell()  # before the child shares the file offset and moves it
        return subprocess.Popen(command, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT), start


def died_during_start(process: subprocess.Popen, name: str, log_file: Path | None, since: int) -> str:
    """The error for a child that exited before it was ready: its exit code and the end of what it
    wrote to its log from byte `since` on (this run's lines, not an earlier run's), so the reason
    reaches whoever reads the error (a CI log shows no other file)."""
    message = f"{name} exited with code {process.returncode} during start"
    if log_file is None:
        return message
    try:
        with open(log_file, "rb") as log:
            log.seek(since)
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return f"{message}; see {log_file}"
    tail = [_ANSI_ESCAPE.sub("", line) for line in lines if line.strip()][-START_LOG_LINES:]
    return f"{message}; the end of {log_file}:\n" + "\n".join(tail)
