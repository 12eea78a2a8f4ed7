"""The CUDA half of the pure-torch sgl_kernel stand-in: its element-wise ops against SGLang's own
torch paths, and its names against every platform-guarded import of the installed SGLang."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

from sglang_patches.kernel_fallback import FALLBACK_ROOT


@pytest.fixture(scope="module")
def kernel():
    module = importlib.import_module("sgl_kernel")
    if not getattr(module, "PICRAG_FALLBACK", False):
        pytest.skip("a real sgl_kernel is installed: the fallback is not in use")
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_sglang_forward_native(kernel, dtype):
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    residual = torch.randn(5, 64, generator=gen).to(dtype)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    norm = RMSNorm(64, eps=1e-5)
    norm.weight.data = torch.rand(64, generator=gen) + 0.5
    expected = norm.forward_native(x.clone())
    assert torch.allclose(kernel.rmsnorm(x, norm.weight.data, 1e-5).float(), expected.float(), atol=tolerance)

    expected_out, expected_residual = norm.forward_native(x.clone(), residual.clone())
    got, got_residual = x.clone(), residual.clone()
    kernel.fused_add_rmsnorm(got, got_residual, norm.weight.data, 1e-5)
    assert torch.allclose(got.float(), expected_out.float(), atol=tolerance)
    assert torch.allclose(got_residual.float(), expected_residual.float(), atol=tolerance)

    gemma = GemmaRMSNorm(64, eps=1e-5)
    gemma.weight.data = torch.rand(64, generator=gen) - 0.5
    out = torch.empty_like(x)
    assert kernel.gemma_rmsnorm(x, gemma.weight.data, 1e-5, out=out) is out
    assert torch.allclose(out.float(), gemma.forward_native(x.clone()).float(), atol=tolerance)


def test_gated_activations_match_sglang_forward_native(kernel):
    from sglang.srt.layers.activation import GeluAndMul, SiluAndMul

    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1))
    out = torch.empty(3, 7, 16)
    assert kernel.silu_and_mul(x, out) is out  # SGLang's CUDA path passes `out` positionally
    assert torch.allclose(out, SiluAndMul().forward_native(x), atol=1e-6)
    assert torch.allclose(kernel.gelu_tanh_and_mul(x), GeluAndMul("tanh").forward_native(x), atol=1e-6)
    assert torch.allclose(kernel.gelu_and_mul(x), GeluAndMul("none").forward_native(x), atol=1e-6)


def test_a_stand_in_fails_naming_its_op(kernel):
    from sgl_kernel.kvcacheio import transfer_kv_per_layer

    with pytest.raises(NotImplementedError, match="sgl_kernel.top_k_renorm_prob"):
        kernel.top_k_renorm_prob(torch.ones(2, 4), 2)
    with pytest.raises(NotImplementedError, match="sgl_kernel.kvcacheio.transfer_kv_per_layer"):
        transfer_kv_per_layer()


def guarded_sgl_kernel_imports(package_dir: Path) -> set[tuple[str, str]]:
    """(module, name) of every `from sgl_kernel[.sub] import name` that runs at import time
    behind an `if` (SGLang's platform checks), outside functions and classes."""
    found: set[tuple[str, str]] = set()

    def visit(node: ast.AST, under_if: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if (isinstance(child, ast.ImportFrom) and under_if and child.module
                    and child.module.split(".")[0] == "sgl_kernel"):
                found.update((child.module, alias.name) for alias in child.names)
            visit(child, under_if or isinstance(child, ast.If))

    for part in ("srt", "kernels"):
        for path in (package_dir / part).rglob("*.py"):
            source = path.read_text(encoding="utf-8")
            if "sgl_kernel" in source:  # about 180 of SGLang's 3,000 files: parse only those
                visit(ast.parse(source), False)
    return found


def test_every_platform_guarded_import_of_sglang_resolves(kernel):
    import sglang

    imports = guarded_sgl_kernel_imports(Path(sglang.__file__).parent)
    assert len(imports) > 50, "the scan found too few imports: SGLang's layout changed"
    missing = []
    for module_name, name in sorted(imports):
        module = importlib.import_module(module_name)
        assert Path(module.__file__).is_relative_to(FALLBACK_ROOT), module.__file__
        if name != "*" and not hasattr(module, name):
            missing.append(f"{module_name}.{name}")
    assert not missing, f"SGLang imports these at start on CUDA; add them to sgl_kernel/_unavailable.py: {missing}"
