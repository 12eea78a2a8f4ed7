"""The SGLang seams picrag relies on still look the way sglang_patches expects (sglang==0.5.23)."""

import importlib
import inspect
import sglang
import torch

from sglang_patches import plugin
from sglang_patches.cpu import lean_decode, rotary
from sglang_patches.guard import request_guard
from sglang_patches.steps import first_token_report, meta_info, span_report
from sglang_patches.tree import link_admission


def resolve(dotted: str):
    module_name, class_name, attr = dotted.rsplit(".", 2)
    return getattr(getattr(importlib.import_module(module_name), class_name), attr)


def test_pinned_sglang_version():
    assert sglang.__version__ == plugin.SUPPORTED_SGLANG


def test_hooked_method_signature():
    target = resolve(meta_info.HOOK_TARGET)
    assert list(inspect.signature(target).parameters) == ["self", "req"]
    # picrag's request checks raise SGLang's 400 from here (a ValueError), per prompt of a batch.
    assert list(inspect.signature(resolve(request_guard.HOOK_TARGET)).parameters) == ["self", "obj", "input_ids"]
    # Every request SGLang queues passes here; a retracted one says so.
    assert list(inspect.signature(resolve(link_admission.HOOK_TARGET)).parameters) == ["self", "req", "is_retracted"]
    # Every generation forward's results pass here, the logits row of each request still held.
    assert list(inspect.signature(resolve(first_token_report.HOOK_TARGET)).parameters) == [
        "self", "batch_result", "batch"]
    # Every model's logits pass here with the batch's final hidden states, and the LM head the
    # span report applies to some of their rows (its own buffer left alone).
    assert list(inspect.signature(resolve(span_report.HOOK_TARGET)).parameters)[:5] == [
        "self", "input_ids", "hidden_states", "lm_head", "logits_metadata"]
    from sglang.srt.layers.logits_processor import LogitsProcessor

    assert list(inspect.signature(LogitsProcessor._get_logits).parameters) == [
        "self", "hidden_states", "lm_head", "logits_metadata", "embedding_bias", "use_logits_buffer"]


def test_the_rotary_picrag_wraps_and_the_dispatch_that_reaches_it_on_cpu():
    """sglang_patches.cpu.rotary wraps forward_native, which SGLang's CPU dispatch calls without sgl-kernel's AMX op."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    assert list(inspect.signature(resolve(rotary.HOOK_TARGET)).parameters) == [
        "self", "positions", "query", "key", "offsets", "fused_set_kv_buffer_arg"]
    assert "self.forward_native(" in inspect.getsource(RotaryEmbedding.forward_cpu)
    for name in ("cos_sin_cache", "head_size", "rotary_dim", "is_neox_style"):
        assert hasattr(RotaryEmbedding(64, 64, 64, 10000, True, torch.float32), name)


def test_the_model_forwards_lean_decode_replaces_on_cpu_decode_steps():
    """sglang_patches.cpu.lean_decode re-runs these models' layers in the order their boundaries do:
    embedding, then per layer input norm, attention, post-attention norm, MLP, then the final norm."""
    for target in lean_decode.HOOK_TARGETS:
        model_forward = resolve(target)
        assert list(inspect.signature(model_forward).parameters) == [
            "self", "input_ids", "positions", "forward_batch", "input_embeds", "pp_proxy_tensors"]
        source = inspect.getsource(model_forward)
        for line in ("hidden_states = self.embed_tokens(input_ids)", "residual_batch.final_norm(",
                     "self.layers_to_capture", "range(self.start_layer, self.end_layer)"):
            assert line in source, (target, line)
        layer_source = inspect.getsource(resolve(target.replace("Model.forward", "DecoderLayer.forward")))
        order = ["self.attn_boundary.prepare(", "self.self_attn(", "self.attn_boundary.finish(",
                 "self.ffn_boundary.prepare(", "self.mlp(", "self.ffn_boundary.finish("]
        assert [layer_source.index(step) for step in order] == sorted(layer_source.index(step) for step in order)
        init_source = inspect.getsource(resolve(target.replace("Model.forward", "DecoderLayer.__init__")))
        assert "(attn, self.input_layernorm)" in init_source and "(ffn, self.post_attention_layernorm)" in init_source
        # lean_decode._attention and its MLP line: what these modules compute on a CPU decode step.
        attention = inspect.getsource(resolve(target.replace("Model.forward", "Attention.forward")))
        if "forward_prepare_native" in attention:  # Llama keeps its projection and RoPE apart
            attention += inspect.getsource(resolve(target.replace("Model.forward", "Attention.forward_prepare_native")))
        for line in ("qkv, _ = self.qkv_proj(hidden_states)",
                     "q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)",
                     "q, k = self.rotary_emb(positions, q, k)", "self.attn(q, k, v, forward_batch)",
                     "output, _ = self.o_proj(attn_output)"):
            assert line in attention, (target, line)
        mlp = inspect.getsource(resolve(target.replace("Model.forward", "MLP.forward")))
        for line in ("gate_up, _ = self.gate_up_proj(x)", "self.activation_quant.forward_decode(",
                     "x, _ = self.down_proj(x"):
            assert line in mlp, (target, line)
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    # What lean_decode._linear stands for: the unquantised method's last resort on CPU.
    assert inspect.getsource(UnquantizedLinearMethod.apply).rstrip().endswith("return F.linear(x, layer.weight, bias)")


def test_the_intake_abort_picrag_refuses_a_link_with():
    """link_admission answers a refused link the way SGLang's scheduler rejects a request at
    intake: prepare_abort, then the output streamer (no forward)."""
    from sglang.srt.disaggregation.utils import prepare_abort
    from sglang.srt.managers.scheduler import Scheduler

    assert list(inspect.signature(prepare_abort).parameters) == ["req", "error_message", "status_code"]
    source = inspect.getsource(Scheduler._reject_sampling_mask_request)
    assert "prepare_abort(" in source and "self.output_streamer.stream_output([req], req.return_logprob)" in source


def test_tree_cache_methods_the_chunk_cache_overrides_or_calls():
    from sglang.srt.mem_cache.radix_cache import RadixCache

    assert list(inspect.signature(RadixCache.match_prefix).parameters) == ["self", "params"]
    assert list(inspect.signature(RadixCache._match_prefix_helper).parameters) == ["self", "node", "key"]
    assert list(inspect.signature(RadixCache.on_release).parameters) == ["self", "req", "checkpointed"]
    # Where SGLang releases a request aborted while it waited (leases are dropped there).
    assert list(inspect.signature(RadixCache.release_aborted_request).parameters) == ["self", "handle"]
    # The one place SGLang keys what a request computed; the chunk cache marks linked prompts' keys there.
    assert list(inspect.signature(RadixCache._insert_cache).parameters) == [
        "self", "req", "token_ids", "key_limit", "split_prompt"]
    assert "req" in inspect.signature(RadixCache.checkpoint).parameters


def test_plugin_registers_cache_and_attention_backends():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    plugin.register()
    assert get_radix_cache_factory(plugin.RADIX_CACHE_BACKEND) is not None
    assert "picrag_native" in ATTENTION_BACKENDS and "picrag_native" in ATTENTION_BACKEND_CHOICES
    assert "picrag_flashinfer" in ATTENTION_BACKENDS and "picrag_flashinfer" in ATTENTION_BACKEND_CHOICES


def test_the_flashinfer_backend_members_picrag_relies_on():
    """picrag_flashinfer subclasses SGLang's FlashInfer backend (importable without CUDA) and
    calls these members of it."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    from sglang_patches.attention.flashinfer import PositionMaskedFlashInferBackend

    assert issubclass(PositionMaskedFlashInferBackend, FlashInferAttnBackend)
    assert list(inspect.signature(FlashInferAttnBackend.forward_extend).parameters) == [
        "self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"
    ]
    assert list(inspect.signature(FlashInferAttnBackend.__init__).parameters)[:2] == ["self", "model_runner"]
    assert "init_new_workspace" in inspect.signature(FlashInferAttnBackend.__init__).parameters
    assert list(inspect.signature(KVWriteLoc.for_layer).parameters)[:3] == ["forward_batch", "layer", "swa_loc"]
    assert callable(FlashInferAttnBackend._kv_write_scales)
    assert callable(FlashInferAttnBackend._check_kv_attention_access)


def test_cuda_runtime_uses_picrag_flashinfer_without_prefill_graphs(tmp_path):
    from rag_server.launch.runtime import RuntimeConfig

    config = RuntimeConfig(model_path=tmp_path, device="cuda").resolved()
    assert config.attention_backend == "picrag_flashinfer"
    command = config.command()
    assert command[command.index("--attention-backend") + 1] == "picrag_flashinfer"
    assert command[command.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    cpu = RuntimeConfig(model_path=tmp_path, device="cpu").resolved()
    assert cpu.attention_backend == "picrag_native" and "--cuda-graph-backend-prefill" not in cpu.command()


def test_cpu_runtimes_start_through_cpu_launch_which_overrides_sglangs_spawn(tmp_path):
    """sglang_patches.cpu.launch forks the workers SGLang's launch would spawn: the launch still
    asks for 'spawn' by that one statement, and after use_forked_workers no request changes 'fork'."""
    import subprocess
    import sys

    from sglang.srt.entrypoints import engine

    from rag_server.launch.runtime import RuntimeConfig
    from sglang_patches.cpu import launch as cpu_launch

    assert cpu_launch.SPAWN_STATEMENT in inspect.getsource(engine._set_envs_and_config)
    assert RuntimeConfig(model_path=tmp_path, device="cpu").resolved().command()[1:3] == ["-m", "sglang_patches.cpu.launch"]
    assert RuntimeConfig(model_path=tmp_path, device="cuda").resolved().command()[1:3] == ["-m", "sglang.launch_server"]
    probe = ("import multiprocessing as mp; from sglang_patches.cpu import launch as cpu_launch; cpu_launch.use_forked_workers(); "
             "mp.set_start_method('spawn', force=True); print(mp.get_start_method())")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "fork"


def test_signatures_of_the_forward_hooks():
    from sglang_patches.steps import batch_annotations, cacheblend

    init_new = resolve(batch_annotations.INIT_HOOK_TARGET)
    assert list(inspect.signature(init_new).parameters)[:2] == ["batch", "model_runner"]
    load_batch = resolve(batch_annotations.HOOK_TARGET)
    assert list(inspect.signature(load_batch).parameters)[:3] == ["self", "forward_batch", "pp_proxy_tensors"]
    for target in cacheblend.LAYER_HOOK_TARGETS:
        layer_forward = resolve(target)
        assert list(inspect.signature(layer_forward).parameters)[:4] == [
            "self", "positions", "hidden_states", "forward_batch"
        ]
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

    for name in ("stream_of", "clear", "set_written"):
        assert callable(getattr(residual_batch, name))
    from sglang.srt.layers.layer_boundary.residual.stream import ResidualStream

    assert list(inspect.signature(ResidualStream.snapshot).parameters) == ["self", "hidden"]


def _decoder_layer_forward(architecture: str) -> str:
    """The hook target of the decoder layer SGLang builds `architecture` of: the *DecoderLayer
    defined beside the first class of its MRO whose module defines one."""
    from sglang.srt.models.registry import ModelRegistry

    for base in ModelRegistry.models[architecture].__mro__:
        module = importlib.import_module(base.__module__)
        layers = sorted(name for name, obj in vars(module).items()
                        if inspect.isclass(obj) and name.endswith("DecoderLayer") and obj.__module__ == module.__name__)
        if layers:
            return f"{module.__name__}.{layers[0]}.forward"
    raise AssertionError(f"no decoder layer found for {architecture}")


def test_the_window_blind_architectures_are_those_whose_layers_ignore_the_window():
    """picrag_core.model_support.WINDOW_BLIND_ARCHITECTURES (served only within their window)
    must be exactly the architectures whose SGLang decoder layers never read the config's
    sliding window: a window-aware class listed would be refused needlessly, a blind one missed
    would be served past its window as whole-context attention, silently."""
    from picrag_core.model_support import TESTED_ARCHITECTURES, WINDOW_BLIND_ARCHITECTURES

    windowed = {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}
    for architecture in sorted(TESTED_ARCHITECTURES | WINDOW_BLIND_ARCHITECTURES | windowed):
        module = importlib.import_module(_decoder_layer_forward(architecture).rsplit(".", 2)[0])
        reads_window = "sliding_window" in inspect.getsource(module)
        assert reads_window == (architecture not in WINDOW_BLIND_ARCHITECTURES), architecture


def test_cacheblend_is_allowed_exactly_where_its_layer_hook_reaches():
    """picrag_core.model_support.BLEND_ARCHITECTURES (which models may run cacheblend) and
    cacheblend.LAYER_HOOK_TARGETS (which layers shrink the batch) must name the same models: a
    model outside the hook would answer cacheblend requests as full, silently."""
    from picrag_core.model_support import BLEND_ARCHITECTURES, TESTED_ARCHITECTURES
    from sglang_patches.steps import cacheblend

    for architecture in sorted(TESTED_ARCHITECTURES):
        hooked = _decoder_layer_forward(architecture) in cacheblend.LAYER_HOOK_TARGETS
        assert hooked == (architecture in BLEND_ARCHITECTURES), architecture
    for target in cacheblend.LAYER_HOOK_TARGETS:
        # _shrink folds the residual stream these layers hand rows on through.
        assert "self.attn_boundary.prepare(" in inspect.getsource(resolve(target)), target
