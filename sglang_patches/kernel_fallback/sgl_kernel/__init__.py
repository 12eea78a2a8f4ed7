"""picrag's pure-torch stand-in for `sgl_kernel` on CPUs without the real CPU build.

SGLang 0.5.23's CPU path imports two functions from `sgl_kernel` (the real CPU build is
source-only AVX-512/AMX code; the PyPI `sglang-kernel` wheel needs libcuda). This module
implements exactly those two in plain torch. It is put on sys.path by a .pth file only where
no real `sgl_kernel` imports (see sglang_patches.kernel_fallback), and .pth entries come after
site-packages, so a real `sgl_kernel` installed later still wins.
"""

import ctypes

import torch

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


def _needs_real_kernel(name: str):
    def unsupported(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in picrag's pure-torch fallback: speculative "
            "decoding on CPU needs SGLang's real CPU kernel build (sgl-kernel from source)"
        )

    unsupported.__name__ = name
    return unsupported


# Imported unconditionally by SGLang's speculative-decoding modules on CPU, called only when
# speculative decoding is enabled, which picrag does not do on CPU.
build_tree_kernel_efficient_cpu = _needs_real_kernel("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _needs_real_kernel("verify_tree_greedy_cpu")
fill_accept_out_cache_loc_cpu = _needs_real_kernel("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _needs_real_kernel("fill_bonus_tokens_cpu")
assign_draft_cache_locs_contiguous_cpu = _needs_real_kernel("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _needs_real_kernel("assign_extend_cache_locs_cpu")
