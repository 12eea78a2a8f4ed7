"""Named stand-ins for the `sgl_kernel` functions picrag's fallback does not implement.

On CUDA, SGLang 0.5.23 imports about a hundred `sgl_kernel` names at module level behind
platform checks (`if _is_cuda:`), for models, quantizations and features picrag does not use on
the device (MLA, MoE, FP8, speculative decoding, host KV offload). The imports must succeed for
SGLang to start; a call must fail loudly, naming the op, rather than compute something else.
tests/test_kernel_fallback.py checks that these lists cover every such import of the installed
SGLang.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NoReturn


def unavailable(qualified_name: str) -> Callable[..., NoReturn]:
    def call(*_args, **_kwargs) -> NoReturn:
        raise NotImplementedError(
            f"{qualified_name} is not in picrag's pure-torch sgl_kernel fallback: the path that called it needs "
            "SGLang's real sglang-kernel build"
        )

    call.__name__ = qualified_name.rsplit(".", 1)[-1]
    call.__qualname__ = call.__name__
    return call


def stand_ins(module: str, names: Iterable[str]) -> dict[str, Callable[..., NoReturn]]:
    return {name: unavailable(f"{module}.{name}") for name in names}


# Imported at module level, behind platform checks, by SGLang 0.5.23 (sglang/srt, sglang/kernels).
TOP_LEVEL = (
    "apply_token_bitmask_inplace_cuda", "awq_dequantize", "build_tree_kernel_efficient", "compress_norm_rope_store",
    "concat_mla_k", "cutlass_w4a8_moe_mm", "es_fp8_blockwise_scaled_grouped_mm",
    "es_sm100_mxfp8_blockscaled_grouped_mm", "es_sm100_mxfp8_blockscaled_grouped_quant",
    "flash_compress128_decode", "flash_compress128_prefill", "flash_compress4_decode", "flash_compress4_prefill",
    "flash_mla_decode", "flash_mla_decode_get_workspace_size", "flash_mla_prefill",
    "flash_mla_prefill_get_workspace_size", "fp8_blockwise_scaled_grouped_mm", "fp8_mqa_logits",
    "fp8_paged_mqa_logits", "fused_inplace_qknorm_rope", "fused_k_norm_rope_flashmla", "fused_q_norm_rope",
    "fused_qk_rope_with_cos_sin_cache_inplace", "gdn_attention", "get_cutlass_w4a8_moe_mm_data", "infllmv2_attn_stage1",
    "int8_scaled_mm", "load_cache_to_device_buffer_dsv4_mla", "load_cache_to_device_buffer_mla",
    "max_pooling_1d_varlen", "merge_state_v2", "min_p_sampling_from_probs", "moe_sum", "moe_sum_reduce",
    "multimodal_rotary_embedding", "plan_compress_decode", "plan_compress_decode_legacy", "plan_compress_prefill",
    "plan_compress_prefill_legacy", "rotate_input_ids_cpu", "sgl_per_tensor_quant_fp8", "sgl_per_token_quant_fp8",
    "shuffle_rows", "store_cache_xpu", "top_k_renorm_prob", "top_k_top_p_sampling_from_probs", "top_p_renorm_prob",
    "topk_sigmoid", "topk_softmax", "transfer_cache_dsv4_mla", "tree_speculative_sampling_target_only",
    "weak_ref_tensor",
    # Speculative decoding on CPU (imported unconditionally there; picrag does not decode speculatively)
    "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu", "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "verify_tree_greedy_cpu",
)
SUBMODULES = {
    "allreduce": (),  # star-imported by the custom all-reduce (tensor parallelism only)
    "flash_attn": ("flash_attn_varlen_func", "flash_attn_with_kvcache"),
    "kvcacheio": (
        "transfer_embedding_ranges_direct", "transfer_kv_all_layer", "transfer_kv_all_layer_direct_lf_pf",
        "transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_lf_ph", "transfer_kv_all_layer_mla",
        "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_direct", "transfer_kv_per_layer",
        "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf",
        "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf",
    ),
    "mamba": ("causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu"),
    "quantization": ("ggml_dequantize", "ggml_moe_a8", "ggml_moe_a8_vec", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8"),
    "scalar_type": ("ScalarType",),
    "speculative": ("reconstruct_indices_from_tree_mask",),
    "utils": ("is_arch_support_pdl",),
}
