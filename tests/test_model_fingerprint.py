"""The model fingerprint follows what determines the KV (weights' content, KV-relevant config
fields, KV dtype) and nothing else, so two conversions of one preset get one fingerprint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from picrag_core.model_fingerprint import model_fingerprint

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32",
    "num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 16, "hidden_act": "silu",
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "rms_norm_eps": 1e-5,
    "vocab_size": 10, "tie_word_embeddings": True, "max_position_embeddings": 64,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "transformers_version": "5.19.0", "bos_token_id": 1,
}


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(10, 8, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 8, generator=g),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(4, 8, generator=g),
        "model.norm.weight": torch.ones(8),
    }


def tiny_model(directory: Path, config: dict | None = None, tensors: dict | None = None, **json_options) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG if config is None else config, **json_options))
    save_file(weights() if tensors is None else tensors, directory / "model.safetensors")
    (directory / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    return directory


def fingerprint(directory: Path) -> str:
    return model_fingerprint(directory, torch.float32)


@pytest.fixture
def base(tmp_path) -> str:
    return fingerprint(tiny_model(tmp_path / "base"))


def test_every_weight_byte_counts_not_how_the_files_hold_them(tmp_path, base):
    tensors = weights()
    names = sorted(tensors)
    sharded = tiny_model(tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    # Two shards, each written in reverse name order, with metadata of their own.
    save_file({n: tensors[n] for n in reversed(names[:2])}, sharded / "model-00001-of-00002.safetensors",
              metadata={"format": "pt"})
    save_file({n: tensors[n] for n in reversed(names[2:])}, sharded / "model-00002-of-00002.safetensors")
    assert fingerprint(sharded) == base

    changed = weights()
    changed["model.layers.0.self_attn.v_proj.weight"][3, 7] += 1e-6
    assert fingerprint(tiny_model(tmp_path / "one-value", tensors=changed)) != base
    renamed = {n.replace("model.norm", "model.final_norm"): t for n, t in weights().items()}
    assert fingerprint(tiny_model(tmp_path / "renamed", tensors=renamed)) != base
    as_bf16 = {n: t.bfloat16() for n, t in weights().items()}
    assert fingerprint(tiny_model(tmp_path / "bf16", tensors=as_bf16)) != base


def test_a_tied_output_head_is_the_embedding(tmp_path, base):
    with_head = {**weights(), "lm_head.weight": torch.randn(10, 8)}
    assert fingerprint(tiny_model(tmp_path / "tied", tensors=with_head)) == base
    untied = {**CONFIG, "tie_word_embeddings": False}
    assert fingerprint(tiny_model(tmp_path / "untied", untied, with_head)) != fingerprint(
        tiny_model(tmp_path / "untied-other-head", untied, {**with_head, "lm_head.weight": torch.randn(10, 8)})
    )


def test_config_formatting_bookkeeping_and_tokenizer_do_not_count(tmp_path, base):
    reformatted = dict(reversed(list(CONFIG.items())))
    reformatted.update(transformers_version="4.46.0", _name_or_path="elsewhere", bos_token_id=7, use_cache=False)
    other = tiny_model(tmp_path / "other", reformatted, indent=4)
    (other / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0, "c": 1}}}')
    (other / "tokenizer_config.json").write_text('{"model_max_length": 12}')
    assert fingerprint(other) == base
    (other / "tokenizer.json").unlink()
    assert fingerprint(other) == base


def test_both_transformers_spellings_of_one_config_agree(tmp_path, base):
    older = {k: v for k, v in CONFIG.items() if k not in ("rope_parameters", "dtype")}
    older.update(rope_theta=10000.0, rope_scaling=None, torch_dtype="float32",
                 use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                 layer_types=["full_attention"])
    assert fingerprint(tiny_model(tmp_path / "older", older)) == base

    scaled_new = {**CONFIG, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}}
    scaled_old = {**older, "rope_scaling": {"type": "linear", "factor": 2.0}}
    scaled = fingerprint(tiny_model(tmp_path / "scaled-new", scaled_new))
    assert scaled != base
    assert fingerprint(tiny_model(tmp_path / "scaled-old", scaled_old)) == scaled


@pytest.mark.parametrize("field, value", [
    ("rope_parameters", {"rope_theta": 500000.0, "rope_type": "default"}),
    ("num_key_value_heads", 2), ("head_dim", 2), ("num_hidden_layers", 2), ("rms_norm_eps", 1e-6),
    ("hidden_act", "gelu"), ("architectures", ["MistralForCausalLM"]), ("tie_word_embeddings", False),
    ("dtype", "bfloat16"), ("sliding_window", 32),
])
def test_each_kv_relevant_config_field_counts(tmp_path, base, field, value):
    assert fingerprint(tiny_model(tmp_path / "changed", {**CONFIG, field: value})) != base


def test_the_kv_dtype_counts(tmp_path, base):
    assert model_fingerprint(tmp_path / "base", torch.bfloat16) != base


def test_pytorch_pickled_weights_are_hashed_by_content(tmp_path):
    model = tiny_model(tmp_path / "bin")
    (model / "model.safetensors").unlink()
    torch.save(weights(), model / "pytorch_model.bin")
    first = fingerprint(model)
    torch.save(dict(reversed(list(weights().items()))), model / "pytorch_model.bin")
    assert fingerprint(model) == first
    torch.save(weights(seed=1), model / "pytorch_model.bin")
    assert fingerprint(model) != first


def test_a_truncated_weights_file_is_refused(tmp_path):
    model = tiny_model(tmp_path / "truncated")
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated"):
        fingerprint(model)


def test_fingerprint_tracks_dtype_config_and_weights(tmp_path, default_model_dir):
    base = model_fingerprint(default_model_dir, torch.float32)
    assert model_fingerprint(default_model_dir, torch.float32) == base
    assert model_fingerprint(default_model_dir, torch.bfloat16) != base
    copy = tmp_path / "model"
    copy.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (copy / name).write_bytes((default_model_dir / name).read_bytes())
    (copy / "model.safetensors").symlink_to(default_model_dir / "model.safetensors")
    assert model_fingerprint(copy, torch.float32) == base
    config = (copy / "config.json").read_text().replace('"rope_theta": 100000.0', '"rope_theta": 10000.0')
    (copy / "config.json").write_text(config)
    assert model_fingerprint(copy, torch.float32) != base


@pytest.mark.slow
def test_two_fresh_conversions_of_a_preset_get_one_fingerprint(tmp_path, monkeypatch, default_model_dir):
    """The installed default model is one conversion; this is another, from scratch."""
    from picrag_core.model_store import DEFAULT_PRESET, ensure_model

    installed = model_fingerprint(default_model_dir, torch.float32)
    monkeypatch.setenv("PICRAG_HOME", str(tmp_path / "home"))
    folder = ensure_model(DEFAULT_PRESET)
    assert folder.is_relative_to(tmp_path / "home") and folder != default_model_dir
    converted = model_fingerprint(folder, torch.float32)
    shutil.rmtree(folder)  # ~540 MB
    assert converted == installed
