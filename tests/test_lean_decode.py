"""picrag's lean CPU decode step (sglang_patches.cpu.lean_decode): SGLang's arithmetic, bit for bit
where it is rewritten, only where it applies, and a served decode that agrees with SGLang's own
prefill."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.layernorm import RMSNorm

from sglang_patches.cpu import lean_decode

HIDDEN = 576  # SmolLM2-135M


def sglang_rms_norm(eps: float = 1e-5, **options) -> RMSNorm:
    norm = RMSNorm(HIDDEN, eps=eps, **options)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(HIDDEN) + 0.5)
    return norm


@pytest.mark.parametrize("tokens", [1, 5])
def test_add_norm_equals_sglang_rms_norm_bit_for_bit(tokens):
    torch.manual_seed(tokens)
    norm = sglang_rms_norm()
    x, residual = torch.randn(tokens, HIDDEN) * 3, torch.randn(tokens, HIDDEN) * 20
    assert torch.equal(lean_decode._add_norm(norm, x, None)[0], norm.forward_native(x.clone()))
    expected, expected_residual = norm.forward_native(x.clone(), residual.clone())
    got, got_residual = lean_decode._add_norm(norm, x, residual)
    assert torch.equal(got, expected) and torch.equal(got_residual, expected_residual)


def test_only_plain_float32_norms_take_the_lean_path():
    assert lean_decode._plain_norm(sglang_rms_norm())
    assert not lean_decode._plain_norm(sglang_rms_norm(cast_x_before_out_mul=True))
    assert not lean_decode._plain_norm(sglang_rms_norm(fp32_residual=True))
    assert not lean_decode._plain_norm(sglang_rms_norm(var_hidden_size=HIDDEN // 2))
    assert not lean_decode._plain_norm(sglang_rms_norm(has_weight=False))
    assert not lean_decode._plain_norm(sglang_rms_norm().to(torch.bfloat16))


def fake_linear(quant_method=None, dtype=torch.float32):
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    return SimpleNamespace(quant_method=quant_method or UnquantizedLinearMethod(), skip_bias_add=False,
                           weight=torch.zeros(2, 2, dtype=dtype), bias=None)


def fake_model(norm: RMSNorm, layers: int = 2, down_proj=None):
    def layer():
        attn = SimpleNamespace(qkv_proj=fake_linear(), o_proj=fake_linear())
        mlp = SimpleNamespace(gate_up_proj=fake_linear(), down_proj=down_proj or fake_linear(),
                              dual_gemm=SimpleNamespace(mode=None), activation_quant=SimpleNamespace(enabled=False))
        return SimpleNamespace(input_layernorm=norm, post_attention_layernorm=norm, self_attn=attn, mlp=mlp)

    return SimpleNamespace(embed_tokens=torch.nn.Embedding(8, HIDDEN), norm=norm, layers=[layer() for _ in range(layers)],
                           start_layer=0, end_layer=layers, layers_to_capture=[])


def fake_batch(decode: bool = True, lora_ids=None):
    return SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: decode), lora_ids=lora_ids)


def test_applies_to_decode_steps_of_a_one_process_float32_model_only(monkeypatch):
    from sglang.srt.runtime_context import get_parallel

    ids = torch.tensor([1, 2])
    # SGLang publishes its execution settings in the server only; here RL on-policy mode is off.
    monkeypatch.setattr(lean_decode, "_rl_on_policy", lambda: False)
    with get_parallel().override(tp_size=1, pp_size=1, dp_size=1):
        model = fake_model(sglang_rms_norm())
        assert lean_decode.applies(model, ids, fake_batch(), None, None)
        assert lean_decode.applies(model, ids, fake_batch(lora_ids=[None, None]), None, None)
        assert not lean_decode.applies(model, ids, fake_batch(decode=False), None, None)
        assert not lean_decode.applies(model, ids, fake_batch(lora_ids=[None, "adapter"]), None, None)
        assert not lean_decode.applies(model, ids, fake_batch(), torch.zeros(2, HIDDEN), None)
        assert not lean_decode.applies(model, ids[:0], fake_batch(), None, None)
        assert not lean_decode.applies(fake_model(sglang_rms_norm(fp32_residual=True)), ids, fake_batch(), None, None)
        assert not lean_decode.applies(fake_model(sglang_rms_norm(), down_proj=fake_linear(dtype=torch.bfloat16)),
                                       ids, fake_batch(), None, None)
        assert not lean_decode.applies(fake_model(sglang_rms_norm(), down_proj=fake_linear(quant_method=object())),
                                       ids, fake_batch(), None, None)
        captured = fake_model(sglang_rms_norm())
        captured.layers_to_capture = [1]
        assert not lean_decode.applies(captured, ids, fake_batch(), None, None)
    with get_parallel().override(tp_size=2, pp_size=1, dp_size=1):
        assert not lean_decode.applies(fake_model(sglang_rms_norm()), ids, fake_batch(), None, None)
    monkeypatch.setattr(lean_decode, "_rl_on_policy", lambda: True)
    with get_parallel().override(tp_size=1, pp_size=1, dp_size=1):
        assert not lean_decode.applies(fake_model(sglang_rms_norm()), ids, fake_batch(), None, None)


@pytest.mark.server
def test_served_decode_agrees_with_sglangs_own_prefill_of_the_same_tokens(picrag_server, tokenizer):
    """Decode steps run the lean path; a prefill (an extend batch) runs SGLang's own forward. The
    log-probability decode gave each generated token equals the one a prefill of the prompt plus
    those tokens gives it, up to the float32 rounding two attention kernels may differ by."""
    prompt = tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    with picrag_server.client() as client:
        first = client.post("/generate", json={
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}).json()
        decoded = first["meta_info"]["output_token_logprobs"]  # [logprob, token id, text]
        generated = [token for _, token, _ in decoded]
        second = client.post("/generate", json={
            "input_ids": prompt + generated, "return_logprob": True, "logprob_start_len": len(prompt) - 1,
            "sampling_params": {"temperature": 0, "max_new_tokens": 1}}).json()
    prefilled = second["meta_info"]["input_token_logprobs"][1:]  # the first entry is the prompt's last token
    assert [token for _, token, _ in prefilled] == generated
    differences = [abs(a[0] - b[0]) for a, b in zip(decoded, prefilled)]
    assert max(differences) < 1e-3, differences
