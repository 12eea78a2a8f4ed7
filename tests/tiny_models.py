"""Tiny random-weight models of every decoder family picrag's model matrix serves, made from
each family's transformers config (nothing is downloaded) with the default model's tokenizer.

Two layers of width 64 keep a runtime's start and a prompt's prefill to seconds; weights drawn
with a wide initializer make the next-token distribution peaked enough (top log-probability
about -1 rather than log(1 / vocab)) that a wrong KV moves the answer measurably.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2,
              tie_word_embeddings=True, initializer_range=0.3)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@dataclass(frozen=True)
class Family:
    config_class: str
    fields: dict[str, Any] = field(default_factory=dict)
    why: str = ""  # what this family adds to the matrix
    context_length: Optional[int] = None  # served with --context-length (None: the config's)


FAMILIES = {
    "llama3": Family("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512}}, "Llama 3.x: llama3 rope scaling"),
    "qwen2": Family("Qwen2Config", {}, "Qwen2/2.5: q/k/v biases"),
    "qwen3": Family("Qwen3Config", {"head_dim": 32}, "Qwen3: per-head q/k RMSNorm, head_dim apart from width"),
    "mistral": Family("MistralConfig", {"sliding_window": None}, "Mistral v0.2+: no window (SGLang's Llama classes)"),
    # partial_rotary_factor at the config's top level too, as Phi-4-mini's config.json has it
    # (SGLang reads it there; picrag_core.model_support refuses a config that nests it only).
    "phi3": Family("Phi3Config", {"partial_rotary_factor": 0.5},
                   "Phi-3/4: fused qkv and gate_up, partial rotary (Phi-4-mini's 0.75 kind)"),
    "olmo2": Family("Olmo2Config", {}, "OLMo 2: q/k norm over the whole projection, norms after the blocks"),
    # A window SGLang's Llama classes do not apply, so served no wider than it (picrag serve
    # refuses it otherwise), where every family is exact.
    "mistral-v0.1": Family("MistralConfig", {"sliding_window": 256},
                           "Mistral v0.1: a sliding window the runtime ignores, served within it", context_length=256),
    # Sliding-window layers SGLang applies (the prompt is longer than the window): served, its
    # chunk-reusing families refused with the reason.
    "gemma3": Family("Gemma3TextConfig", {"sliding_window": 16, "head_dim": 16, "query_pre_attn_scalar": 16,
                                          "layer_types": ["sliding_attention", "full_attention"]},
                     "Gemma 3: sliding-window layers, chunk reuse refused"),
    "granite": Family("GraniteConfig", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                        "attention_multiplier": 0.125, "logits_scaling": 2.0},
                      "Granite: embedding, residual, attention and logit multipliers"),
}


# Not served on CPU (picrag_core.model_support, picrag_core.attention_backends): `picrag
# serve` must refuse it at start with the reason.
REFUSED_ON_CPU = {
    "qwen3-moe": Family("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                           "moe_intermediate_size": 64}, "SGLang's CPU MoE answers zeros"),
}


def make_tiny_model(name: str, directory: Path, tokenizer_dir: Path) -> Path:
    """Writes family `name`'s tiny model (seeded weights, float32) into `directory`."""
    import torch
    import transformers

    family = FAMILIES.get(name) or REFUSED_ON_CPU[name]
    config = getattr(transformers, family.config_class)(**{**COMMON, **family.fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, directory)
    return Path(directory)
