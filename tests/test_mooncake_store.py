"""Two replicas sharing compiled chunks through a Mooncake store: `picrag serve --replicas 2
--chunk-store mooncake://... --start-mooncake-master`.

The `slow` tests share ONE server (two runtimes of the default model with small KV pools, the
gateway and a local Mooncake master) and run in file order: the last one stops the master.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from rag_server.launch.ports import free_port
from tests.chunk_requests import assert_same_answer, passages_of
from tests.conftest import start_picrag_server, stop_picrag_server
from tests.test_replicas import READY, Replicas, _linked_body, _served

POOL_TOKENS = 4096  # per replica: one long plain prompt evicts every chunk from it
MASTER_READY = re.compile(r"mooncake master ready at \S+, metadata on port \d+ \(process group (\d+)\)")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, default_model_dir) -> Replicas:
    directory = tmp_path_factory.mktemp("mooncake-replicas")
    rpc = free_port()
    metadata = free_port(taken=[rpc])
    store = (f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{metadata}/metadata"
             f"&segment=256M&local=127.0.0.1")
    server = start_picrag_server(directory / "server.log",
                                 ["--replicas", "2", "--max-total-tokens", str(POOL_TOKENS), "--chunk-store", store,
                                  "--start-mooncake-master", "--chunk-store-timeout", "5"])
    ready = sorted(READY.findall(server.log.read_text()))
    started = Replicas(server, [url for _, url, _ in ready], [int(pgid) for _, _, pgid in ready], directory, store)
    yield started
    stop_picrag_server(server)


def _delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


def _wait_for_saves(replicas: Replicas, index: int, before: dict, timeout_s: float = 120.0) -> dict:
    """The replica's counters once every chunk it compiled since `before` has been written or has
    failed to be (saves run off the request's path)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = replicas.counters()[index]
        done = _delta(now, before, "disk_saves") + _delta(now, before, "disk_write_failures")
        if done >= _delta(now, before, "compile_chunk_misses"):
            return now
        assert time.monotonic() < deadline, f"chunk saves not done: {now}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_passage_set_compiled_on_one_replica_is_loaded_on_the_other_through_mooncake(replicas, layout, musique):
    prompt = layout.build(musique[16]["question"], passages_of(musique[16], [0, 1, 2]))
    before = replicas.counters()
    with replicas.server.client() as client:
        home, answer = _served(replicas, client, prompt)
    saved = _wait_for_saves(replicas, home, before[home])
    assert _delta(saved, before[home], "disk_saves") >= len(prompt.chunks)
    assert _delta(saved, before[home], "disk_write_failures") == 0
    other = 1 - home
    other_before = replicas.counters()[other]
    # The other replica, asked directly, has never seen these passages: it links them from Mooncake.
    with httpx.Client(base_url=replicas.urls[other], timeout=600) as direct:
        response = direct.post("/generate", json=_linked_body(prompt))
    assert response.status_code == 200, response.text
    after = replicas.counters()[other]
    assert _delta(after, other_before, "store_loads") >= len(prompt.chunks)
    assert _delta(after, other_before, "host_loads") == 0
    assert _delta(after, other_before, "chunk_misses") == 0
    assert _delta(after, other_before, "compile_computed_tokens") == 0
    assert_same_answer(response.json(), answer)


@pytest.mark.slow
def test_a_chunk_evicted_from_the_pool_is_reloaded_from_host_memory_before_the_store(replicas, layout, musique):
    prompt = layout.build(musique[18]["question"], passages_of(musique[18], [0, 1, 2]))
    before = replicas.counters()
    with replicas.server.client() as client:
        home, answer = _served(replicas, client, prompt)
    _wait_for_saves(replicas, home, before[home])
    with httpx.Client(base_url=replicas.urls[home], timeout=600) as direct:
        # A plain prompt nearly as long as the pool: SGLang evicts every unlocked node for it,
        # the stored chunks last (sglang_patches.tree.chunk_cache.ChunksLast), but these too.
        flood = {"input_ids": list(range(100, 100 + POOL_TOKENS - 200)), "sampling_params": {"max_new_tokens": 1}}
        assert direct.post("/generate", json=flood).status_code == 200
        reloaded_before = replicas.counters()[home]
        response = direct.post("/generate", json=_linked_body(prompt))
    assert response.status_code == 200, response.text
    after = replicas.counters()[home]
    assert _delta(after, reloaded_before, "host_loads") >= len(prompt.chunks)
    assert _delta(after, reloaded_before, "store_loads") == 0
    assert _delta(after, reloaded_before, "chunk_misses") == 0
    assert_same_answer(response.json(), answer)


@pytest.mark.slow
def test_with_the_master_stopped_requests_are_computed_and_the_misses_counted(replicas, layout, musique):
    (pgid,) = MASTER_READY.findall(replicas.server.log.read_text())
    os.killpg(int(pgid), signal.SIGKILL)
    prompt = layout.build(musique[17]["question"], passages_of(musique[17], [0, 1, 2]))
    before = replicas.counters()
    with replicas.server.client() as client:
        home, answer = _served(replicas, client, prompt)
        assert answer["text"] and answer["meta_info"]["completion_tokens"] > 0
        saved = _wait_for_saves(replicas, home, before[home])
        assert client.get("/health").status_code == 200
    # Each passage was looked for in the store and not found there (down, or past the timeout)...
    missed = _delta(saved, before[home], "disk_misses") + _delta(saved, before[home], "store_failures")
    assert missed >= len(prompt.chunks)
    assert _delta(saved, before[home], "store_loads") == 0
    # ...computed (its compile missed) and not saved: every write failed and was counted.
    assert _delta(saved, before[home], "compile_chunk_misses") >= len(prompt.chunks)
    assert _delta(saved, before[home], "disk_saves") == 0
    assert _delta(saved, before[home], "disk_write_failures") >= len(prompt.chunks)
    # The same passages linked again are reused from the replica's own memory, with the same answer.
    with replicas.server.client() as client:
        again_home, again = _served(replicas, client, prompt)
    assert again_home == home
    assert_same_answer(again, answer)
    assert replicas.server.process.poll() is None


@pytest.mark.slow
def test_a_short_soak_with_faults_loses_no_request(replicas, shared_qa, tmp_path):
    """`picrag bench soak`'s slice: the steady workload open-loop on both engines while bad input,
    slow clients, a master stop and restart and an engine kill are injected. Every request is
    answered or refused with a status and a reason, none lost; the bad input is all 4xx; a sampled
    share answers the same on the idle server; the server is healthy at the end. Last in the file:
    it kills an engine."""
    from rag_server.bench.soak import SoakOptions, run_soak
    from rag_server.bench.steady import SteadyOptions
    from rag_server.bench.steady_client import PICRAG
    from rag_server.bench.steady_schedule import ScheduleSettings

    # More clients than requests: none waits for a client, so none is left unsent at the end
    # however slow the machine is (with 4, a busy machine left the last one unsent).
    steady = SteadyOptions(
        datasets=(shared_qa / "hotpotqa.dev.jsonl",), out=tmp_path / "soak", systems=(PICRAG,), clients=32,
        schedule=ScheduleSettings(minutes=0.75, rate=0.3, zipf=1.1, novel=0.2, pool=4, passages=2, seed=2),
        max_tokens=2, bucket_s=15.0, url=replicas.server.url)
    report = run_soak(SoakOptions(steady, check_share=0.2, monitor_s=2.0, log=replicas.server.log,
                                  store=replicas.chunk_store), progress=False)
    counted = report["accounting"]
    assert steady.clients >= counted["requests"] == report["settings"]["requests"] > 5
    assert counted["lost"] == 0, report["requests"]
    assert counted["answered"] + sum(counted["refused"].values()) == counted["requests"]
    assert set(report["faults_by_kind"]) == {"bad_input", "slow_clients", "master_stop", "master_restart",
                                             "replica_kill"}
    assert all(fault["ok"] for fault in report["faults"]), report["faults"]
    assert report["correctness"]["checked"] >= 1 and not report["correctness"]["differing"], report["correctness"]
    assert report["healthy_at_end"] and report["peak_open_files"] > 0
