"""Which policies each model family may be served with, read from its config
(picrag_core.model_support), and the refusals the engine and the frontend both apply."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers

from picrag_core.link_hints import LinkHintError, LinkRequest, hints_of
from picrag_core.model_support import (BLEND_ARCHITECTURES, TESTED_ARCHITECTURES, ModelTraits, chunk_reuse_refusal,
                                       model_refusals)
from picrag_core.policies import POLICY_FAMILIES
from rag_server.linking.policy_resolver import NamedPolicy, PolicyResolver, PolicyUnavailable, engine_refusals
from picrag_core.attention_backends import FLASHINFER_BACKEND, NATIVE_BACKEND, model_backend_refusal
from sglang_patches.guard.request_guard import EngineSettings, RequestShape, admitted_link

CHUNK_FAMILIES = sorted(name for name, family in POLICY_FAMILIES.items() if family.reuses_chunks)


def traits(config_class: str, architecture: str, **fields) -> ModelTraits:
    config = getattr(transformers, config_class)(**fields).to_dict()
    return ModelTraits.of_config({**config, "architectures": [architecture]})


# (config class, architecture, fields, what is refused: None, "cacheblend" or "chunks")
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}, None),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, None),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, None),
    "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}}, None),
    "mistral-v0.3": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}, None),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, None),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {}, "cacheblend"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, "cacheblend"),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}, "cacheblend"),
    "mistral-v0.1": ("MistralConfig", "MistralForCausalLM", {}, "chunks"),  # sliding_window 4096
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}, "chunks"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}, "chunks"),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {}, "chunks"),
    "phi3.5-longrope": ("Phi3Config", "Phi3ForCausalLM", {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 48, "long_factor": [1.0] * 48,
        "original_max_position_embeddings": 4096}, "max_position_embeddings": 131072}, "chunks"),
    "bloom": ("BloomConfig", "BloomForCausalLM", {}, "chunks"),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_refuses_exactly_what_it_cannot_serve(name):
    config_class, architecture, fields, refused = FAMILIES[name]
    refusals = model_refusals(traits(config_class, architecture, **fields))
    expected = {None: [], "cacheblend": ["cacheblend"], "chunks": CHUNK_FAMILIES}[refused]
    assert sorted(refusals) == expected, refusals
    # prefix and full are SGLang's own: every model keeps them.
    assert "prefix" not in refusals and "full" not in refusals


def test_the_reasons_name_the_cause():
    assert "sliding-window" in chunk_reuse_refusal(traits("MistralConfig", "MistralForCausalLM"))
    assert "latent" in chunk_reuse_refusal(traits("DeepseekV3Config", "DeepseekV3ForCausalLM"))
    assert "no rotary" in chunk_reuse_refusal(traits("BloomConfig", "BloomForCausalLM"))
    cacheblend = model_refusals(traits("Olmo2Config", "Olmo2ForCausalLM"))["cacheblend"]
    assert "Olmo2ForCausalLM" in cacheblend and "layer hook" in cacheblend


def test_a_window_as_wide_as_the_context_is_no_window():
    assert traits("MistralConfig", "MistralForCausalLM", sliding_window=4096, max_position_embeddings=4096
                  ).sliding_window is None
    assert traits("Qwen2Config", "Qwen2ForCausalLM", sliding_window=1024).sliding_window is None  # not used
    assert traits("Qwen2Config", "Qwen2ForCausalLM", sliding_window=1024, use_sliding_window=True,
                  max_window_layers=0).sliding_window == 1024


def test_a_window_the_runtime_ignores_is_served_only_within_it():
    """SGLang's Llama classes attend over the whole context: Mistral v0.1 (window 4096, context
    32768) would be computed wrongly past its window, so it is served only with a context no wider
    than the window, where the window drops nothing and every family is exact."""
    mistral = {**transformers.MistralConfig().to_dict(), "architectures": ["MistralForCausalLM"]}
    refusal = model_backend_refusal(ModelTraits.of_config(mistral), FLASHINFER_BACKEND)
    assert "whole context" in refusal and "--context-length 4096" in refusal
    within = ModelTraits.of_config(mistral, context_length=4096)
    assert model_backend_refusal(within, NATIVE_BACKEND) is None and model_refusals(within) == {}
    # Gemma 3's SGLang class applies its windows: served whole, chunk reuse refused.
    gemma3 = traits("Gemma3TextConfig", "Gemma3ForCausalLM")
    assert model_backend_refusal(gemma3, FLASHINFER_BACKEND) is None
    assert sorted(model_refusals(gemma3)) == CHUNK_FAMILIES


def test_soft_capped_attention_is_served_only_where_the_backend_caps():
    gemma2 = traits("Gemma2Config", "Gemma2ForCausalLM")
    assert "soft-caps" in model_backend_refusal(gemma2, NATIVE_BACKEND)
    assert model_backend_refusal(gemma2, FLASHINFER_BACKEND) is None
    assert model_backend_refusal(traits("Qwen3Config", "Qwen3ForCausalLM"), NATIVE_BACKEND) is None


def test_a_model_the_runtime_would_compute_wrongly_is_not_served():
    moe = traits("Qwen3MoeConfig", "Qwen3MoeForCausalLM")
    assert "experts" in model_backend_refusal(moe, NATIVE_BACKEND)
    assert model_backend_refusal(moe, FLASHINFER_BACKEND) is None
    # SGLang's Llama classes read partial_rotary_factor at the config's top level only.
    nested = traits("Phi3Config", "Phi3ForCausalLM",
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75})
    assert "top level" in model_backend_refusal(nested, FLASHINFER_BACKEND)
    top_level = ModelTraits.of_config({**transformers.Phi3Config(partial_rotary_factor=0.75).to_dict(),
                                       "architectures": ["Phi3ForCausalLM"]})
    assert model_backend_refusal(top_level, NATIVE_BACKEND) is None


def test_the_tested_architectures_cover_the_blend_hook():
    assert BLEND_ARCHITECTURES <= TESTED_ARCHITECTURES


class _ModelConfig:
    """Stands for SGLang's ModelConfig: the transformers config, the served context and the
    vocabulary size."""

    def __init__(self, config: dict, context_len: int):
        self.hf_config = SimpleNamespace(to_dict=lambda: config)
        self.context_len = context_len
        self.vocab_size = config["vocab_size"]


def test_the_engine_refuses_a_family_the_model_forbids():
    config = {**transformers.MistralConfig().to_dict(), "architectures": ["MistralForCausalLM"]}
    engine = EngineSettings.of(1, NATIVE_BACKEND, _ModelConfig(config, 32768))
    hints = hints_of(LinkRequest.of("naive", [(2, 9)]))
    shape = RequestShape(prompt_len=12, max_new_tokens=4, namespaced=False)
    # SGLang validates each prompt of a batch with its own envelope: every form reaches this check.
    with pytest.raises(LinkHintError, match="sliding-window"):
        admitted_link(hints, shape, engine)
    assert admitted_link(hints_of(LinkRequest.of("prefix", [(2, 9)])), shape, engine).policy == "prefix"
    # Served with a context no wider than the window (4096), the window drops nothing.
    within = EngineSettings.of(1, NATIVE_BACKEND, _ModelConfig(config, 4096))
    assert admitted_link(hints, shape, within).policy == "naive"


def test_the_frontend_refuses_them_with_the_reason_and_falls_back_for_its_default():
    olmo2 = PolicyResolver.start(None, engine_refusals(NATIVE_BACKEND, "no checkpoint",
                                                       traits("Olmo2Config", "Olmo2ForCausalLM")))
    assert olmo2.default.name == "legolink"
    with pytest.raises(PolicyUnavailable, match="layer hook"):
        olmo2.resolve(NamedPolicy.parse("cacheblend"))
    assert olmo2.resolve(NamedPolicy.parse("legolink")).policy.name == "legolink"
    # A model that allows no chunk reuse is served with SGLang's own prefix cache by default.
    windowed = PolicyResolver.start(None, engine_refusals(NATIVE_BACKEND, None,
                                                          traits("MistralConfig", "MistralForCausalLM")))
    assert windowed.default.name == "prefix"
    menu = {entry["name"]: entry for entry in windowed.menu()}
    assert not menu["naive"]["available"] and "sliding-window" in menu["naive"]["reason"]


def test_cacherepair_trains_for_a_model_that_reuses_chunks_within_some_context(tmp_path):
    """A repair checkpoint is for a model whose chunks can be reused: refused for latent
    attention; accepted for Mistral v0.1, whose chunks are reused when it is served within its window."""
    import json

    from picrag_core.repair.config import ModelFolderError, read_hf_config

    for name, config_class, architecture in (("mla", "DeepseekV3Config", "DeepseekV3ForCausalLM"),
                                              ("window", "MistralConfig", "MistralForCausalLM")):
        (tmp_path / name).mkdir()
        config = {**getattr(transformers, config_class)().to_dict(), "architectures": [architecture]}
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match="latent"):
        read_hf_config(tmp_path / "mla")
    assert read_hf_config(tmp_path / "window")["sliding_window"] == 4096
