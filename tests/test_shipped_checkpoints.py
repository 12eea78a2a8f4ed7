"""The CacheRepair checkpoints shipped in cache_repair/checkpoints: each loads on the model preset
it was trained on (converted here on a fresh install), and the default one keeps its accuracy in
bfloat16. No server: these run beside the shared server's group, not inside it."""

from __future__ import annotations

import pytest
import torch


def shipped_checkpoints() -> list:
    """One case per folder under cache_repair/checkpoints; the default preset is converted by
    setup, any other is converted here (once per install: ensure_model keeps the folder)."""
    from rag_server.launch.repair_checkpoint import SHIPPED_DIR
    from picrag_core.model_store import DEFAULT_PRESET

    return [pytest.param(path.name, id=path.name, marks=() if path.name == DEFAULT_PRESET else pytest.mark.slow)
            for path in sorted(SHIPPED_DIR.iterdir()) if path.is_dir()]


@pytest.mark.parametrize("preset", shipped_checkpoints())
def test_every_shipped_checkpoint_loads_on_its_converted_preset(preset):
    from safetensors import safe_open

    from rag_server.launch.repair_checkpoint import SHIPPED_DIR, choose_repair_checkpoint
    from picrag_core.model_fingerprint import model_fingerprint
    from picrag_core.model_store import PRESETS, ensure_model
    from picrag_core.repair.checkpoint import STATS_FILE, WEIGHTS_FILE, load_repairer
    from picrag_core.repair.config import read_token_embedding

    assert preset in PRESETS, "a shipped checkpoint is named after the preset it was trained on"
    model = ensure_model(preset)
    shipped = SHIPPED_DIR / preset
    assert choose_repair_checkpoint(model, None) == (shipped, None)
    fingerprint = model_fingerprint(model, torch.float32)
    repairer = load_repairer(shipped, read_token_embedding(model), fingerprint)
    assert repairer.network.head.weight.abs().sum() > 0  # trained, not the zero initialisation
    for name in (WEIGHTS_FILE, STATS_FILE):
        with safe_open(shipped / name, "pt") as f:
            assert f.metadata()["model_fingerprint"] == fingerprint


def test_the_default_checkpoint_in_bfloat16_stays_within_a_percent_or_two_of_float32(default_model_dir):
    """`picrag repair eval --bfloat16` runs the network's products in bfloat16 (serving stays in
    float32): they stay close."""
    from picrag_core.repair.network import in_precision
    from rag_server.launch.repair_checkpoint import SHIPPED_DIR
    from picrag_core.model_fingerprint import model_fingerprint
    from picrag_core.model_store import DEFAULT_PRESET
    from picrag_core.repair.checkpoint import load_repairer
    from picrag_core.repair.config import read_token_embedding

    repairer = load_repairer(SHIPPED_DIR / DEFAULT_PRESET, read_token_embedding(default_model_dir),
                             model_fingerprint(default_model_dir, torch.float32))
    generator = torch.Generator().manual_seed(0)
    tokens, config = 300, repairer.config
    shape = (tokens, config.num_layers, config.num_kv_heads, config.head_dim)
    # Stale KV on the scale the network was trained on: unit-variance streams times their RMS.
    stale_k = torch.randn(shape, generator=generator) * repairer.stats.stale_rms[:, :, 0]
    stale_v = torch.randn(shape, generator=generator) * repairer.stats.stale_rms[:, :, 1]
    token_ids = torch.randint(0, config.vocab_size, (tokens,), generator=generator)
    chunk_ids = torch.arange(tokens) // 60
    results = {}
    for precision in (torch.float32, torch.bfloat16):
        with in_precision(torch.device("cpu"), precision):
            results[precision] = repairer.residual(stale_k, stale_v, token_ids, chunk_ids)
    for exact, fast in zip(results[torch.float32], results[torch.bfloat16]):
        assert (exact.dtype, fast.dtype) == (torch.float32, torch.bfloat16)
        assert exact.norm() > 0
        assert (fast.float() - exact).norm() / exact.norm() < 0.02
