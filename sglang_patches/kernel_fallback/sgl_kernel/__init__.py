"""picrag's pure-torch stand-in for `sgl_kernel`, where no real build imports.

SGLang 0.5.23's CPU path imports two functions from `sgl_kernel` (the real CPU build is
source-only AVX-512/AMX code; the PyPI `sglang-kernel` wheel needs libcuda). This module
implements exactly those two in plain torch. On CUDA (the lent GPU, whose torch 2.11 the
`sglang-kernel` wheel, built for torch 2.14, does not load against) SGLang imports many more
names: the element-wise ops its Llama/Qwen-style layers call are here in torch
(sgl_kernel/elementwise.py), every other name is a stand-in that fails when called, naming the
op (sgl_kernel/_unavailable.py). It is put on sys.path by a .pth file only where no real
`sgl_kernel` imports (see sglang_patches.kernel_fallback), and .pth entries come after
site-packages, so a real `sgl_kernel` installed later still wins.
"""

import ctypes

import torch

# Absolute imports through picrag's package: tests load this file on its own, outside a package.
from sglang_patches.kernel_fallback.sgl_kernel._unavailable import TOP_LEVEL, stand_ins
from sglang_patches.kernel_fallback.sgl_kernel.elementwise import (  # noqa: F401 - sgl_kernel's API
    fused_add_rmsnorm,
    gelu_and_mul,
    gelu_quick,
    gelu_tanh_and_mul,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    rmsnorm,
    silu_and_mul,
)

__version__ = "0.0.0+picrag.fallback"
PICRAG_FALLBACK = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[row_i, start_i:end_i] = the i-th request's run of out_cache_loc."""
    del pool_len  # the real kernel takes the row stride; torch indexing knows it already
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + n].to(req_to_token.dtype)
        taken += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every pool buffer (raw base pointer + row stride in bytes) copy row src -> row tgt."""
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in zip(tgt_loc.tolist(), src_loc.tolist()):
            ctypes.memmove(ptr + tgt * stride, ptr + src * stride, stride)


globals().update(stand_ins("sgl_kernel", TOP_LEVEL))
