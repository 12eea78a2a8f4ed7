"""Shared fixtures: the QA data, the default model folder, its tokenizer and prompt layout, and the
two real picrag servers shared by the session; and how the suite is split and scheduled.

Every test is marked `e2e` (it runs a real SGLang runtime: it uses one of the session's servers or
is marked `server` or `slow`) or `unit` (fakes at most): `make test ARGS="-m unit"` runs the quick
half. `make test` runs the suite on three pytest-xdist workers (`--dist loadgroup`); each module
is one group, and the modules that share a session server form one group with it, so each real
runtime starts once in a session, on one worker; those groups go first. The servers a test starts are forked from one process per worker that
imported `picrag serve` once (tests/zygote.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Before any test module imports SGLang: its layers read this once, at import, to choose CPU
# kernels (without it a rotary embedding imports vLLM's and fails), so a module that set it
# itself depended on being collected before every other module that imports SGLang.
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
# Every Python process the suite starts (the zygote, servers, runtimes and their workers) writes
# its threads' stacks to its log on SIGABRT: a server start that hangs is dumped so before it is
# killed (start_picrag_server), and its test's failure says where each process stood. No core
# files: the dumped processes die by that SIGABRT.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

import json
import resource
import shlex
import signal
import subprocess
import tempfile
from pathlib import Path

import httpx
import psutil
import pytest

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

REPO = Path(__file__).resolve().parents[1]
SHARED_QA = REPO.parent / "shared" / "data" / "qa"


@pytest.fixture(scope="session")
def shared_qa() -> Path:
    if not SHARED_QA.is_dir():
        pytest.skip(f"shared QA data not found at {SHARED_QA}")
    return SHARED_QA


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from picrag_core.model_store import ensure_model

    return ensure_model()


@pytest.fixture(scope="module")
def musique(shared_qa: Path) -> list[dict]:
    return [json.loads(line) for line in (shared_qa / "musique.dev.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def layout(tokenizer):
    from retrieval.prompt_layout import PromptLayout

    return PromptLayout(tokenizer)


def file_bytes(directory: Path) -> dict[str, bytes]:
    """Every file in `directory` by name, to check that a failed operation left them untouched."""
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


# Session fixtures that start a real runtime: the modules using one share a worker (see above).
SESSION_SERVERS = ("picrag_server", "shipped_checkpoint_server")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (its own hook, on every worker)
def pytest_collection_modifyitems(config, items) -> None:
    group_of_module: dict[str, str] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        server = next((name for name in SESSION_SERVERS if name in item.fixturenames), None)
        if server is not None:
            group_of_module[module] = server  # a module using both would need one group for both
        group_of_module.setdefault(module, module)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of_module[item.nodeid.split("::")[0]]))
        real = (any(name in item.fixturenames for name in SESSION_SERVERS)
                or item.get_closest_marker("server") or item.get_closest_marker("slow"))
        item.add_marker(pytest.mark.e2e if real else pytest.mark.unit)
    # xdist hands groups out in this order (pytest_configure turns its own reordering off), and a
    # long group handed out last runs alone at the end: the session servers' groups first (most
    # end-to-end modules are in them), then every group that starts a runtime of its own (each
    # takes a minute or more), then the quick ones that fill in around them.
    first = {name: index for index, name in enumerate(SESSION_SERVERS)}
    starts_runtime = {group_of_module[item.nodeid.split("::")[0]] for item in items
                      if item.get_closest_marker("e2e")}

    def order(item) -> tuple[int, int]:
        group = group_of_module[item.nodeid.split("::")[0]]
        return first.get(group, len(first)), group not in starts_runtime

    items.sort(key=order)


def pytest_configure(config) -> None:
    # xdist would hand groups out largest first by test count, which says nothing of their time
    # (a module of one restart test outlasts one of forty unit tests): keep the order set above.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


class ServerHandle:
    def __init__(self, url: str, process: subprocess.Popen, log: Path, picrag_home: Path | None = None):
        self.url = url
        self.process = process
        self.log = log
        self.picrag_home = picrag_home  # the PICRAG_HOME it was started with, when not the user's

    def client(self, timeout: float = 600.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    @property
    def runtime_url(self) -> str:
        """The SGLang runtime behind `picrag serve`."""
        from rag_server.launch.runtime import runtime_url_under

        url = runtime_url_under(self.process.pid)
        assert url is not None, "no SGLang runtime under picrag serve"
        return url


def home_sharing_models(home: Path) -> Path:
    """A new PICRAG_HOME folder whose models are the real PICRAG_HOME's, the default model
    converted there first: a link made before the folder exists dangles, and the model store
    cannot create the folder through it (a fresh machine's first test that used one failed so)."""
    from picrag_core.model_store import ensure_model

    home.mkdir()
    (home / "models").symlink_to(ensure_model().parent)
    return home


def start_picrag_server(log: Path, extra_args: list[str], default_corpus: bool = False,
                        spawned: bool = False) -> ServerHandle:
    """`picrag serve` with no passage index (tests that retrieve bring their own), or with
    `default_corpus` the default corpus's first 40 passages, built into an index under a
    PICRAG_HOME of its own that shares the converted models of the real one. Forked from this
    worker's zygote (tests/zygote.py), or with `spawned` run as the command it is."""
    from rag_server.launch.ports import free_port
    from rag_server.launch.serve_process import ServeStartError, spawn, start_picrag_serve

    port = free_port()
    home = None
    with pytest.MonkeyPatch.context() as patch:  # the server inherits the environment
        if default_corpus:
            home = home_sharing_models(log.parent / "picrag-home")
            patch.setenv("PICRAG_HOME", str(home))
        index_args = ["--default-corpus-passages", "40"] if default_corpus else ["--no-index"]
        try:
            start = spawn if spawned else worker_zygote().spawn
            process = start_picrag_serve(port, [*index_args, *extra_args], log, start=start,
                                         on_timeout=write_stacks_of_tree)
        except ServeStartError as exc:
            pytest.fail("\n".join([str(exc), *other_logs_of(log)]))
    return ServerHandle(f"http://127.0.0.1:{port}", process, log, home)


def write_stacks_of_tree(process) -> None:
    """SIGABRT to `process` and every process under it, deepest first: each writes its Python
    threads' stacks to its own log (PYTHONFAULTHANDLER, above) and dies."""
    try:
        tree = [*reversed(psutil.Process(process.pid).children(recursive=True)), psutil.Process(process.pid)]
    except psutil.NoSuchProcess:
        return
    for member in tree:
        try:
            member.send_signal(signal.SIGABRT)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=10)


def other_logs_of(log: Path) -> list[str]:
    """The ends of the logs a server writes beside `log` (a replica's runtime: `<log>.replica0.log`)."""
    return [f"--- {other.name}:\n{other.read_text(errors='replace')[-6000:]}"
            for other in sorted(log.parent.glob(f"{log.stem}.*.log"))]


_zygotes: list = []


def worker_zygote():
    """This worker's tests.zygote.Zygote, started on first use, closed with the session."""
    if not _zygotes:
        from tests.zygote import Zygote

        _zygotes.append(Zygote(Path(tempfile.mkdtemp(prefix="picrag-zygote-"))))
    return _zygotes[0]


def pytest_sessionfinish(session, exitstatus) -> None:
    for zygote in _zygotes:
        zygote.close()


def stop_picrag_server(handle: ServerHandle) -> None:
    """Stop by PID and check that no runtime process outlives the server."""
    process = handle.process
    children = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    _, alive = psutil.wait_procs(children, timeout=30)
    for child in alive:
        child.kill()
    assert not alive, f"picrag serve left children behind: {[c.pid for c in alive]}"


def write_zero_repair_checkpoint(model_dir: Path, directory: Path) -> Path:
    """A CacheRepair checkpoint for `model_dir` whose network is untrained: its output head is
    zero-initialised, so it repairs nothing (cacherepair must then equal naive)."""
    import torch

    from picrag_core.repair.checkpoint import save_checkpoint
    from picrag_core.repair.config import RepairConfig, read_token_embedding
    from picrag_core.repair.network import RepairNetwork
    from picrag_core.repair.normalization import KVStats
    from picrag_core.model_fingerprint import model_fingerprint

    config = RepairConfig.for_model(model_dir, width=32, blocks=1)
    shape = (config.num_layers, config.num_kv_heads, 2, config.head_dim)
    directory.mkdir(parents=True, exist_ok=True)
    save_checkpoint(
        directory, RepairNetwork(config, read_token_embedding(model_dir)), config,
        KVStats(torch.ones(shape), torch.ones(shape)), model_fingerprint(model_dir, torch.float32),
        {"steps": 0},
    )
    return directory


@pytest.fixture(scope="session")
def served_model_dir(default_model_dir: Path, tmp_path_factory) -> Path:
    """What `picrag_server` serves: the default model cut to its first layers (tests/shallow_model.py)."""
    from tests.shallow_model import write_shallow_model

    return write_shallow_model(default_model_dir, tmp_path_factory.mktemp("shallow-model"))


@pytest.fixture(scope="session")
def zero_repair_checkpoint(served_model_dir: Path, tmp_path_factory) -> Path:
    return write_zero_repair_checkpoint(served_model_dir, tmp_path_factory.mktemp("zero-repair"))


@pytest.fixture(scope="session")
def picrag_server(served_model_dir: Path, zero_repair_checkpoint: Path, tmp_path_factory) -> ServerHandle:
    """`picrag serve` on `served_model_dir`, shared by the whole session. PICRAG_TEST_SERVER_ARGS
    adds serve arguments (scripts/gpu_check.sh runs the equivalence tests on CUDA with it)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    handle = start_picrag_server(
        log,
        # No shadow samples: tests count the requests and reused tokens the runtime sees.
        ["--model", str(served_model_dir), "--max-total-tokens", "16384", "--repair-checkpoint",
         str(zero_repair_checkpoint), "--shadow-rate", "0", *shlex.split(os.environ.get("PICRAG_TEST_SERVER_ARGS", ""))],
    )
    yield handle
    stop_picrag_server(handle)


@pytest.fixture(scope="session")
def shipped_checkpoint_server(default_model_dir: Path, tmp_path_factory) -> ServerHandle:
    """`picrag serve` as `make serve` starts it: the command itself (the suite's one start that is
    not forked), its defaults' CacheRepair checkpoint (the one shipped for the default model), for
    end-to-end tests where cacherepair must repair (picrag_server's zero checkpoint makes it
    naive), and with no --index the default corpus (40 passages of it). No shadow samples: they
    would be traffic of their own between a test's requests."""
    log = tmp_path_factory.mktemp("shipped-server") / "server.log"
    handle = start_picrag_server(
        log, ["--shadow-rate", "0", *shlex.split(os.environ.get("PICRAG_TEST_SERVER_ARGS", ""))], default_corpus=True,
        spawned=True)
    yield handle
    stop_picrag_server(handle)
