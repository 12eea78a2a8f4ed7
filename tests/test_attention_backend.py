"""picrag's query-only extend attention equals SGLang's torch_native extend attention."""

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_patches.attention.native import (DecodeRows, QueryOnlyTorchNativeBackend, attend_decode, gather_kv,
                                      offset_causal_mask)
from sglang_patches.steps.forward_annotations import ForwardAnnotations


HEADS, KV_HEADS, DIM = 6, 2, 16


def scattered_pool(seq_lens, pool, row_dtype, gen):
    """A random KV pool and request rows over scattered, non-contiguous slots (as in SGLang)."""
    k_cache = torch.randn(pool, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(pool, KV_HEADS, DIM, generator=gen)
    req_to_token = torch.zeros(len(seq_lens), max(seq_lens), dtype=row_dtype)
    slots = torch.randperm(pool, generator=gen)
    taken = 0
    for row, n in enumerate(seq_lens):
        req_to_token[row, :n] = slots[taken : taken + n]
        taken += n
    return k_cache, v_cache, req_to_token


def run_extend(backend_cls, prefix_lens, extend_lens, sliding_window=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    heads, dim = HEADS, DIM
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_cache, v_cache, req_to_token = scattered_pool(seq_lens, 512, torch.int64, gen)
    query = torch.randn(sum(extend_lens), heads, dim, generator=gen)
    output = torch.zeros_like(query)
    backend = object.__new__(backend_cls)  # the SDPA routine needs no model runner
    backend._run_sdpa_forward_extend(
        query, output, k_cache, v_cache, req_to_token,
        torch.arange(len(seq_lens)), torch.tensor(seq_lens),
        torch.tensor(prefix_lens), torch.tensor(extend_lens),
        scaling=dim ** -0.5, enable_gqa=True, causal=True,
        sliding_window_size=sliding_window,
    )
    return output


@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [([0], [37]), ([50], [7]), ([120, 0, 33], [1, 64, 9]), ([200], [200])],
)
def test_query_only_extend_equals_torch_native(prefix_lens, extend_lens):
    expected = run_extend(TorchNativeAttnBackend, prefix_lens, extend_lens)
    got = run_extend(QueryOnlyTorchNativeBackend, prefix_lens, extend_lens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_query_only_extend_with_sliding_window_equals_torch_native():
    expected = run_extend(TorchNativeAttnBackend, [90, 10], [12, 40], sliding_window=16)
    got = run_extend(QueryOnlyTorchNativeBackend, [90, 10], [12, 40], sliding_window=16)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_offset_causal_mask_places_queries_at_the_end():
    mask = offset_causal_mask(q_len=2, kv_len=5, device=torch.device("cpu"))
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def run_decode(backend_cls, seq_lens, seed=1):
    gen = torch.Generator().manual_seed(seed)
    heads, dim = HEADS, DIM
    k_cache, v_cache, req_to_token = scattered_pool(seq_lens, 256, torch.int32, gen)
    query = torch.randn(len(seq_lens), heads, dim, generator=gen)
    output = torch.zeros_like(query)
    backend = object.__new__(backend_cls)
    backend._run_sdpa_forward_decode(
        query, output, k_cache, v_cache, req_to_token, torch.arange(len(seq_lens)),
        torch.tensor(seq_lens), scaling=dim ** -0.5, enable_gqa=True,
    )
    return output


def test_decode_equals_torch_native():
    expected = run_decode(TorchNativeAttnBackend, [1, 17, 90])
    got = run_decode(QueryOnlyTorchNativeBackend, [1, 17, 90])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (8, 1)])
def test_a_decode_query_grouped_by_kv_head_equals_sdpa_with_its_heads_repeated(heads, kv_heads):
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(heads, DIM, generator=gen)
    key, value = torch.randn(2, kv_heads, 33, DIM, generator=gen)
    repeat = heads // kv_heads
    expected = scaled_dot_product_attention(query[:, None], key.repeat_interleave(repeat, 0),
                                            value.repeat_interleave(repeat, 0), scale=0.3)[:, 0]
    torch.testing.assert_close(attend_decode(query, key, value, 0.3), expected, atol=1e-6, rtol=1e-5)


def decode_steps(backend, k_cache, v_cache, req_to_token, start_lens, steps, gen, keep_rows, layers=2):
    """Decode `steps` tokens for every row: each step writes the new token's K/V into its slot
    (as forward_decode does before attending) and runs every layer; returns the outputs. Without
    `keep_rows` no layer is named, so every step gathers whole rows."""
    outputs = []
    for step in range(steps):
        seq_lens = torch.tensor([n + step for n in start_lens])
        for row, n in enumerate(seq_lens.tolist()):
            slot = int(req_to_token[row, n - 1])
            k_cache[slot], v_cache[slot] = torch.randn(2, KV_HEADS, DIM, generator=gen)
        query = torch.randn(len(start_lens), HEADS, DIM, generator=gen)
        for layer in range(layers):
            output = torch.zeros_like(query)
            backend._decode_layer = layer if keep_rows else None
            backend._run_sdpa_forward_decode(query, output, k_cache, v_cache, req_to_token,
                                             torch.arange(len(start_lens)), seq_lens,
                                             scaling=DIM ** -0.5, enable_gqa=True)
            outputs.append(output)
    return outputs


def test_decode_rows_kept_between_steps_equal_gathering_every_step():
    # Two runs over the same pool writes: rows kept between steps (and past their first
    # capacity: 150 steps), and the whole row gathered at every step (no layer given).
    start_lens, steps = [5, 40, 1], 150
    results = []
    for keep_rows in (True, False):
        gen = torch.Generator().manual_seed(4)
        k_cache, v_cache, req_to_token = scattered_pool([n + steps for n in start_lens], 1024, torch.int32, gen)
        backend = object.__new__(QueryOnlyTorchNativeBackend)
        results.append(decode_steps(backend, k_cache, v_cache, req_to_token, start_lens, steps, gen, keep_rows))
        assert len(backend.decode_rows) == (len(start_lens) * 2 if keep_rows else 0)
    for kept, gathered in zip(*results):
        assert torch.equal(kept, gathered)


def test_decode_rows_are_gathered_again_when_slots_or_contents_change():
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, _ = scattered_pool([1], 256, torch.int64, gen)
    rows = DecodeRows()
    slots = torch.randperm(256, generator=gen)[:30]

    def same_as_gathered(got, slots):
        expected = gather_kv(k_cache, v_cache, slots, torch.float32)
        return all(torch.equal(a, b.movedim(0, 1)) for a, b in zip(got, expected))

    assert same_as_gathered(rows.kv(0, 0, slots[:20], k_cache, v_cache, torch.float32), slots[:20])
    # The request slot now holds another request's row (other slots): gathered again.
    other = torch.randperm(256, generator=gen)[:21]
    assert same_as_gathered(rows.kv(0, 0, other, k_cache, v_cache, torch.float32), other)
    # Same slots, new K/V in them (a new request reusing freed slots): the row is stale until its
    # request slot is extended, which forgets it.
    k_cache[other[3]] += 1.0
    assert not same_as_gathered(rows.kv(0, 0, other, k_cache, v_cache, torch.float32), other)
    rows.forget([0])
    assert same_as_gathered(rows.kv(0, 0, other, k_cache, v_cache, torch.float32), other)
    rows.kv(1, 0, slots, k_cache, v_cache, torch.float32)
    rows.keep_only([1])
    assert len(rows) == 1


def test_extend_forgets_its_request_slots_and_a_new_decode_step_keeps_only_its_own(monkeypatch):
    class Batch:
        def __init__(self, request_slots):
            self.req_pool_indices = torch.tensor(request_slots)

    class Layer:
        def __init__(self, layer_id):
            self.layer_id = layer_id

    monkeypatch.setattr(TorchNativeAttnBackend, "forward_extend", lambda self, *a, **kw: "extended")
    monkeypatch.setattr(TorchNativeAttnBackend, "forward_decode", lambda self, *a, **kw: self._decode_layer)
    import sglang_patches.attention.native as attention

    monkeypatch.setattr(attention, "annotations_of", lambda batch: None)
    backend = object.__new__(QueryOnlyTorchNativeBackend)
    k_cache, v_cache, _ = scattered_pool([1], 64, torch.int64, torch.Generator().manual_seed(6))
    for request_slot in (0, 1, 2):
        for layer in (0, 1):
            backend.decode_rows.kv(request_slot, layer, torch.arange(4), k_cache, v_cache, torch.float32)
    assert backend.forward_extend(None, None, None, Layer(0), Batch([1])) == "extended"
    assert backend.decode_rows.request_slots() == [0, 2]
    # The layer id is set while the decode forward runs, and only then.
    assert backend.forward_decode(None, None, None, Layer(0), Batch([0, 2])) == 0
    assert backend._decode_layer is None and len(backend.decode_rows) == 4
    assert backend.forward_decode(None, None, None, Layer(1), Batch([0, 2])) == 1
    assert backend.forward_decode(None, None, None, Layer(0), Batch([2])) == 0  # the next step
    assert backend.decode_rows.request_slots() == [2]


def reference_prefill(q, k, v, *, custom_mask, causal, sm_scale, window_left, logits_soft_cap):
    """FlashInfer's single-request prefill contract in SDPA: NHD tensors, custom_mask True = attend,
    causal aligned with the row's end. Stands in for the CUDA kernel so that the FlashInfer
    backend's own work (slot gathering, per-request masks, offsets) is checked on CPU."""
    assert logits_soft_cap is None and window_left == -1
    mask = custom_mask
    if causal:
        mask = offset_causal_mask(q.shape[0], k.shape[0], q.device)
    out = scaled_dot_product_attention(
        q.movedim(0, 1).unsqueeze(0), k.movedim(0, 1).unsqueeze(0), v.movedim(0, 1).unsqueeze(0),
        attn_mask=mask, scale=sm_scale, enable_gqa=True,
    )
    return out.squeeze(0).movedim(0, 1)


def test_flashinfer_position_masked_extend_equals_picrag_native():
    """Three requests in one batch: a reordered LegoLink row (true positions), a CacheBlend row
    (scattered query positions) and a plain one; the FlashInfer path's plumbing must give exactly
    what picrag_native computes for the same annotations."""
    from sglang_patches.attention.flashinfer import position_masked_extend

    gen = torch.Generator().manual_seed(3)
    seq_lens, extend_lens = [40, 30, 25], [9, 5, 25]
    k_cache, v_cache, req_to_token = scattered_pool(seq_lens, 256, torch.int64, gen)
    query = torch.randn(sum(extend_lens), HEADS, DIM, generator=gen)
    true_positions = {0: torch.randperm(40, generator=gen)}
    query_positions = {1: torch.tensor([3, 11, 12, 20, 29])}

    native = object.__new__(QueryOnlyTorchNativeBackend)
    native._annotations = ForwardAnnotations(true_positions=true_positions, query_positions=query_positions)
    expected = torch.zeros_like(query)
    native._run_sdpa_forward_extend(
        query, expected, k_cache, v_cache, req_to_token, torch.arange(3), torch.tensor(seq_lens),
        torch.tensor([s - e for s, e in zip(seq_lens, extend_lens)]), torch.tensor(extend_lens),
        scaling=DIM ** -0.5, enable_gqa=True, causal=True,
    )
    rows = [req_to_token[i, :n] for i, n in enumerate(seq_lens)]
    got = position_masked_extend(
        query, k_cache, v_cache, rows, extend_lens, true_positions, query_positions, reference_prefill,
        sm_scale=DIM ** -0.5,
    )
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    plain = position_masked_extend(
        query, k_cache, v_cache, rows, extend_lens, {}, {}, reference_prefill, sm_scale=DIM ** -0.5,
    )
    assert not torch.allclose(plain[:14], expected[:14]), "the masks must change the annotated rows"
    torch.testing.assert_close(plain[14:], expected[14:], atol=1e-6, rtol=1e-6)


class RecordingPool:
    """The few KV-pool members the FlashInfer backend's masked path uses, over plain tensors."""

    def __init__(self, k_cache, v_cache):
        self.k_cache, self.v_cache = k_cache, v_cache

    def set_kv_buffer(self, layer, write_loc, k, v, k_scale, v_scale):
        self.k_cache[write_loc.loc] = k
        self.v_cache[write_loc.loc] = v

    def get_key_buffer(self, layer_id):
        return self.k_cache

    def get_value_buffer(self, layer_id):
        return self.v_cache


def test_flashinfer_backend_writes_the_extend_kv_then_masks_annotated_batches(monkeypatch):
    """The class glue around position_masked_extend: it stores the batch's new K/V at
    out_cache_loc before attending, reads the row lengths from the (possibly shrunk) batch, and
    leaves unannotated batches to SGLang's FlashInfer path."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    from sglang_patches.attention import flashinfer as flashinfer_attention
    from sglang_patches.steps.forward_annotations import ATTR

    gen = torch.Generator().manual_seed(5)
    seq_lens, extend_lens = [30, 12], [6, 12]
    k_cache, v_cache, req_to_token = scattered_pool(seq_lens, 128, torch.int64, gen)
    new_slots = torch.cat([req_to_token[0, 24:30], req_to_token[1, :12]])
    fresh_k = torch.randn(18, KV_HEADS, DIM, generator=gen)
    fresh_v = torch.randn(18, KV_HEADS, DIM, generator=gen)
    query = torch.randn(18, HEADS, DIM, generator=gen)
    true_positions = {0: torch.randperm(30, generator=gen)}

    backend = object.__new__(flashinfer_attention.PositionMaskedFlashInferBackend)
    backend.token_to_kv_pool = RecordingPool(k_cache.clone(), v_cache.clone())
    backend.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
    backend.forward_metadata = SimpleNamespace(swa_out_cache_loc=None)
    backend.prefill_uses_dequant_workspace = False
    backend.kv_cache_quant_method = SimpleNamespace(needs_global_scale=lambda: False)
    layer = SimpleNamespace(
        layer_id=0, tp_q_head_num=HEADS, head_dim=DIM, scaling=DIM ** -0.5, logit_cap=0.0,
        sliding_window_size=-1, is_cross_attention=False, k_scale=None, v_scale=None,
    )
    batch = SimpleNamespace(
        out_cache_loc=new_slots, out_cache_loc_is_physical=False, req_pool_indices=torch.arange(2),
        seq_lens=torch.tensor(seq_lens), extend_seq_lens=torch.tensor(extend_lens),
    )
    monkeypatch.setattr(flashinfer_attention, "flashinfer_prefill", lambda: reference_prefill)
    monkeypatch.setattr(FlashInferAttnBackend, "forward_extend", lambda *args, **kwargs: "stock")

    assert backend.forward_extend(query.flatten(1), fresh_k, fresh_v, layer, batch) == "stock"
    setattr(batch, ATTR, ForwardAnnotations(true_positions=true_positions))
    got = backend.forward_extend(query.flatten(1), fresh_k, fresh_v, layer, batch)

    k_cache[new_slots], v_cache[new_slots] = fresh_k, fresh_v
    torch.testing.assert_close(backend.token_to_kv_pool.k_cache, k_cache)
    native = object.__new__(QueryOnlyTorchNativeBackend)
    native._annotations = ForwardAnnotations(true_positions=true_positions)
    expected = torch.zeros_like(query)
    native._run_sdpa_forward_extend(
        query, expected, k_cache, v_cache, req_to_token, torch.arange(2), torch.tensor(seq_lens),
        torch.tensor([24, 0]), torch.tensor(extend_lens), scaling=DIM ** -0.5, enable_gqa=True, causal=True,
    )
    torch.testing.assert_close(got, expected.flatten(1), atol=1e-6, rtol=1e-6)
