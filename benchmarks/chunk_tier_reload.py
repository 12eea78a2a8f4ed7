"""Reload versus recompute, per chunk: what bringing one compiled chunk back into a KV pool costs
from each tier, against computing it again.

For chunks of the default model's KV shape (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64,
fp32) of --tokens tokens:
  host      the host-memory tier (sglang_patches.store.host_tier): a RAM hit;
  file      the file store (sglang_patches.store.disk): read, SHA-256, shape checks;
  mooncake  the Mooncake store through SGLang's MooncakeStore (sglang_patches.store.hicache),
            a local mooncake_master over TCP loopback: exists, zero-copy get, SHA-256, checks;
each followed by the copy into a pool of that shape (what ChunkRadixCache._load_from_disk does),
and
  recompute a prefill of the chunk's tokens alone with the model itself (transformers, fp32,
            torch threads as set by OMP_NUM_THREADS), which is what a miss costs.
Medians over --repeats runs, in milliseconds.

    python benchmarks/chunk_tier_reload.py [--tokens 150 512] [--repeats 5]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from picrag_core.model_store import ensure_model
from rag_server.launch.mooncake_master import MooncakeMaster
from rag_server.launch.ports import free_port
from sglang_patches.tree.chunk_cache import CacheCounters
from picrag_core.chunk_store_spec import parse_chunk_store
from sglang_patches.store.disk import DiskChunkStore
from sglang_patches.store.hicache import HiCacheChunkStore, mooncake_backend
from sglang_patches.store.host_tier import HostChunkTier

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


class Pool:
    """A KV pool of the default model's shape (the part the chunk cache touches)."""

    def __init__(self, slots: int):
        self.start_layer, self.layer_num, self.dtype = 0, LAYERS, torch.float32
        self.k = [torch.zeros(slots, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
        self.v = [torch.zeros(slots, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def fill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        slots = torch.arange(keys.shape[1])
        for layer in range(LAYERS):
            self.k[layer][slots] = keys[layer]
            self.v[layer][slots] = values[layer]


def timed_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def reload_ms(store, tokens: list[int], pool: Pool, repeats: int) -> float:
    def reload():
        loaded = store.load(tokens, pool)
        assert loaded is not None
        pool.fill(*loaded)
    return timed_ms(reload, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[150, 512])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_model(), dtype=torch.float32).eval()
    rpc = free_port()
    metadata = free_port(taken=[rpc])
    spec = parse_chunk_store(f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{metadata}/metadata"
                             f"&segment=512M&local=127.0.0.1")
    with tempfile.TemporaryDirectory() as scratch:
        master = MooncakeMaster(spec, Path(scratch) / "master.log")
        master.start()
        try:
            mooncake = HiCacheChunkStore(lambda: mooncake_backend(spec, {"tp": (0, 1), "pp": (0, 1)}),
                                         "bench", "tp0of1", timeout_s=30)
            disk = DiskChunkStore(Path(scratch) / "files", "bench", "tp0of1", max_bytes=1 << 32)
            # The host tier alone: a stand-in below it takes the saves and is never asked for a load.
            host = HostChunkTier(SimpleNamespace(save_in_background=lambda *args: True), 1 << 32, CacheCounters())
            print("| chunk tokens | KV bytes | host tier ms | file ms | Mooncake ms | recompute ms |")
            print("|---:|---:|---:|---:|---:|---:|")
            for count in args.tokens:
                tokens = list(range(1000, 1000 + count))
                gen = torch.Generator().manual_seed(count)
                keys = torch.randn(LAYERS, count, KV_HEADS, HEAD_DIM, generator=gen)
                values = torch.randn(LAYERS, count, KV_HEADS, HEAD_DIM, generator=gen)
                disk.save(tokens, keys, values)
                mooncake.save(tokens, keys, values)
                host.save_in_background(tokens, keys, values, CacheCounters())
                pool = Pool(count)
                ids = torch.tensor([tokens])
                with torch.no_grad():
                    recompute = timed_ms(lambda: model(ids, use_cache=True), args.repeats)
                print(f"| {count} | {keys.nbytes + values.nbytes:,} | {reload_ms(host, tokens, pool, args.repeats):.1f} | "
                      f"{reload_ms(disk, tokens, pool, args.repeats):.1f} | "
                      f"{reload_ms(mooncake, tokens, pool, args.repeats):.1f} | {recompute:.0f} |")
        finally:
            master.stop()


if __name__ == "__main__":
    main()
