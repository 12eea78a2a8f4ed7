"""The pure-torch sgl_kernel stand-in against straightforward reference implementations."""

import importlib.util

import pytest
import torch

from sglang_patches.kernel_fallback import FALLBACK_ROOT


@pytest.fixture(scope="module")
def fallback():
    spec = importlib.util.spec_from_file_location(
        "picrag_fallback_sgl_kernel", FALLBACK_ROOT / "sgl_kernel" / "__init__.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_assign(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc):
    # SGLang's triton kernel semantics: request i's slots are the i-th consecutive run of
    # out_cache_loc, written to req_to_token[row_i, start_i:end_i].
    offset = 0
    for i in range(len(req_pool_indices)):
        row = int(req_pool_indices[i])
        for j in range(int(start_offset[i]), int(end_offset[i])):
            req_to_token[row, j] = out_cache_loc[offset]
            offset += 1


def test_assign_req_to_token_pool_matches_reference(fallback):
    gen = torch.Generator().manual_seed(0)
    pool = torch.zeros((8, 64), dtype=torch.int32)
    rows = torch.tensor([5, 1, 7], dtype=torch.int64)
    starts = torch.tensor([0, 13, 40], dtype=torch.int64)
    ends = torch.tensor([9, 14, 64], dtype=torch.int64)
    n = int((ends - starts).sum())
    slots = torch.randperm(1000, generator=gen)[:n].to(torch.int64)

    expected = pool.clone()
    reference_assign(rows, expected, starts, ends, slots)
    fallback.assign_req_to_token_pool_cpu(rows, pool, starts, ends, slots, pool.shape[1])
    assert torch.equal(pool, expected)
    assert int((pool != 0).sum()) == n


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer(fallback):
    layers = [torch.randn(16, 3, 4) for _ in range(3)]
    before = [t.clone() for t in layers]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t[0].numel() * t.element_size() for t in layers], dtype=torch.int64)
    tgt = torch.tensor([2, 9, 15])
    src = torch.tensor([4, 0, 7])
    fallback.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for now, old in zip(layers, before):
        expected = old.clone()
        expected[tgt] = old[src]
        assert torch.equal(now, expected)


def test_installed_module_is_not_shadowing_a_real_kernel():
    from sglang_patches.kernel_fallback import real_kernel_status

    origin = importlib.util.find_spec("sgl_kernel").origin
    ours = origin.startswith(str(FALLBACK_ROOT))
    # The stand-in is active exactly when no real sgl_kernel exists.
    assert ours == (real_kernel_status() == "missing")
