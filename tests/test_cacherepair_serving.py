"""CacheRepair served in the chunk cache: residuals land on the grafted slots, rotated to their
positions; a zero-initialised network is exactly naive; checkpoints for other models are refused."""

from __future__ import annotations

import pytest
import torch

from sglang_patches.steps.kv_repair import RepairPart, RepairSpan, repair_spans
from picrag_core.repair.network import ChunkInputs
from picrag_core.rope_shift import KeyShifter
from rag_server.bench.transparency import TOLERANCE
from tests.chunk_requests import (assert_same_answer, counters, passages_of, picrag_meta,
                                 question_tokens, run)

LAYERS, HEADS, DIM = 2, 2, 8


class FakePool:
    start_layer, layer_num = 0, LAYERS

    def __init__(self, slots: int):
        generator = torch.Generator().manual_seed(0)
        self.k = [torch.randn(slots, HEADS, DIM, generator=generator) for _ in range(LAYERS)]
        self.v = [torch.randn(slots, HEADS, DIM, generator=generator) for _ in range(LAYERS)]

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


class ConstantRepairer:
    """Residual = token id / 100 everywhere: easy to predict, different per token; in `dtype`,
    as a network served in bfloat16 returns it."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.stale_seen: list[torch.Tensor] = []  # each chunk's RoPE-free stale K, as its inputs were computed

    def chunk_inputs(self, stale_k, stale_v, token_ids):
        self.stale_seen.append(stale_k.clone())
        return ChunkInputs(token_ids.float()[:, None], torch.zeros(1, len(token_ids), 1))

    def residual_from(self, inputs, chunk_ids):
        hidden = ChunkInputs.cat(inputs).hidden[:, 0]
        self.seen = (hidden.long(), chunk_ids.clone())
        res = (hidden / 100)[:, None, None, None].expand(len(hidden), LAYERS, HEADS, DIM)
        return res.to(self.dtype), (2 * res).to(self.dtype)


def rope_shifter() -> KeyShifter:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    angles = torch.outer(torch.arange(64).float(), inv_freq)
    return KeyShifter(torch.cat((angles.cos(), angles.sin()), dim=-1), DIM, DIM, is_neox_style=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repair_writes_rotated_residuals_on_grafted_slots_only(dtype):
    pool, shifter, repairer = FakePool(32), rope_shifter(), ConstantRepairer(dtype)
    context = RepairSpan(torch.tensor([0, 1, 2]), [7, 8, 9], position=4)
    # Grafted as two runs (a reordered prompt recomputes tokens between them): tokens 1 and 2-3.
    grafted = RepairSpan(torch.tensor([3, 4, 5, 6]), [10, 11, 12, 13], position=7,
                         parts=[RepairPart(1, 1, torch.tensor([20])), RepairPart(2, 2, torch.tensor([21, 22]))])
    before_k = [k.clone() for k in pool.k]
    before_v = [v.clone() for v in pool.v]
    assert repair_spans(repairer, pool, shifter, [context, grafted]) == 3
    token_ids, chunk_ids = repairer.seen
    stale_k = torch.cat(repairer.stale_seen)
    assert token_ids.tolist() == [7, 8, 9, 10, 11, 12, 13] and chunk_ids.tolist() == [0, 0, 0, 1, 1, 1, 1]
    # The network sees RoPE-free keys: stored keys rotated back by their local positions.
    torch.testing.assert_close(stale_k[3:, 0], shifter.shift_each(before_k[0][[3, 4, 5, 6]], -torch.arange(4)))
    for layer in range(LAYERS):
        for row, slot in enumerate([20, 21, 22]):
            token, position = 11 + row, 8 + row
            res = torch.full((1, HEADS, DIM), token / 100).to(dtype).float()
            expected_k = before_k[layer][slot] + shifter.shift(res, position)[0]
            torch.testing.assert_close(pool.k[layer][slot], expected_k)
            torch.testing.assert_close(pool.v[layer][slot], before_v[layer][slot] + 2 * res[0])
        untouched = [s for s in range(32) if s not in (20, 21, 22)]
        assert torch.equal(pool.k[layer][untouched], before_k[layer][untouched])


def test_kept_inputs_repair_exactly_like_inputs_computed_from_the_stored_kv():
    """A chunk linked again brings the inputs its first link computed: nothing of its KV is read
    for them, and the repaired KV is bit for bit the same (ChunkRadixCache keeps them per node)."""
    def spans():
        return [RepairSpan(torch.tensor([0, 1, 2]), [7, 8, 9], position=4, parts=[RepairPart(0, 3, torch.tensor([20, 21, 22]))]),
                RepairSpan(torch.tensor([3, 4]), [10, 11], position=7, parts=[RepairPart(0, 2, torch.tensor([23, 24]))])]

    first_pool, second_pool, shifter = FakePool(32), FakePool(32), rope_shifter()
    computing, reusing = ConstantRepairer(), ConstantRepairer()
    first = spans()
    assert repair_spans(computing, first_pool, shifter, first) == 5
    assert len(computing.stale_seen) == 2 and all(span.inputs is not None for span in first)
    second = spans()
    for kept, span in zip(first, second):
        span.inputs = kept.inputs
    assert repair_spans(reusing, second_pool, shifter, second) == 5
    assert reusing.stale_seen == []  # no chunk's KV read again
    assert all(torch.equal(a, b) for a, b in zip(first_pool.k + first_pool.v, second_pool.k + second_pool.v))


def test_nothing_grafted_nothing_repaired():
    pool = FakePool(8)
    assert repair_spans(ConstantRepairer(), pool, rope_shifter(), [RepairSpan(torch.tensor([0, 1]), [3, 4], 0)]) == 0


def test_serve_refuses_a_checkpoint_for_another_model(tmp_path, served_model_dir, zero_repair_checkpoint):
    from picrag_core.repair.checkpoint import RepairCheckpointMismatch
    from rag_server.launch.repair_checkpoint import choose_repair_checkpoint

    assert choose_repair_checkpoint(served_model_dir, zero_repair_checkpoint) == (zero_repair_checkpoint, None)
    other_model = tmp_path / "other-model"
    other_model.mkdir()
    (other_model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}')
    with pytest.raises(RepairCheckpointMismatch, match="was trained for model fingerprint"):
        choose_repair_checkpoint(other_model, zero_repair_checkpoint)
    checkpoint, why = choose_repair_checkpoint(other_model, None)
    assert checkpoint is None and "no CacheRepair checkpoint for model other-model" in why


@pytest.mark.server
def test_zero_initialised_repair_answers_as_naive(picrag_server, layout, musique):
    row = musique[57]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2]))
    with picrag_server.client() as client:
        before = counters(client).get("repaired_tokens", 0.0)
        naive = run(client, prompt, "naive", top=True)
        repaired = run(client, prompt, "cacherepair", top=True)
        after = counters(client)["repaired_tokens"]
    meta = picrag_meta(repaired)
    assert meta.policy == "cacherepair" and meta.computed_tokens == question_tokens(prompt)
    assert after - before == prompt.chunk_tokens
    # A zero delta changes no stored value; the two requests' chunks may still come from compiles
    # batched differently, and on some CPUs (AVX-512 here) a GEMM's rounding depends on the batch:
    # the transparency fuzzer's tolerance, not bit equality.
    assert_same_answer(repaired, naive, TOLERANCE)

