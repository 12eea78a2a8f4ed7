"""`python -m sglang_patches.cpu.launch ARGS`: SGLang's `python -m sglang.launch_server ARGS` with
its worker processes forked instead of spawned, for runtimes on CPU.

SGLang starts its scheduler and detokenizer with multiprocessing's 'spawn' method (CUDA state
does not survive a fork), so each worker imports SGLang afresh, about 11 s of CPU each on these
cores. On CPU a fork serves as well, as long as the forking process has run no torch computation
(an OpenMP thread pool does not survive a fork), and SGLang's server process runs none before it
starts its workers: it parses arguments and reads the model's config. Same SGLang code, same
arguments, same plugins; only the start method differs. Forked, the runtime answered /health in
17 s rather than 29 s on two cores (2026-12-03). CUDA runtimes keep `sglang.launch_server`.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

# The statement in SGLang's launch (sglang.srt.entrypoints.engine) that this module overrides;
# tests/test_sglang_seams.py checks that it is still there.
SPAWN_STATEMENT = 'mp.set_start_method("spawn", force=True)'


def use_forked_workers() -> None:
    """Every multiprocessing start in this process forks, whatever SGLang asks for later."""
    multiprocessing.set_start_method("fork", force=True)
    multiprocessing.set_start_method = lambda *args, **kwargs: None


def run(argv: list[str]) -> None:
    """What `python -m sglang.launch_server ARGV` runs, its workers forked; for a process that has
    loaded SGLang's plugins already (load_plugins runs them once per process)."""
    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args

    use_forked_workers()
    run_server(prepare_server_args(argv))


def main() -> None:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.utils import kill_process_tree

    load_plugins()  # before the arguments are parsed: the plugins add backends they may name
    try:
        run(sys.argv[1:])
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
