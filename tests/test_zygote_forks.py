"""The suite's forked starts (tests/zygote.py) fork only a process that runs no other thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO


def test_a_runtime_is_forked_only_from_a_process_running_no_other_thread():
    # In a process of its own: a pytest-xdist worker runs threads of its own.
    script = textwrap.dedent("""
        import sys, threading
        from rag_server.launch.runtime import CPU_LAUNCH_MODULE
        from tests.zygote import ZYGOTE_ENV, _forks_here

        command = [sys.executable, "-m", CPU_LAUNCH_MODULE, "--port", "1"]
        alone = _forks_here(command, dict(ZYGOTE_ENV))
        other_import = _forks_here(command, {**ZYGOTE_ENV, "SGLANG_USE_CPU_ENGINE": "0"})
        stop = threading.Event()
        threading.Thread(target=stop.wait).start()
        beside_a_thread = _forks_here(command, dict(ZYGOTE_ENV))
        stop.set()
        print(alone, other_import, beside_a_thread)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"]
