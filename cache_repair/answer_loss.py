"""The answer-aware term: how differently the frozen LLM reads the question on repaired KV.

Serving a `cacherepair` request gives the model the head's exact KV (a cached prefix), the
repaired chunk KV (stale + residual in RoPE-free coordinates, keys then rotated to each
token's prompt position, `sglang_patches.steps.kv_repair`) and computes the question on top.
`FrozenReader.question_logits` does exactly that in plain transformers (fp32), with autograd
on: the LLM's parameters are frozen, so the gradient of a loss on its logits reaches the
repair network through the KV alone. The teacher is the joint prefill's logits over the same
question positions, stored with every serving-shaped pair.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from cache_repair.pairs import rope_cos_sin
from picrag_core.repair.config import read_hf_config
from picrag_core.rope_shift import KeyShifter


class FrozenReader:
    def __init__(self, model_dir: Path, head_ids: list[int]):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.requires_grad_(False)
        hf_config = read_hf_config(model_dir)
        cos_sin, rotary_dim = rope_cos_sin(hf_config)
        head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
        self.shifter = KeyShifter(cos_sin, head_dim, rotary_dim, is_neox_style=True)
        with torch.no_grad():
            cache = self.model.model(input_ids=torch.tensor([head_ids]), use_cache=True).past_key_values
        # Per layer [1, H, head, D], keys after RoPE: what the prefix cache holds at serving time.
        self.head_kv = [(layer.keys, layer.values) for layer in cache.layers]
        self.head_tokens = len(head_ids)

    def question_logits(self, chunk_k: torch.Tensor, chunk_v: torch.Tensor, question_ids: torch.Tensor
                        ) -> torch.Tensor:
        """fp32 logits [Q, vocab] at the question's positions, read on [head][chunks] where the
        chunks' KV is chunk_k (RoPE-free) and chunk_v [T, L, H, D], at positions right after
        the head. Differentiable in chunk_k and chunk_v."""
        from transformers import DynamicCache

        tokens, layers, heads, dim = chunk_k.shape
        positions = torch.arange(self.head_tokens, self.head_tokens + tokens)
        keys = self.shifter.rotate(chunk_k.reshape(tokens, layers * heads, dim),
                                   self.shifter.rotation(positions, chunk_k)).view(tokens, layers, heads, dim)
        # unbind, not one index per layer: each indexing's backward would fill a whole
        # [T, L, H, D] gradient with zeros, once per layer.
        per_layer = zip(self.head_kv, keys.permute(1, 2, 0, 3).unbind(0), chunk_v.permute(1, 2, 0, 3).unbind(0))
        cache = DynamicCache(ddp_cache_data=[
            (torch.cat((head_k, k[None]), dim=2), torch.cat((head_v, v[None]), dim=2))
            for (head_k, head_v), k, v in per_layer
        ])
        start = self.head_tokens + tokens
        position_ids = torch.arange(start, start + len(question_ids))[None]
        output = self.model(input_ids=question_ids[None], past_key_values=cache, position_ids=position_ids)
        return output.logits[0].float()


def answer_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, positions: int = 1) -> torch.Tensor:
    """Mean KL(teacher || student) over the whole vocabulary at the last `positions` prompt
    positions (1: the first answer token only; 0: every question position)."""
    rows = slice(-positions, None) if positions else slice(None)
    teacher = F.log_softmax(teacher_logits[rows].float(), dim=-1)
    student = F.log_softmax(student_logits[rows], dim=-1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()
