"""The chunk store's tiers without a model: the HiCache frame's integrity checks, the host-memory
tier, the timed store calls, the --chunk-store URL, and the Mooncake store through SGLang's
MooncakeStore against a real `mooncake_master` (a process of its own, a few seconds to start).
"""

from __future__ import annotations

import importlib
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from picrag_core.chunk_key import StoredChunk
from rag_server.launch.mooncake_master import MooncakeMaster
from rag_server.launch.ports import free_port
from sglang_patches.tree.chunk_cache import CacheCounters, ChunkRadixCache
from sglang_patches.store.codec import (
    HEADER_BYTES, ChunkIdentity, CorruptChunkFile, KVLayout, decode_frame, encode_frame, frame_bytes,
)
from picrag_core.chunk_store_spec import MooncakeSpec, parse_chunk_store
from sglang_patches.store.hicache import HiCacheChunkStore, mooncake_backend
from sglang_patches.store.host_tier import HostChunkTier
from sglang_patches.store.calls import StoreUnavailable, TimedLane
from tests.test_disk_tier_faults import TOKENS, Pool, cache_with, kv, save_chunk

IDENTITY = ChunkIdentity("fp-a", "tp0of1", TOKENS.digest)
LAYOUT = KVLayout.of_pool(Pool())


def frame_of(keys: torch.Tensor, values: torch.Tensor, identity: ChunkIdentity = IDENTITY) -> torch.Tensor:
    frame = torch.empty(frame_bytes(LAYOUT, len(TOKENS)), dtype=torch.uint8)
    assert encode_frame(identity, keys, values, frame) == frame.numel()
    return frame


# ---- the frame ----------------------------------------------------------------------------------


def test_a_frame_round_trips_and_any_flipped_tensor_byte_is_caught():
    keys, values = kv()
    frame = frame_of(keys, values)
    loaded = decode_frame(frame, IDENTITY, len(TOKENS), LAYOUT)
    assert torch.equal(loaded[0], keys) and torch.equal(loaded[1], values)
    frame[HEADER_BYTES + 7] ^= 1
    with pytest.raises(CorruptChunkFile, match="checksum"):
        decode_frame(frame, IDENTITY, len(TOKENS), LAYOUT)


def test_a_frame_of_another_model_partition_chunk_or_shape_is_refused():
    keys, values = kv()
    for other in (ChunkIdentity("fp-b", "tp0of1", IDENTITY.chunk_key), ChunkIdentity("fp-a", "tp1of2", IDENTITY.chunk_key),
                  ChunkIdentity("fp-a", "tp0of1", StoredChunk.of([1, 2, 3]).digest)):
        with pytest.raises(CorruptChunkFile, match="another model, process or chunk"):
            decode_frame(frame_of(keys, values, other), IDENTITY, len(TOKENS), LAYOUT)
    bigger = KVLayout.of_pool(Pool(heads=4))
    with pytest.raises(CorruptChunkFile, match="the pool holds"):
        decode_frame(frame_of(keys, values), IDENTITY, len(TOKENS), bigger)
    with pytest.raises(CorruptChunkFile, match="unreadable header"):
        decode_frame(torch.full((frame_bytes(LAYOUT, len(TOKENS)),), 0xFF, dtype=torch.uint8), IDENTITY,
                     len(TOKENS), LAYOUT)


# ---- the --chunk-store URL ------------------------------------------------------------------------


def test_the_chunk_store_url_names_a_directory_or_a_mooncake_store():
    assert parse_chunk_store("/data/chunks") == Path("/data/chunks")
    assert parse_chunk_store("file:///data/chunks") == Path("/data/chunks")
    spec = parse_chunk_store("mooncake://10.0.0.5:50051?segment=8G&protocol=rdma&device=mlx5_0&local=10.0.0.7")
    assert spec.master == "10.0.0.5:50051" and spec.metadata == "http://10.0.0.5:8080/metadata"
    assert spec.extra_config() == {"master_server_address": "10.0.0.5:50051", "metadata_server": "http://10.0.0.5:8080/metadata",
                                   "global_segment_size": 8 << 30, "protocol": "rdma", "device_name": "mlx5_0",
                                   "check_server": False, "local_hostname": "10.0.0.7"}
    for bad in ("s3://bucket", "mooncake://host", "mooncake://h:1?segmnt=1G", "mooncake://h:1?segment=lots"):
        with pytest.raises(ValueError):
            parse_chunk_store(bad)


# ---- the host-memory tier -------------------------------------------------------------------------


class CountingStore:
    """A store that records what reaches it."""

    def __init__(self, chunks=None):
        self.chunks = dict(chunks or {})
        self.loads = 0
        self.saves = 0

    def load(self, chunk, pool=None):
        self.loads += 1
        return self.chunks.get(chunk.digest)

    def save_in_background(self, chunk, keys, values, counters):
        self.saves += 1
        return True

    def wait_for_writes(self):
        pass


def test_the_host_tier_serves_from_ram_before_the_store_and_keeps_its_bound():
    counters = CacheCounters()
    chunks = {f"c{i}": StoredChunk.of([i, i + 1, i + 2, i + 3, i + 4]) for i in range(3)}
    size = sum(t.nbytes for t in kv())
    store = CountingStore({chunks["c2"].digest: kv(seed=2)})
    tier = HostChunkTier(store, max_bytes=2 * size, counters=counters)
    for seed, name in enumerate(("c0", "c1")):
        tier.save_in_background(chunks[name], *kv(seed=seed), counters)
    assert store.saves == 2 and tier.held_bytes == 2 * size
    keys, _ = tier.load(chunks["c0"])  # RAM: the store is not asked
    assert torch.equal(keys, kv(seed=0)[0]) and store.loads == 0
    assert tier.load(chunks["c2"]) is not None and store.loads == 1  # from the store, now kept
    # c1 was the least recently used: it left to make room for c2.
    assert counters.values == {"host_loads": 1, "store_loads": 1, "host_evictions": 1}
    assert tier.load(chunks["c1"]) is None and store.loads == 2
    tier.clear()
    assert tier.held_bytes == 0 and tier.load(chunks["c0"]) is None


# ---- timed store calls ----------------------------------------------------------------------------


def test_a_stuck_store_call_costs_one_timeout_then_refusals_until_it_returns():
    lane = TimedLane("test", timeout_s=0.2)  # no back-off: calls are taken again once it returns
    release, entered = threading.Event(), threading.Event()

    def stuck():
        entered.set()
        release.wait()
        return "late"

    with pytest.raises(StoreUnavailable, match="no answer"):
        lane.call(stuck)
    assert entered.is_set()
    with pytest.raises(StoreUnavailable, match="has not returned"):
        lane.call(lambda: "next")
    release.set()
    done = threading.Event()
    while not done.is_set():  # polls until the stuck call has returned and the lane takes calls again
        try:
            assert lane.call(lambda: "next") == "next"
            done.set()
        except StoreUnavailable:
            done.wait(0.05)
    with pytest.raises(StoreUnavailable, match="OSError: disk"):
        lane.call(lambda: (_ for _ in ()).throw(OSError("disk")))


def test_after_a_timeout_the_store_is_skipped_for_the_back_off():
    lane = TimedLane("test", timeout_s=0.1, backoff_s=3600)
    release = threading.Event()
    with pytest.raises(StoreUnavailable, match="no answer"):
        lane.call(release.wait)
    release.set()
    lane._in_flight.result()  # the slow call has returned...
    with pytest.raises(StoreUnavailable, match="skipped for 3600 s"):
        lane.call(lambda: "next")  # ...and the store is still skipped
    assert TimedLane("other", timeout_s=0.1, backoff_s=3600).call(lambda: "answered") == "answered"


def test_a_store_that_is_not_up_yet_is_a_counted_miss_until_it_connects():
    up = threading.Event()

    class FakeBackend:
        def register_buffer(self, tensor):
            pass

        def exists(self, key):
            return False

        def set(self, key, target_location=None, target_sizes=None):
            return False

        def get(self, key, target_location=None, target_sizes=None):
            return False

    def connect():
        if not up.is_set():
            raise ConnectionError("master down")
        return FakeBackend()

    store = HiCacheChunkStore(connect, "fp-a", "tp0of1", timeout_s=1.0, connect_wait_s=0, reconnect_s=0.05)
    cache = SimpleNamespace(disk_store=store, kv_pool=Pool(), counters=CacheCounters(),
                            _allocate=lambda n: pytest.fail("a miss takes no slots"))
    assert ChunkRadixCache._load_from_disk(cache, TOKENS) is None
    assert cache.counters.values == {"store_failures": 1}
    up.set()
    assert store._connected.wait(30)
    assert ChunkRadixCache._load_from_disk(cache, TOKENS) is None
    assert cache.counters.values == {"store_failures": 1, "disk_misses": 1}


class RefusingBackend:
    """A store that is full (every set refused) and, while `stuck` is clear, hangs on lookups."""

    def __init__(self):
        self.stuck = threading.Event()

    def register_buffer(self, tensor):
        pass

    def exists(self, key):
        self.stuck.wait()
        return False

    def set(self, key, target_location=None, target_sizes=None):
        return False


def test_a_full_or_hanging_store_costs_counted_misses_not_errors():
    backend = RefusingBackend()
    backend.stuck.set()
    store = HiCacheChunkStore(lambda: backend, "fp-a", "tp0of1", timeout_s=0.2)
    cache = cache_with(store, Pool())
    save_chunk(cache)  # full: refused, counted, dropped
    store.wait_for_writes()
    assert cache.counters.values == {"disk_write_failures": 1}
    backend.stuck.clear()  # hangs now: one timeout, then refused at once while the call is stuck
    assert ChunkRadixCache._load_from_disk(cache, TOKENS) is None
    assert ChunkRadixCache._load_from_disk(cache, TOKENS) is None
    assert cache.counters.values == {"disk_write_failures": 1, "store_failures": 2}
    backend.stuck.set()


# ---- Mooncake through SGLang's MooncakeStore -----------------------------------------------------


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    rpc = free_port()
    metadata = free_port(taken=[rpc])
    spec = parse_chunk_store(f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{metadata}/metadata"
                             f"&segment=64M&local=127.0.0.1")
    master = MooncakeMaster(spec, tmp_path_factory.mktemp("mooncake") / "master.log")
    master.start()
    yield SimpleNamespace(spec=spec, master=master)
    master.stop()


def mooncake_store(spec: MooncakeSpec, partition="tp0of1", timeout_s=5.0) -> HiCacheChunkStore:
    ranks = {"tp": (0, 1), "pp": (0, 1)}
    store = HiCacheChunkStore(lambda: mooncake_backend(spec, ranks), "fp-a", partition, timeout_s=timeout_s)
    assert store.connected
    return store


def test_a_chunk_saved_by_one_engine_is_loaded_by_another_through_mooncake(mooncake):
    writer, reader = mooncake_store(mooncake.spec), mooncake_store(mooncake.spec)
    keys, values = kv()
    assert reader.load(TOKENS, Pool()) is None
    writer.save(TOKENS, keys, values)
    loaded = reader.load(TOKENS, Pool())
    assert torch.equal(loaded[0], keys) and torch.equal(loaded[1], values)
    # Another partition (rank, KV options) has its own keys: nothing of this one is found there.
    assert mooncake_store(mooncake.spec, partition="tp1of2").load(TOKENS, Pool()) is None


def test_a_corrupt_mooncake_value_is_a_counted_reject(mooncake):
    store = mooncake_store(mooncake.spec)
    tokens = StoredChunk.of([9, 8, 7, 6, 5])
    identity = ChunkIdentity("fp-a", "tp0of1", tokens.digest)
    frame = frame_of(*kv(), identity=identity)
    frame[-1] ^= 0x40
    backend = store._backend
    backend.register_buffer(frame)
    assert backend.set(store.storage_key(identity), target_location=frame.data_ptr(), target_sizes=frame.numel())
    cache = SimpleNamespace(disk_store=store, kv_pool=Pool(), counters=CacheCounters(),
                            _allocate=lambda n: pytest.fail("a rejected value takes no slots"))
    assert ChunkRadixCache._load_from_disk(cache, tokens) is None
    assert cache.counters.values == {"disk_rejects": 1}


# ---- the SGLang seam ----------------------------------------------------------------------------


def test_the_hicache_storage_seam_the_mooncake_tier_calls():
    """sglang_patches.store.hicache builds MooncakeStore through SGLang's backend factory and
    calls its key-value methods with zero-copy locations (sglang==0.5.23)."""
    import inspect

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    assert list(inspect.signature(StorageBackendFactory.create_backend).parameters) == [
        "backend_name", "storage_config", "mem_pool_host", "kwargs"]
    assert StorageBackendFactory._registry["mooncake"]["class_name"] == "MooncakeStore"
    assert issubclass(MooncakeStore, HiCacheStorage)
    for method in ("get", "set"):
        assert list(inspect.signature(getattr(MooncakeStore, method)).parameters)[-2:] == [
            "target_location", "target_sizes"]
    assert list(inspect.signature(MooncakeStore.exists).parameters) == ["self", "key"]
    assert list(inspect.signature(MooncakeStore.register_buffer).parameters) == ["self", "tensor"]
    fields = set(HiCacheStorageConfig.__dataclass_fields__)
    assert {"tp_rank", "tp_size", "pp_rank", "pp_size", "model_name", "extra_config"} <= fields
    # The extra_config keys chunk_store_spec.MooncakeSpec fills are the ones MooncakeStore reads.
    source = inspect.getsource(importlib.import_module(MooncakeStore.__module__).MooncakeStoreConfig)
    for key in parse_chunk_store("mooncake://h:1?local=x").extra_config():
        assert f'"{key}"' in source, key
