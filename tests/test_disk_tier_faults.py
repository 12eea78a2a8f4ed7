"""The disk tier under faults: a full disk, a slow disk, a crash mid-write, a bounded size, and
several engine processes (ranks, KV options) sharing one store directory.

The chunk cache's own save and load (`ChunkRadixCache._save_to_disk`, `_load_from_disk`) run
here against a small stand-in pool; two tests start a server (marker `server`).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import SafetensorError

from rag_server.bench.load import flush_when_idle
from sglang_patches import plugin
from sglang_patches.store import disk as disk_chunk_store
from sglang_patches.tree.chunk_cache import CacheCounters, ChunkRadixCache
from picrag_core.chunk_key import StoredChunk
from picrag_core.chunk_store_spec import MAX_BYTES_ENV, STORE_DIR_ENV
from sglang_patches.store.disk import DiskChunkStore
from tests.chunk_requests import generate, logprobs_of, passages_of, wait_for_counter
from tests.conftest import start_picrag_server, stop_picrag_server

TOKENS = StoredChunk.of([5, 17, 4, 99, 23])
OTHER = [[7, 7, 1], [8, 2, 2, 9], [3, 1, 4, 1, 5]]


class Pool:
    """The part of SGLang's MHA token-to-KV pool the chunk cache uses."""

    def __init__(self, layers=3, slots=16, heads=2, head_dim=8, dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.start_layer, self.layer_num, self.dtype = 0, layers, dtype
        self.k = [torch.randn(slots, heads, head_dim, generator=gen).to(dtype) for _ in range(layers)]
        self.v = [torch.randn(slots, heads, head_dim, generator=gen).to(dtype) for _ in range(layers)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def kv_of(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([k[slots] for k in self.k]), torch.stack([v[slots] for v in self.v])


def cache_with(store: DiskChunkStore, pool: Pool) -> SimpleNamespace:
    """A stand-in ChunkRadixCache whose tree holds every chunk in slots 0..n-1."""

    def allocate(needed):
        raise AssertionError("a rejected file must not take pool slots")

    return SimpleNamespace(
        disk_store=store, kv_pool=pool, counters=CacheCounters(), _allocate=allocate,
        _find_chunk=lambda chunk: (None, torch.arange(len(chunk))),
    )


def save_chunk(cache: SimpleNamespace, chunk=TOKENS) -> None:
    ChunkRadixCache._save_to_disk(cache, chunk)


def kv(layers=3, tokens=len(TOKENS), heads=2, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(layers, tokens, heads, head_dim, generator=gen),
            torch.randn(layers, tokens, heads, head_dim, generator=gen))


def store_files(store: DiskChunkStore) -> list[str]:
    return sorted(path.name for path in store.directory.iterdir())


@pytest.fixture
def tiny_disk(tmp_path) -> Path:
    """A 64 KiB tmpfs: smaller than any chunk file of the test model."""
    mount_point = tmp_path / "tiny-disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); "
                    "test_a_safetensors_error_on_save_is_survived covers the failure")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


# ---- item 4: a failed write is logged, counted and survived ------------------------------------


def test_a_full_disk_is_survived_counted_and_leaves_no_file(tiny_disk):
    store = DiskChunkStore(tiny_disk, "fp-a", max_bytes=1 << 30)  # the disk, not the bound, is the limit
    cache = cache_with(store, Pool(layers=8, slots=512, heads=4, head_dim=16))  # 512 KiB of KV
    save_chunk(cache, StoredChunk.of(range(512)))
    store.wait_for_writes()
    assert cache.counters.values.get("disk_write_failures") == 1
    assert cache.counters.values.get("disk_saves", 0) == 0
    assert store_files(store) == []  # neither the chunk nor its temporary
    # The writer goes on: a chunk that fits is saved.
    save_chunk(cache, TOKENS)
    store.wait_for_writes()
    assert cache.counters.values["disk_saves"] == 1
    assert store_files(store) == [f"{TOKENS.digest}.safetensors"]


def test_a_safetensors_error_on_save_is_survived(tmp_path, monkeypatch):
    def disk_full(self, token_ids, keys, values):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(DiskChunkStore, "save", disk_full)
    store = DiskChunkStore(tmp_path, "fp-a")
    cache = cache_with(store, Pool())
    save_chunk(cache)
    save_chunk(cache, OTHER[0])
    store.wait_for_writes()
    assert cache.counters.values == {"disk_write_failures": 2}


# ---- item 5: off the scheduler's thread, bounded queue, durable rename, size bound -------------


@pytest.fixture
def slow_disk(monkeypatch):
    """DiskChunkStore.save blocks until `release` is set; `threads` names the threads it ran on."""
    gate = SimpleNamespace(release=threading.Event(), threads=[])
    real_save = DiskChunkStore.save

    def slow_save(self, token_ids, keys, values):
        gate.threads.append(threading.current_thread().name)
        assert gate.release.wait(30)
        return real_save(self, token_ids, keys, values)

    monkeypatch.setattr(DiskChunkStore, "save", slow_save)
    yield gate
    gate.release.set()


def test_a_save_returns_before_the_disk_write_and_keeps_the_kv_it_was_given(tmp_path, slow_disk):
    store = DiskChunkStore(tmp_path, "fp-a")
    pool = Pool()
    cache = cache_with(store, pool)
    expected = pool.kv_of(torch.arange(len(TOKENS)))
    caller = threading.Thread(target=save_chunk, args=(cache,))
    caller.start()
    caller.join(5)
    assert not caller.is_alive(), "the scheduler's thread waited on the disk"
    # The pool's slots are reused while the write is still pending: the file keeps the old KV.
    for buffer in pool.k + pool.v:
        buffer.zero_()
    slow_disk.release.set()
    store.wait_for_writes()
    assert slow_disk.threads == ["picrag-chunk-writer"]
    assert cache.counters.values == {"disk_saves": 1}
    keys, values = store.load(TOKENS)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])


def test_saves_beyond_the_queue_bound_are_dropped_and_counted(tmp_path, slow_disk):
    store = DiskChunkStore(tmp_path, "fp-a")
    cache = cache_with(store, Pool())
    one_save = 2 * 3 * len(TOKENS) * 2 * 8 * 4  # keys and values: layers x tokens x heads x dim x fp32
    store._writer.max_pending_bytes = one_save + one_save // 2
    for i in range(4):
        save_chunk(cache, StoredChunk.of([t + i for t in TOKENS.tokens]))
    slow_disk.release.set()
    store.wait_for_writes()
    assert cache.counters.values == {"disk_saves": 1, "disk_saves_dropped": 3}


def test_a_file_is_fsynced_before_its_rename_and_the_directory_after(tmp_path, monkeypatch):
    store = DiskChunkStore(tmp_path, "fp-a")
    events: list[tuple[str, ...]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store.save(TOKENS, *kv())
    target = str(store.path_of(TOKENS.digest))
    temporary = f"{target}.tmp-{os.getpid()}"
    assert events == [("fsync", temporary), ("rename", temporary, target), ("fsync", str(store.directory))]


def test_stale_temporaries_are_removed_when_a_store_opens(tmp_path):
    directory = DiskChunkStore(tmp_path, "fp-a").directory
    finished = subprocess.Popen(["true"])
    finished.wait()
    stale = [directory / f"{'a' * 64}.safetensors.tmp-{finished.pid}", directory / f"{'b' * 64}.tmp-{finished.pid}"]
    in_progress = directory / f"{'c' * 64}.safetensors.tmp-{os.getpid()}"
    for path in stale + [in_progress]:
        path.write_bytes(b"half a file")
    DiskChunkStore(tmp_path, "fp-a")
    assert sorted(directory.iterdir()) == [in_progress]


def test_the_least_recently_used_file_is_evicted_and_a_load_is_a_use(tmp_path):
    probe = DiskChunkStore(tmp_path / "probe", "fp-a")
    probe.save(TOKENS, *kv())
    size = probe.stored_bytes
    store = DiskChunkStore(tmp_path, "fp-a", max_bytes=2 * size + size // 2)
    a, b, c = (StoredChunk.of([t + i for t in TOKENS.tokens]) for i in (1, 2, 3))
    assert store.save(a, *kv()) == 0 and store.save(b, *kv()) == 0
    assert store.load(a) is not None
    assert store.save(c, *kv()) == 1
    assert store_files(store) == sorted(f"{t.digest}.safetensors" for t in (a, c))
    assert store.stored_bytes == 2 * size


def test_the_use_order_and_a_lowered_bound_survive_a_restart(tmp_path):
    store = DiskChunkStore(tmp_path, "fp-a")
    chunks = [StoredChunk.of([t + i for t in TOKENS.tokens]) for i in range(3)]
    for age, tokens in zip((300, 200, 100), chunks):
        store.save(tokens, *kv())
        past = time.time() - age
        os.utime(store.path_of(tokens.digest), (past, past))
    size = store.stored_bytes // 3
    assert DiskChunkStore(tmp_path, "fp-a").load(chunks[0]) is not None  # the oldest, now the newest
    smaller = DiskChunkStore(tmp_path, "fp-a", max_bytes=2 * size + size // 2)
    assert store_files(smaller) == sorted(f"{t.digest}.safetensors" for t in (chunks[0], chunks[2]))


def test_the_default_bound_is_a_tenth_of_the_free_space_shared_by_the_processes(tmp_path, monkeypatch):
    DiskChunkStore(tmp_path, "fp-a").save(TOKENS, *kv())
    held = DiskChunkStore(tmp_path, "fp-a").stored_bytes
    monkeypatch.setattr(disk_chunk_store.shutil, "disk_usage", lambda path: SimpleNamespace(free=10_000_000))
    assert DiskChunkStore(tmp_path, "fp-a").max_bytes == int(0.1 * (10_000_000 + held))
    assert DiskChunkStore(tmp_path, "fp-a", max_bytes=1_000_000, processes=4).max_bytes == 250_000


def test_the_max_bytes_flag_reaches_the_runtime_environment(tmp_path):
    from rag_server.cli import build_parser
    from rag_server.launch.runtime import RuntimeConfig

    args = build_parser().parse_args(["serve", "--chunk-store", str(tmp_path), "--chunk-store-max-bytes", "1.5G"])
    assert args.chunk_store_max_bytes == 3 << 29
    env = RuntimeConfig(model_path=tmp_path, chunk_store=tmp_path, chunk_store_max_bytes=args.chunk_store_max_bytes).env()
    assert env[STORE_DIR_ENV] == str(tmp_path) and env[MAX_BYTES_ENV] == str(3 << 29)
    assert MAX_BYTES_ENV not in RuntimeConfig(model_path=tmp_path, chunk_store=tmp_path).env()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chunk-store-max-bytes", "lots"])


# ---- item 6: one directory per rank and KV options; a file of another shape is rejected --------


def engine_context(model_path: Path, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, **options):
    server_args = {"model_path": str(model_path), "dtype": "auto", "kv_cache_dtype": "auto", "quantization": None,
                   "quantization_param_path": None, "json_model_override_args": "{}", "load_format": "auto",
                   "revision": None, **options}
    return SimpleNamespace(server_args=SimpleNamespace(**server_args), tp_rank=tp_rank, tp_size=tp_size,
                           params=SimpleNamespace(pp_rank=pp_rank, pp_size=pp_size))


def test_each_rank_and_kv_option_gets_its_own_store(tmp_path, monkeypatch):
    import picrag_core.model_fingerprint

    monkeypatch.setattr(picrag_core.model_fingerprint, "model_fingerprint", lambda path, dtype: "fp-a")
    monkeypatch.setenv(STORE_DIR_ENV, str(tmp_path / "store"))
    monkeypatch.setenv(MAX_BYTES_ENV, "1000000")
    pool = SimpleNamespace(dtype=torch.float32)

    def store_of(**ctx):
        return plugin._disk_store(engine_context(tmp_path, **ctx), pool)

    base = store_of(tp_rank=0, tp_size=2)
    assert base.directory.parent == tmp_path / "store" / "fp-a"
    assert base.max_bytes == 500_000  # two processes share the bound
    assert store_of(tp_rank=0, tp_size=2).directory == base.directory
    others = [store_of(tp_rank=1, tp_size=2), store_of(tp_rank=0, tp_size=1),
              store_of(tp_rank=0, tp_size=2, pp_rank=1, pp_size=2),
              store_of(tp_rank=0, tp_size=2, kv_cache_dtype="fp8_e4m3"),
              store_of(tp_rank=0, tp_size=2, quantization="fp8"),
              store_of(tp_rank=0, tp_size=2, json_model_override_args='{"rope_theta": 10000}')]
    assert len({base.directory, *(store.directory for store in others)}) == 1 + len(others)


def test_a_file_copied_from_another_rank_is_rejected(tmp_path):
    rank0 = DiskChunkStore(tmp_path, "fp-a", "tp0of2-pp0of1-kvx")
    rank1 = DiskChunkStore(tmp_path, "fp-a", "tp1of2-pp0of1-kvx")
    rank0.save(TOKENS, *kv())
    rank1.path_of(TOKENS.digest).write_bytes(rank0.path_of(TOKENS.digest).read_bytes())
    with pytest.raises(disk_chunk_store.CorruptChunkFile, match="another model, process or chunk"):
        rank1.load(TOKENS)


@pytest.mark.parametrize("pool", [
    Pool(heads=4), Pool(head_dim=16), Pool(layers=2), Pool(layers=4), Pool(dtype=torch.bfloat16),
], ids=["kv-heads", "head-dim", "fewer-layers", "more-layers", "dtype"])
def test_a_file_of_another_kv_shape_is_rejected_not_loaded(tmp_path, pool):
    store = DiskChunkStore(tmp_path, "fp-a")
    store.save(TOKENS, *kv(layers=3, heads=2, head_dim=8))
    cache = cache_with(store, pool)
    before = [buffer.clone() for buffer in pool.k + pool.v]
    assert ChunkRadixCache._load_from_disk(cache, TOKENS) is None
    assert cache.counters.values == {"disk_rejects": 1}
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k + pool.v))
    keys, values = store.load(TOKENS, Pool())  # the pool it was saved from still takes it
    assert keys.shape == values.shape == (3, len(TOKENS), 2, 8)


# ---- through a server -------------------------------------------------------------------------


@pytest.mark.server
def test_a_server_on_a_full_disk_keeps_serving(tmp_path, tiny_disk, layout, musique):
    prompt = layout.build(musique[41]["question"], passages_of(musique[41], [0, 1]))
    segments = len(prompt.chunks) + 1  # head + passages
    # No self-check: its compiles would add disk counts to the ones asserted here.
    server = start_picrag_server(tmp_path / "server.log", ["--chunk-store", str(tiny_disk), "--no-selfcheck"])
    try:
        with server.client() as client:
            first = generate(client, prompt.input_ids, "naive", prompt.chunks, logprobs=True)
            failed = wait_for_counter(client, "disk_write_failures", segments)
            flush_when_idle(client)
            second = generate(client, prompt.input_ids, "naive", prompt.chunks, logprobs=True)
            again = wait_for_counter(client, "disk_write_failures", 2 * segments)
            healthy = client.get("/health").status_code
    finally:
        stop_picrag_server(server)
    assert failed["disk_write_failures"] == segments and failed["disk_saves"] == 0
    assert again["disk_write_failures"] == 2 * segments and again["disk_saves"] == 0
    assert healthy == 200
    assert second["output_ids"] == first["output_ids"]
    assert logprobs_of(second) == pytest.approx(logprobs_of(first), abs=1e-5)
    assert not any(tiny_disk.rglob("*.safetensors*"))


@pytest.mark.server
def test_a_server_keeps_its_store_under_the_max_bytes_flag(tmp_path, layout, musique):
    prompt = layout.build(musique[41]["question"], passages_of(musique[41], [0, 1]))
    segments = len(prompt.chunks) + 1
    store_dir = tmp_path / "chunks"
    server = start_picrag_server(tmp_path / "server.log",
                                 ["--chunk-store", str(store_dir), "--chunk-store-max-bytes", "1", "--no-selfcheck"])
    try:
        with server.client() as client:
            generate(client, prompt.input_ids, "naive", prompt.chunks)
            saved = wait_for_counter(client, "disk_evictions", segments)
    finally:
        stop_picrag_server(server)
    # A one-byte bound holds no chunk: each file is evicted as soon as it is written.
    assert saved["disk_saves"] == segments and saved["disk_evictions"] == segments
    assert not any(store_dir.rglob("*.safetensors*"))
