"""Replicas behind SGLang's model gateway: routing by passage set, the shared chunk store, a
replica's death.

The unit tests need no server. The `slow` tests share ONE `picrag serve --replicas 2` (two runtimes
of the default model, the gateway, one --chunk-store) and run in file order: the last one kills a
replica.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from rag_server.api.runtime_metrics import picrag_counters
from rag_server.launch.gateway import ROUTED_TO_HEADER, ROUTING_POLICY, Gateway, GatewayConfig, GatewayStartError
from rag_server.launch.ports import PORTS_FROM, ephemeral_low
from rag_server.launch.replicas import ExternalEngines, ReplicaSet, engines_for, replica_configs
from rag_server.launch.runtime import RuntimeConfig, SGLangRuntime
from rag_server.linking.chunk_compiler import ROUTING_KEY_HEADER, passage_set_key
from picrag_core.chunk_key import StoredChunk, chunk_key
from sglang_patches.store.disk import DiskChunkStore
from picrag_core.link_hints import LinkRequest, link_hints
from tests.chunk_requests import assert_same_answer, counters, passages_of
from tests.conftest import ServerHandle, start_picrag_server, stop_picrag_server
from tests.inprocess_frontend import wait_for

# --- routing key ----------------------------------------------------------------------------------

PROMPT = [1, 2, 10, 11, 20, 21, 22, 9]


def test_passage_set_key_names_the_set_in_any_order():
    forward = passage_set_key(PROMPT, LinkRequest.of("naive", [(2, 4), (4, 7)]))
    reordered = passage_set_key([1, 2, 20, 21, 22, 10, 11, 9], LinkRequest.of("naive", [(2, 5), (5, 7)]))
    assert forward == reordered
    assert passage_set_key(PROMPT, LinkRequest.of("naive", [(2, 4)])) != forward
    # The policy does not move a passage set to another replica.
    assert passage_set_key(PROMPT, LinkRequest.of("legolink:2", [(2, 4), (4, 7)])) == forward
    assert passage_set_key(PROMPT, LinkRequest.of("naive", [])) is None


def test_the_compile_and_the_link_carry_the_passage_sets_routing_key():
    from rag_server.linking.chunk_compiler import ChunkCompiler
    from rag_server.linking.pipeline import LinkPipeline

    seen: list[tuple[str, str | None]] = []

    def runtime(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((body["kv_hints"]["actions"][0]["action_type"], request.headers.get(ROUTING_KEY_HEADER)))
        return httpx.Response(200, json=[{"meta_info": {}} for _ in body["input_ids"]]
                              if body["kv_hints"]["actions"][0]["action_type"] == "picrag.compile"
                              else {"text": "x", "meta_info": {}})

    async def generate(link: LinkRequest) -> None:
        async with httpx.AsyncClient(base_url="http://gateway", transport=httpx.MockTransport(runtime)) as client:
            await (await LinkPipeline(client, ChunkCompiler(client)).generate(PROMPT, link, {})).aclose()

    link = LinkRequest.of("naive", [(2, 4), (4, 7)])
    asyncio.run(generate(link))
    key = passage_set_key(PROMPT, link)
    assert seen == [("picrag.compile", key), ("picrag.link", key)]


# --- launch plans ---------------------------------------------------------------------------------

def test_replica_configs_split_ports_cores_gpus_and_the_store_bound(tmp_path):
    base = RuntimeConfig(model_path=tmp_path, port=30000, device="cpu", chunk_store=tmp_path,
                         chunk_store_max_bytes=1000)
    configs = replica_configs(base, 2)
    assert [c.port for c in configs] == [30000, 30001]
    assert [c.chunk_store for c in configs] == [tmp_path, tmp_path]  # one store, shared
    assert [c.chunk_store_max_bytes for c in configs] == [500, 500]
    assert [c.threads for c in configs] == [max(1, (os.cpu_count() or 1) // 2)] * 2
    # Free ones, apart, where no ephemeral bind takes them before they are bound.
    free = [c.port for c in replica_configs(RuntimeConfig(model_path=tmp_path), 8)]
    assert len(set(free)) == 8 and all(PORTS_FROM <= port < ephemeral_low() for port in free)
    on_gpus = replica_configs(RuntimeConfig(model_path=tmp_path, device="cuda"), 2)
    assert [c.extra_args[-2:] for c in on_gpus] == [["--base-gpu-id", "0"], ["--base-gpu-id", "1"]]
    assert [c.threads for c in on_gpus] == [None, None]


def test_serve_flags_choose_what_is_started(tmp_path):
    config = RuntimeConfig(model_path=tmp_path, device="cpu")
    assert isinstance(engines_for(config), SGLangRuntime)
    replicas = engines_for(config, 2)
    assert isinstance(replicas, ReplicaSet) and len(replicas.engines.runtimes) == 2
    assert replicas.gateway.config.worker_urls == tuple(r.url for r in replicas.engines.runtimes)
    # The gateway binds its port after the replicas have loaded their models; an ephemeral one was
    # taken meanwhile in one CI run.
    ports = {r.config.port for r in replicas.engines.runtimes} | {replicas.gateway.config.port}
    assert len(ports) == 3 and all(PORTS_FROM <= port < ephemeral_low() for port in ports)
    remote = engines_for(config, worker_urls=["http://gpu1:30000", "http://gpu2:30000"])
    assert isinstance(remote, ExternalEngines) and remote.gateway.config.worker_urls == ("http://gpu1:30000",
                                                                                       "http://gpu2:30000")
    assert engines_for(config, runtime_url="http://gateway:30000").url == "http://gateway:30000"
    for bad in ({"runtime_url": "http://a", "worker_urls": ["http://b"]},
                {"runtime_url": "http://a", "replicas": 2}, {"worker_urls": ["http://b"], "engines_only": True}):
        with pytest.raises(ValueError):
            engines_for(config, **bad)


def test_the_gateway_hashes_routing_keys():
    command = GatewayConfig(("http://a:1", "http://b:2"), 8000).command()
    assert command[command.index("--policy") + 1] == ROUTING_POLICY == "consistent_hashing"
    workers = command.index("--worker-urls") + 1
    assert command[workers:workers + 2] == ["http://a:1", "http://b:2"]


def test_a_gateway_that_cannot_start_says_why(tmp_path):
    log = tmp_path / "gateway.log"
    log.write_text("an earlier run's last line\n")  # the log is appended to; only this run's lines are quoted
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        gateway = Gateway(GatewayConfig(("http://127.0.0.1:9",), holder.getsockname()[1]), log_file=log)
        with pytest.raises(GatewayStartError, match="exited with code 1 during start(.|\n)*Address already in use") as error:
            gateway.start(timeout_s=60)
    assert gateway.death() is not None
    assert "earlier run" not in str(error.value)
    assert log.read_text().startswith("an earlier run's last line\n")


# --- two writers of one chunk file ----------------------------------------------------------------

TOKENS = StoredChunk.of(range(100, 300))
WRITES = 30


def _chunk_kv() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(30, len(TOKENS), 3, 64, generator=generator),
            torch.randn(30, len(TOKENS), 3, 64, generator=generator))


def _write_repeatedly(root: str) -> None:
    store = DiskChunkStore(Path(root), "fp", "tp0of1")
    keys, values = _chunk_kv()
    for _ in range(WRITES):
        store.save(TOKENS, keys, values)


def test_two_processes_writing_the_same_chunk_file_never_expose_a_partial_one(tmp_path):
    """Two replicas compiling the same passage write the same content-addressed file: each
    writes its own temporary and renames it over the file, so a reader (or a replica opening the
    store meanwhile, which removes only temporaries of dead processes) finds the whole chunk or
    none, never a mix."""
    keys, values = _chunk_kv()
    spawn = multiprocessing.get_context("spawn")
    writers = [spawn.Process(target=_write_repeatedly, args=(str(tmp_path),)) for _ in range(2)]
    for writer in writers:
        writer.start()
    loads = 0
    while any(writer.is_alive() for writer in writers):
        loaded = DiskChunkStore(tmp_path, "fp", "tp0of1").load(TOKENS)  # raises CorruptChunkFile on a partial file
        if loaded is not None:
            assert torch.equal(loaded[0], keys) and torch.equal(loaded[1], values)
            loads += 1
    assert [writer.exitcode for writer in writers] == [0, 0]  # no writer lost its temporary
    assert loads > 0
    directory = tmp_path / "fp" / "tp0of1"
    assert [path.name for path in directory.iterdir()] == [f"{TOKENS.digest}.safetensors"]


# --- two replicas of the default model ------------------------------------------------------------

READY = re.compile(r"replica (\d+) ready at (\S+) \(process group (\d+)\)")


@dataclass
class Replicas:
    server: ServerHandle
    urls: list[str]
    process_groups: list[int]
    store: Path
    chunk_store: str = ""  # the server's --chunk-store, where it is not `store`

    def counters(self) -> list[dict[str, float]]:
        return [counters(httpx.Client(base_url=url, timeout=30)) for url in self.urls]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, default_model_dir) -> Replicas:
    directory = tmp_path_factory.mktemp("replicas")
    store = directory / "chunks"
    server = start_picrag_server(directory / "server.log",
                                 ["--replicas", "2", "--max-total-tokens", "8192", "--chunk-store", str(store)])
    ready = sorted(READY.findall(server.log.read_text()))
    started = Replicas(server, [url for _, url, _ in ready], [int(pgid) for _, _, pgid in ready], store)
    yield started
    stop_picrag_server(server)


def _linked_body(prompt) -> dict:
    return {"input_ids": prompt.input_ids, "kv_hints": link_hints("naive", list(prompt.chunks)),
            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
            "return_logprob": True, "top_logprobs_num": 5}


def _wait_until_stored(store: Path, prompt, timeout_s: float = 60.0) -> None:
    """Until every passage of `prompt` has its file in the store (saves run off the request's path;
    a file appears whole, by rename)."""
    names = {f"{chunk_key(prompt.input_ids[start:end])}.safetensors" for start, end in prompt.chunks}
    deadline = time.monotonic() + timeout_s
    while not names <= {path.name for path in store.rglob("*.safetensors")}:
        assert time.monotonic() < deadline, "passages not saved to the chunk store"
        time.sleep(0.2)


def _served(replicas: Replicas, client: httpx.Client, prompt) -> tuple[int, dict]:
    """Send `prompt` linked through the frontend: (the replica whose counters show it, the answer)."""
    before = replicas.counters()
    response = client.post("/generate", json=_linked_body(prompt))
    assert response.status_code == 200, response.text
    # The engine counts a request as it builds its answer: read now, the counters hold it.
    after = replicas.counters()
    linked = [a.get("requests", 0) - b.get("requests", 0) for a, b in zip(after, before)]
    compiled = [a.get("compile_requests", 0) - b.get("compile_requests", 0) for a, b in zip(after, before)]
    moved = [i for i, n in enumerate(linked) if n]
    assert len(moved) == 1, f"linked requests counted per replica: {linked}"  # the link reached one replica
    (index,) = moved
    assert compiled[1 - index] == 0  # and the compile (when one was sent) the same one
    assert response.headers[ROUTED_TO_HEADER] == replicas.urls[index]
    return index, response.json()


@pytest.mark.slow
def test_a_passage_set_stays_on_its_replica_and_sets_spread(replicas, layout, musique):
    assert len(replicas.urls) == 2
    homes = []
    with replicas.server.client() as client:
        # The ring is built from the workers' URLs, whose ports differ from run to run, so which
        # replica a set lands on is known only by asking: sets are sent until both replicas have
        # one (for an even ring, 16 sets all on one replica is a 1-in-30,000 event).
        for row in musique[:16]:
            first, _ = _served(replicas, client, layout.build(row["question"], passages_of(row, [0, 1, 2])))
            again, _ = _served(replicas, client, layout.build(row["question"], passages_of(row, [2, 1, 0])))
            assert again == first
            homes.append(first)
            if set(homes) == {0, 1}:
                break
    assert set(homes) == {0, 1}, homes


@pytest.mark.slow
def test_a_chunk_compiled_on_one_replica_is_loaded_from_the_store_on_the_other(replicas, layout, musique):
    prompt = layout.build(musique[16]["question"], passages_of(musique[16], [0, 1, 2]))
    with replicas.server.client() as client:
        home, answer = _served(replicas, client, prompt)
    other = 1 - home
    _wait_until_stored(replicas.store, prompt)
    before = replicas.counters()[other]
    # The other replica, asked directly, has never seen these passages: it links them from the store.
    with httpx.Client(base_url=replicas.urls[other], timeout=600) as direct:
        response = direct.post("/generate", json=_linked_body(prompt))
    after = replicas.counters()[other]
    assert response.status_code == 200, response.text
    assert after.get("disk_loads", 0) - before.get("disk_loads", 0) >= len(prompt.chunks)
    assert after.get("chunk_misses", 0) == before.get("chunk_misses", 0)
    assert after.get("compile_computed_tokens", 0) == before.get("compile_computed_tokens", 0)
    assert_same_answer(response.json(), answer)
    # picrag serve's /metrics holds both engines' counters, each labelled (through the gateway it
    # read the gateway's 404 and counted nothing).
    engines = replicas.counters()
    with replicas.server.client() as client:
        text = client.get("/metrics").text
    assert {s.labels["engine"] for f in text_string_to_metric_families(text) if f.name == "picrag_disk_loads"
            for s in f.samples} == {"0", "1"}
    assert picrag_counters(text)["disk_loads"] == sum(e.get("disk_loads", 0) for e in engines) > 0


@pytest.mark.slow
def test_a_dead_replica_fails_its_stream_and_the_other_takes_its_passage_sets(replicas, layout, musique):
    prompt = next(p for p in (layout.build(row["question"], passages_of(row, [0, 1, 2])) for row in musique[20:40])
                  if _home_of(replicas, p) == 0)
    with replicas.server.client() as client:
        home, answer = _served(replicas, client, prompt)
        assert home == 0
        _wait_until_stored(replicas.store, prompt)
        # A store without them (as without a shared store): the survivor has to compile them itself.
        for path in replicas.store.rglob("*.safetensors"):
            path.unlink()

        long_answer = {**_linked_body(prompt), "stream": True, "return_logprob": False, "top_logprobs_num": 0,
                       "sampling_params": {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}}
        stream = _LongStream(replicas.server.url, long_answer)
        assert stream.first_event.wait(300)
        os.killpg(replicas.process_groups[0], signal.SIGKILL)
        stream.join(120)
        # The stream in flight on the dead replica ends with an error event, well before its end.
        assert any(b'"error"' in event for event in stream.events[-2:]), stream.events[-2:]
        assert len(stream.events) < 2000

        survivor_before = counters(httpx.Client(base_url=replicas.urls[1]))
        response = client.post("/generate", json=_linked_body(prompt))
        assert response.status_code == 200, response.text
        assert response.headers[ROUTED_TO_HEADER] == replicas.urls[1]
        survivor_after = counters(httpx.Client(base_url=replicas.urls[1]))
        assert_same_answer(response.json(), answer)
        # The frontend skipped the compile (it compiled these passages on replica 0), replica 1
        # refused the link unrun (its chunks missing), and the relink compiled them there.
        assert survivor_after["link_refusals"] > survivor_before.get("link_refusals", 0)
        assert survivor_after["compile_chunk_misses"] > survivor_before.get("compile_chunk_misses", 0)
        assert client.get("/health").status_code == 200
    assert replicas.server.process.poll() is None
    # The supervisor polls its replicas once a second: the death is logged within a poll or two.
    wait_for(lambda: re.search(r"replica 0 \(\S+\) died .*1 of 2 replicas left", replicas.server.log.read_text()))


def _home_of(replicas: Replicas, prompt) -> int:
    """The replica the gateway sends `prompt`'s passage set to: a one-token request with the
    set's routing key, through the frontend (which passes the header on)."""
    link = LinkRequest.of("naive", list(prompt.chunks))
    key = passage_set_key(prompt.input_ids, link)
    response = httpx.post(f"{replicas.server.url}/generate", timeout=600, headers={ROUTING_KEY_HEADER: key},
                          json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
    return replicas.urls.index(response.headers[ROUTED_TO_HEADER])


class _LongStream(threading.Thread):
    """A streamed request read event by event on a thread of its own."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[bytes] = []
        self.first_event = threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/generate", json=self.body, timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    self.events.append(line.encode())
                    self.first_event.set()
        self.first_event.set()
