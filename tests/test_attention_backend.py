"""picrag's query-only extend attention equals SGLang's torch_native extend attention."""

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import pytest
import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_patches.attention import QueryOnlyTorchNativeBackend, offset_causal_mask


HEADS, KV_HEADS, DIM = 6, 2, 16


def scattered_pool(seq_lens, pool, row_dtype, gen):
    """A random KV pool and request rows over scattered, non-contiguous slots (as in SGLang)."""
    k_cache = torch.randn(pool, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(pool, KV_HEADS, DIM, generator=gen)
    req_to_token = torch.zeros(len(seq_lens), max(seq_lens), dtype=row_dtype)
    slots = torch.randperm(pool, generator=gen)
    taken = 0
    for row, n in enumerate(seq_lens):
        req_to_token[row, :n] = slots[taken : taken + n]
        taken += n
    return k_cache, v_cache, req_to_token


def run_extend(backend_cls, prefix_lens, extend_lens, sliding_window=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    heads, dim = HEADS, DIM
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_cache, v_cache, req_to_token = scattered_pool(seq_lens, 512, torch.int64, gen)
    query = torch.randn(sum(extend_lens), heads, dim, generator=gen)
    output = torch.zeros_like(query)
    backend = object.__new__(backend_cls)  # the SDPA routine needs no model runner
    backend._run_sdpa_forward_extend(
        query, output, k_cache, v_cache, req_to_token,
        torch.arange(len(seq_lens)), torch.tensor(seq_lens),
        torch.tensor(prefix_lens), torch.tensor(extend_lens),
        scaling=dim ** -0.5, enable_gqa=True, causal=True,
        sliding_window_size=sliding_window,
    )
    return output


@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [([0], [37]), ([50], [7]), ([120, 0, 33], [1, 64, 9]), ([200], [200])],
)
def test_query_only_extend_equals_torch_native(prefix_lens, extend_lens):
    expected = run_extend(TorchNativeAttnBackend, prefix_lens, extend_lens)
    got = run_extend(QueryOnlyTorchNativeBackend, prefix_lens, extend_lens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_query_only_extend_with_sliding_window_equals_torch_native():
    expected = run_extend(TorchNativeAttnBackend, [90, 10], [12, 40], sliding_window=16)
    got = run_extend(QueryOnlyTorchNativeBackend, [90, 10], [12, 40], sliding_window=16)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_offset_causal_mask_places_queries_at_the_end():
    mask = offset_causal_mask(q_len=2, kv_len=5, device=torch.device("cpu"))
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def run_decode(backend_cls, seq_lens, seed=1):
    gen = torch.Generator().manual_seed(seed)
    heads, dim = HEADS, DIM
    k_cache, v_cache, req_to_token = scattered_pool(seq_lens, 256, torch.int32, gen)
    query = torch.randn(len(seq_lens), heads, dim, generator=gen)
    output = torch.zeros_like(query)
    backend = object.__new__(backend_cls)
    backend._run_sdpa_forward_decode(
        query, output, k_cache, v_cache, req_to_token, torch.arange(len(seq_lens)),
        torch.tensor(seq_lens), scaling=dim ** -0.5, enable_gqa=True,
    )
    return output


def test_decode_equals_torch_native():
    expected = run_decode(TorchNativeAttnBackend, [1, 17, 90])
    got = run_decode(QueryOnlyTorchNativeBackend, [1, 17, 90])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
