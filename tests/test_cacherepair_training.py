"""CacheRepair offline half: network invariants, normalisation, checkpoints, real training pairs
from the default model, and a tiny training run through the `picrag repair` handlers."""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from safetensors.torch import load_file

from cache_repair import pairs as pairs_module
from picrag_core.repair.checkpoint import (
    RepairCheckpointError,
    RepairCheckpointMismatch,
    checkpoint_identity,
    load_repairer,
    save_checkpoint,
)
from picrag_core.file_digest import file_sha256
from cache_repair.cli import register
from picrag_core.repair.config import RepairConfig, read_token_embedding
from picrag_core.repair.network import KVRepairer, RepairNetwork
from picrag_core.repair.normalization import KVStats, KVStatsAccumulator
from cache_repair.pairs import (
    Pair,
    PairMaker,
    PairsError,
    generate_pairs,
    read_passages,
    rope_cos_sin,
    shard_paths,
)
from cache_repair.train import evaluate

torch.set_num_threads(1)

TINY = RepairConfig(num_layers=3, num_kv_heads=2, head_dim=8, embed_dim=12, vocab_size=40,
                    compress_dim=2, width=16, blocks=2, attn_heads=2, ffn_mult=2)


def tiny_inputs(tokens: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (tokens, TINY.num_layers, TINY.num_kv_heads, TINY.head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    token_ids = torch.randint(0, TINY.vocab_size, (tokens,), generator=g)
    chunk_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2][:tokens])
    return k, v, token_ids, chunk_ids


def tiny_network(randomise: bool) -> RepairNetwork:
    torch.manual_seed(0)
    network = RepairNetwork(TINY, torch.randn(TINY.vocab_size, TINY.embed_dim))
    if randomise:  # the zero-initialised projections and head hide the mask otherwise
        with torch.no_grad():
            for p in network.parameters():
                p.normal_(0, 0.3)
    return network


def tiny_stats() -> KVStats:
    shape = (TINY.num_layers, TINY.num_kv_heads, 2, TINY.head_dim)
    return KVStats(torch.rand(shape) + 0.5, torch.rand(shape) + 0.1)


def test_untrained_network_repairs_nothing():
    network = tiny_network(randomise=False)
    res_k, res_v = network(*tiny_inputs())
    assert torch.equal(res_k, torch.zeros_like(res_k)) and torch.equal(res_v, torch.zeros_like(res_v))
    raw_k, _ = KVRepairer(network, tiny_stats(), "fp").residual(*tiny_inputs())
    assert torch.equal(raw_k, torch.zeros_like(raw_k))


def test_inputs_computed_chunk_by_chunk_give_the_whole_sequences_residual():
    """Serving computes the network's per-token inputs for each chunk alone (and keeps them with
    the stored chunk): concatenated, they give what the network computes over the whole request."""
    repairer = KVRepairer(tiny_network(randomise=True), tiny_stats(), "fp")
    k, v, token_ids, chunk_ids = tiny_inputs()
    whole = repairer.residual(k, v, token_ids, chunk_ids)
    bounds = [(0, 3), (3, 6), (6, 9)]
    parts = [repairer.chunk_inputs(k[a:b], v[a:b], token_ids[a:b]) for a, b in bounds]
    assert all(part.hidden.shape == (3, TINY.width) for part in parts)
    for got, want in zip(repairer.residual_from(parts, chunk_ids), whole):
        assert want.abs().max() > 0.1
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_scales_folded_into_the_network_equal_normalising_around_it():
    # Serving passes raw KV and the statistics; training normalises around the network.
    network = tiny_network(randomise=True).eval()
    stats = tiny_stats()
    stats.delta_sigma[0] = 0.0  # a context-free layer: nothing to repair there
    k, v, token_ids, chunk_ids = tiny_inputs()
    with torch.no_grad():
        expected = stats.denormalise_residual(*network(*stats.normalise(k, v), token_ids, chunk_ids))
        folded = network(k, v, token_ids, chunk_ids, scales=stats)
    for got, want in zip(folded, expected):
        assert want.abs().max() > 0.1
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert torch.equal(got[:, 0], torch.zeros_like(got[:, 0]))


def test_chunks_see_themselves_and_earlier_chunks_only():
    network = tiny_network(randomise=True).eval()
    k, v, token_ids, chunk_ids = tiny_inputs()
    base_k, base_v = network(k, v, token_ids, chunk_ids)

    later = k.clone()
    later[6:] += 1.0  # chunk 2 only
    out_k, out_v = network(later, v, token_ids, chunk_ids)
    assert torch.allclose(out_k[:6], base_k[:6], atol=1e-6) and torch.allclose(out_v[:6], base_v[:6], atol=1e-6)
    assert not torch.allclose(out_k[6:], base_k[6:])

    same_chunk = v.clone()
    same_chunk[5] += 1.0  # last token of chunk 1: its first token sees it (bidirectional)
    out_k, _ = network(k, same_chunk, token_ids, chunk_ids)
    assert torch.allclose(out_k[:3], base_k[:3], atol=1e-6)
    assert not torch.allclose(out_k[3], base_k[3]) and not torch.allclose(out_k[6:], base_k[6:])

    other_token = token_ids.clone()
    other_token[8] = (other_token[8] + 1) % TINY.vocab_size
    out_k, _ = network(k, v, other_token, chunk_ids)
    assert torch.allclose(out_k[:6], base_k[:6], atol=1e-6) and not torch.allclose(out_k[6], base_k[6])


def test_smollm2_sized_network_has_a_few_million_parameters():
    config = RepairConfig(num_layers=30, num_kv_heads=3, head_dim=64, embed_dim=576, vocab_size=49152)
    count = RepairNetwork(config, torch.zeros(49152, 576)).trainable_parameters()
    print(f"SmolLM2-135M repair network: {count:,} trainable parameters")
    assert 1_000_000 <= count <= 5_000_000


def test_normalisation_round_trip_and_context_free_streams():
    g = torch.Generator().manual_seed(1)
    shape = (20, TINY.num_layers, TINY.num_kv_heads, TINY.head_dim)
    stale_k, stale_v = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g) * 0.2
    target_k, target_v = stale_k + torch.randn(shape, generator=g), stale_v + 0.1 * torch.randn(shape, generator=g)
    target_k[:, 0], target_v[:, 0] = stale_k[:, 0], stale_v[:, 0]  # layer 0: context-free
    accumulator = KVStatsAccumulator()
    for part in (slice(0, 7), slice(7, 20)):  # streaming in two pieces
        accumulator.add(stale_k[part], stale_v[part], target_k[part], target_v[part])
    stats = accumulator.finish()
    assert stats.stale_rms.shape == (TINY.num_layers, TINY.num_kv_heads, 2, TINY.head_dim)
    assert torch.allclose(stats.stale_rms[:, :, 0], stale_k.square().mean(0).sqrt())

    norm_k, norm_v = stats.normalise(stale_k, stale_v)
    assert torch.allclose(norm_k * stats.stale_rms[:, :, 0], stale_k, atol=1e-5)
    assert torch.allclose(norm_v.square().mean(0), torch.ones_like(norm_v[0]), atol=1e-4)

    delta_k, delta_v = stats.normalise_delta(target_k - stale_k, target_v - stale_v)
    back_k, back_v = stats.denormalise_residual(delta_k, delta_v)
    assert torch.allclose(back_k, target_k - stale_k, atol=1e-5) and torch.allclose(back_v, target_v - stale_v, atol=1e-6)
    assert torch.equal(stats.delta_sigma[0], torch.zeros_like(stats.delta_sigma[0]))
    assert (stats.delta_sigma[1:] > 0).all()


def test_checkpoint_round_trip_and_refusals(tmp_path):
    network, stats = tiny_network(randomise=True), tiny_stats()
    embedding = network.embedding.clone()
    save_checkpoint(tmp_path, network, TINY, stats, "fingerprint-a", {"steps": 3})
    assert "embedding" not in load_file(tmp_path / "weights.safetensors")
    document = json.loads((tmp_path / "config.json").read_text())
    assert document["model_fingerprint"] == "fingerprint-a" and document["training"] == {"steps": 3}

    repairer = load_repairer(tmp_path, embedding, "fingerprint-a")
    assert repairer.config == TINY and repairer.fingerprint == "fingerprint-a"
    expected = KVRepairer(network, stats, "fingerprint-a").residual(*tiny_inputs())
    for got, want in zip(repairer.residual(*tiny_inputs()), expected):
        assert torch.equal(got, want)

    with pytest.raises(RepairCheckpointMismatch) as mismatch:
        load_repairer(tmp_path, embedding, "fingerprint-b")
    assert "fingerprint-a" in str(mismatch.value) and "fingerprint-b" in str(mismatch.value)
    with pytest.raises(RepairCheckpointError, match="no CacheRepair checkpoint"):
        load_repairer(tmp_path / "missing", embedding, "fingerprint-a")
    with pytest.raises(RepairCheckpointError, match="embedding"):
        load_repairer(tmp_path, torch.zeros(7, TINY.embed_dim), "fingerprint-a")

    (tmp_path / "config.json").write_text(json.dumps({**document, "width": 32, "attn_heads": 2}))
    with pytest.raises(RepairCheckpointError, match="does not match its config"):
        load_repairer(tmp_path, embedding, "fingerprint-a")
    (tmp_path / "config.json").write_text(json.dumps(document))
    (tmp_path / "weights.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RepairCheckpointError, match="corrupt"):
        load_repairer(tmp_path, embedding, "fingerprint-a")


def test_checkpoint_identity_names_the_weights_that_ran(tmp_path):
    save_checkpoint(tmp_path / "a", tiny_network(randomise=True), TINY, tiny_stats(), "fp", {"steps": 3})
    identity = checkpoint_identity(tmp_path / "a")
    assert identity == {"path": str((tmp_path / "a").resolve()),
                        "weights_sha256": file_sha256(tmp_path / "a" / "weights.safetensors"),
                        "width": TINY.width, "blocks": TINY.blocks, "compress_dim": TINY.compress_dim,
                        "training_steps": 3}
    # A second training into the same folder differs only in its weights, and the record says so.
    save_checkpoint(tmp_path / "a", tiny_network(randomise=False), TINY, tiny_stats(), "fp", {"steps": 3})
    assert checkpoint_identity(tmp_path / "a")["weights_sha256"] != identity["weights_sha256"]
    with pytest.raises(RepairCheckpointError, match="no CacheRepair checkpoint"):
        checkpoint_identity(tmp_path / "missing")


def test_scaled_rope_is_refused():
    config = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 32,
              "rope_parameters": {"rope_theta": 1e4, "rope_type": "llama3"}}
    with pytest.raises(PairsError, match="llama3"):
        rope_cos_sin(config)
    config["rope_parameters"] = {"rope_theta": 1e4, "rope_type": "default"}
    cos_sin, rotary_dim = rope_cos_sin(config)
    assert rotary_dim == 16 and cos_sin.shape == (32, 16)


# --- the real default model -------------------------------------------------------------

@pytest.fixture(scope="module")
def maker(default_model_dir) -> PairMaker:
    return PairMaker(default_model_dir)


@pytest.fixture(scope="module")
def real_pair(maker, shared_qa) -> Pair:
    passages = read_passages(shared_qa / "nq_open_oracle.train.jsonl")[:2]
    return maker.make_pair([maker.passage_ids(p, 16) for p in passages])


@pytest.mark.slow
def test_real_pair_shapes_and_context_free_layer_zero(maker, real_pair):
    config = maker.config
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (30, 3, 64)
    tokens = real_pair.tokens
    assert 20 <= tokens <= 32
    for name in ("stale_k", "stale_v", "target_k", "target_v"):
        assert getattr(real_pair, name).shape == (tokens, 30, 3, 64)
    assert real_pair.chunk_ids.tolist() == sorted(real_pair.chunk_ids.tolist()) and real_pair.chunk_ids[-1] == 1
    # Layer 0 sees no context: derotated K (and V) match although the positions differ.
    assert torch.allclose(real_pair.stale_k[:, 0], real_pair.target_k[:, 0], atol=1e-4)
    assert torch.allclose(real_pair.stale_v[:, 0], real_pair.target_v[:, 0], atol=1e-4)
    for layer in (5, 29):
        gap = (real_pair.stale_k[:, layer] - real_pair.target_k[:, layer]).norm()
        assert gap > 0.05 * real_pair.target_k[:, layer].norm()


@pytest.mark.slow
def test_passages_are_cut_at_word_boundaries(maker, shared_qa):
    passage = read_passages(shared_qa / "nq_open_oracle.train.jsonl")[0]
    ids = maker.passage_ids(passage, 16)
    assert len(ids) <= 16 and maker.tokenizer.decode(ids).endswith("\n\n")


def repair_cli(*args: object) -> int:
    parser = argparse.ArgumentParser(prog="picrag")
    register(parser.add_subparsers(dest="command", required=True))
    namespace = parser.parse_args([str(a) for a in (*args, "--threads", 1)])
    return namespace.func(namespace)


@pytest.mark.slow
def test_tiny_pairs_train_and_eval(maker, default_model_dir, shared_qa, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pairs_module, "PairMaker", lambda model_dir: maker)
    out, data = tmp_path / "pairs", shared_qa / "nq_open_oracle.train.jsonl"
    generate_pairs(out, default_model_dir, groups=1, val_groups=1, seed=3, max_passage_tokens=16, data=data)
    train_paths = shard_paths(out, "train")
    assert len(train_paths) == 1 and len(shard_paths(out, "val")) == 1
    manifest = json.loads((out / "manifest.json").read_text())
    used = {split: {p for group in manifest["groups"][split] for p in group} for split in ("train", "val")}
    assert not used["train"] & used["val"]

    # Resumable: a second run finds every shard and prefills nothing.
    monkeypatch.setattr(maker, "make_pair", lambda ids: pytest.fail("recomputed an existing shard"))
    generate_pairs(out, default_model_dir, groups=1, val_groups=1, seed=3, max_passage_tokens=16, data=data)
    with pytest.raises(PairsError, match="seed"):
        generate_pairs(out, default_model_dir, groups=1, val_groups=1, seed=4, max_passage_tokens=16, data=data)

    checkpoint = tmp_path / "checkpoint"
    train_args = ("repair", "train", "--pairs", out, "--out", checkpoint, "--steps", 40, "--warmup", 5,
                  "--val-every", 20, "--width", 32, "--blocks", 1, "--compress-dim", 2, "--lr", 3e-3)
    assert repair_cli(*train_args) == 0
    summary = json.loads((checkpoint / "config.json").read_text())["training"]
    assert summary["steps"] == 40 and summary["val_relative_error"]["relative_k"][0] is None
    assert json.loads((checkpoint / "config.json").read_text())["compress_dim"] == 2

    from picrag_core.model_fingerprint import model_fingerprint

    embedding = read_token_embedding(default_model_dir)
    repairer = load_repairer(checkpoint, embedding, model_fingerprint(default_model_dir, torch.float32))
    untrained = RepairNetwork(repairer.config, embedding)
    before = evaluate(untrained, repairer.stats, train_paths)
    after = evaluate(repairer.network, repairer.stats, train_paths)
    with capsys.disabled():
        print(f"tiny training: train loss {before.loss:.4f} -> {after.loss:.4f}, "
              f"relative K error {before.overall_k:.3f} -> {after.overall_k:.3f}")
    assert before.overall_k == pytest.approx(1.0) and after.loss < 0.9 * before.loss

    assert repair_cli("repair", "train", "--pairs", out, "--out", checkpoint, "--steps", 40) == 1
    assert "--resume" in capsys.readouterr().err
    assert repair_cli(*train_args, "--resume", "--seed", 1) == 1
    assert "seed" in capsys.readouterr().err
    assert repair_cli(*train_args, "--resume") == 0  # finished: the saved state at step 40 is final
    resumed = load_repairer(checkpoint, embedding, repairer.fingerprint)
    assert torch.equal(resumed.network.head.weight, repairer.network.head.weight)

    # `evaluate` above ran the network in float32, as it is served and as the command does by default.
    assert repair_cli("repair", "eval", "--pairs", out, "--checkpoint", checkpoint, "--split", "train") == 0
    report = json.loads((checkpoint / "eval_train.json").read_text())
    assert report["precision"] == "float32"
    assert report["overall_k"] == pytest.approx(after.overall_k) and len(report["relative_v"]) == 30
    # Per group: every shard once, with its tokens and loss; the overall loss is their weighted mean.
    groups = report["per_group"]
    assert [g["group"] for g in groups] == [p.name for p in train_paths]
    assert sum(g["tokens"] for g in groups) == report["tokens"]
    assert report["loss"] == pytest.approx(groups[0]["loss"]) and len(groups) == 1
    assert "layer  K before" in capsys.readouterr().out


@pytest.mark.slow
def test_the_recipe_runs_on_a_newly_covered_family(default_model_dir, shared_qa, tmp_path, capsys):
    """`picrag repair pairs / train / eval` on a tiny Qwen3 (q/k norms, head_dim apart from the
    width): the checkpoint trains, evaluates, and loads only for the model it was made on."""
    from picrag_core.model_fingerprint import model_fingerprint
    from picrag_core.repair.checkpoint import RepairCheckpointMismatch
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model("qwen3", tmp_path / "qwen3", default_model_dir)
    pairs, checkpoint = tmp_path / "pairs", tmp_path / "checkpoint"
    assert repair_cli("repair", "pairs", "--out", pairs, "--model", model, "--groups", 2, "--val-groups", 1,
                      "--max-passage-tokens", 32, "--data", shared_qa / "nq_open_oracle.train.jsonl") == 0
    assert repair_cli("repair", "train", "--pairs", pairs, "--out", checkpoint, "--model", model, "--steps", 20,
                      "--warmup", 2, "--val-every", 10, "--width", 32, "--blocks", 1) == 0
    assert repair_cli("repair", "eval", "--pairs", pairs, "--checkpoint", checkpoint, "--model", model) == 0
    report = json.loads((checkpoint / "eval_val.json").read_text())
    assert len(report["relative_k"]) == 2  # the tiny model's two layers
    embedding = read_token_embedding(model)
    assert load_repairer(checkpoint, embedding, model_fingerprint(model, torch.float32)).config.head_dim == 32
    with pytest.raises(RepairCheckpointMismatch):
        load_repairer(checkpoint, embedding, model_fingerprint(default_model_dir, torch.float32))
    capsys.readouterr()
