"""The disk tier of the chunk cache: survives a restart, refuses corrupt and foreign files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picrag_core.chunk_key import StoredChunk
from sglang_patches.store.disk import CorruptChunkFile, DiskChunkStore
from tests.chunk_requests import counters, generate, logprobs_of, passages_of, picrag_meta, wait_for_counter
from tests.conftest import start_picrag_server, stop_picrag_server

TOKENS = StoredChunk.of([5, 17, 4, 99, 23])


def kv(layers=3, tokens=len(TOKENS), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, tokens, 2, 8, generator=gen), torch.randn(layers, tokens, 2, 8, generator=gen)


def flip_byte(path: Path, from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_save_and_load_round_trip(tmp_path):
    store = DiskChunkStore(tmp_path, "fp-a")
    keys, values = kv()
    store.save(TOKENS, keys, values)
    loaded_keys, loaded_values = store.load(TOKENS)
    assert torch.equal(loaded_keys, keys) and torch.equal(loaded_values, values)
    assert store.load(StoredChunk.of([1, 2, 3])) is None


def test_flipped_byte_is_caught(tmp_path):
    store = DiskChunkStore(tmp_path, "fp-a")
    store.save(TOKENS, *kv())
    flip_byte(store.path_of(TOKENS.digest))
    with pytest.raises(CorruptChunkFile, match="checksum|unreadable"):
        store.load(TOKENS)


def test_file_of_another_model_is_refused(tmp_path):
    DiskChunkStore(tmp_path, "fp-a").save(TOKENS, *kv())
    other = DiskChunkStore(tmp_path, "fp-b")
    (other.directory / f"{TOKENS.digest}.safetensors").write_bytes(
        (tmp_path / "fp-a" / f"{TOKENS.digest}.safetensors").read_bytes()
    )
    with pytest.raises(CorruptChunkFile, match="another model"):
        other.load(TOKENS)


@pytest.mark.server
def test_restart_reuses_persisted_chunks_and_catches_corruption(tmp_path, served_model_dir, layout, musique):
    store_dir = tmp_path / "chunks"
    prompt = layout.build(musique[40]["question"], passages_of(musique[40], [0, 1, 2]))
    segments = len(prompt.chunks) + 1  # head + passages

    # No self-check: its compiles would add files and disk counts to the ones asserted here.
    serve_args = ["--model", str(served_model_dir), "--chunk-store", str(store_dir), "--no-selfcheck"]
    first = start_picrag_server(tmp_path / "first.log", serve_args)
    try:
        with first.client() as client:
            before_restart = generate(client, prompt.input_ids, "naive", prompt.chunks, logprobs=True)
            saved = wait_for_counter(client, "disk_saves", segments)["disk_saves"]
    finally:
        stop_picrag_server(first)
    assert saved == segments
    files = sorted(store_dir.rglob("*.safetensors"))
    assert len(files) == segments

    second = start_picrag_server(tmp_path / "second.log", serve_args)
    try:
        with second.client() as client:
            after_restart = generate(client, prompt.input_ids, "naive", prompt.chunks, logprobs=True)
            reloaded = counters(client)
            client.post("/flush_cache").raise_for_status()
            flip_byte(files[0])
            after_corruption = generate(client, prompt.input_ids, "naive", prompt.chunks, logprobs=True)
            corrupted = counters(client)
    finally:
        stop_picrag_server(second)

    # Every segment came back from disk: each compile computed only its last token.
    assert reloaded["disk_loads"] == segments
    assert reloaded["compile_chunk_misses"] == 0
    assert reloaded["compile_computed_tokens"] == segments
    assert picrag_meta(after_restart).chunk_hits == len(prompt.chunks)
    assert after_restart["output_ids"] == before_restart["output_ids"]
    assert logprobs_of(after_restart) == pytest.approx(logprobs_of(before_restart), abs=1e-5)
    # The flipped file is reported, ignored and recomputed; the rest reload; same answer.
    assert corrupted["disk_rejects"] == 1
    assert corrupted["disk_loads"] - reloaded["disk_loads"] == segments - 1
    assert corrupted["compile_chunk_misses"] == 1
    assert after_corruption["output_ids"] == before_restart["output_ids"]
