"""picrag's attention backends by name, and which link policies need them.

Families that compute tokens inside the prompt (their `position_masked` flag in
picrag_core.policies: LegoLink with k > 0, CacheBlend) need attention masked by true
position. picrag's backends do that; on any other backend such a request would attend to later
tokens, so the engine refuses it (sglang_patches.guard.request_guard) and the frontend reports the
policy as unavailable (rag_server/linking/policy_resolver.py), both with this reason.
"""

from __future__ import annotations

from typing import Optional

from picrag_core.model_support import ModelTraits, runtime_refusal
from picrag_core.policies import PolicyFamily

NATIVE_BACKEND = "picrag_native"  # CPU: sglang_patches.attention.native
FLASHINFER_BACKEND = "picrag_flashinfer"  # CUDA: sglang_patches.attention.flashinfer
POSITION_MASKED_BACKENDS = (NATIVE_BACKEND, FLASHINFER_BACKEND)


def backend_refusal(family: PolicyFamily, attention_backend: Optional[str]) -> Optional[str]:
    """Why `family` cannot run on `attention_backend`; None if it can."""
    if family.position_masked and attention_backend not in POSITION_MASKED_BACKENDS:
        return (f"it needs attention masked by true position, which the {attention_backend!r} attention "
                f"backend does not do (picrag's backends do: {', '.join(POSITION_MASKED_BACKENDS)})")
    return None


def model_backend_refusal(traits: ModelTraits, attention_backend: Optional[str]) -> Optional[str]:
    """Why the model cannot be served at all on `attention_backend`; None if it can."""
    refusal = runtime_refusal(traits)
    if refusal:
        return refusal
    if traits.routed_experts and attention_backend == NATIVE_BACKEND:
        # Checked on a tiny Qwen3-MoE: every logit came out equal (zero hidden states).
        return (f"the model routes tokens to experts ({traits.routed_experts} per layer), and SGLang 0.5.23's "
                "MoE on CPU (without sgl-kernel's CPU MoE ops) answers zero hidden states")
    if traits.attention_softcap and attention_backend == NATIVE_BACKEND:
        return (f"the model soft-caps attention logits (attn_logit_softcapping {traits.attention_softcap:g}), "
                f"which the {NATIVE_BACKEND} attention backend does not apply: its answers would be wrong "
                f"(on CUDA, {FLASHINFER_BACKEND} applies it)")
    return None
