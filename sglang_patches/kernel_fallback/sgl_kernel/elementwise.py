"""The element-wise CUDA ops of `sgl_kernel` that SGLang's Llama/Qwen-style layers call, in torch.

Same signatures and in-place contracts as the real kernels (FlashInfer's norms: statistics and
the weight product in fp32, one rounding to the input dtype at the end). On CUDA picrag runs
SGLang's fused ops on their `forward_native` paths (SGLANG_FORCE_FUSED_OP_BACKEND=native), so
these are reached only from code that calls `sgl_kernel` directly.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def _into(value: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return value
    out.copy_(value)
    return out


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: Optional[torch.Tensor] = None,
            enable_pdl: Optional[bool] = None) -> torch.Tensor:
    del enable_pdl  # a launch option of the real kernel (programmatic dependent launch)
    return _into((_rms(input.float(), eps) * weight.float()).to(input.dtype), out)


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: Optional[bool] = None) -> None:
    """In place: residual <- input + residual; input <- rmsnorm(that sum)."""
    del enable_pdl
    summed = input.float() + residual.float()
    residual.copy_(summed)
    input.copy_(_rms(summed, eps) * weight.float())


def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: Optional[torch.Tensor] = None,
                  enable_pdl: Optional[bool] = None) -> torch.Tensor:
    del enable_pdl  # Gemma's norm scales by (1 + weight)
    return _into((_rms(input.float(), eps) * (1.0 + weight.float())).to(input.dtype), out)


def gemma_fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                            enable_pdl: Optional[bool] = None) -> None:
    del enable_pdl
    summed = input.float() + residual.float()
    residual.copy_(summed)
    input.copy_(_rms(summed, eps) * (1.0 + weight.float()))


def _gated(input: torch.Tensor, activation, out: Optional[torch.Tensor]) -> torch.Tensor:
    half = input.shape[-1] // 2
    return _into(activation(input[..., :half]) * input[..., half:], out)


def silu_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    del enable_pdl
    return _gated(input, F.silu, out)


def gelu_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    del enable_pdl
    return _gated(input, lambda x: F.gelu(x, approximate="none"), out)


def gelu_tanh_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None,
                      enable_pdl: Optional[bool] = None) -> torch.Tensor:
    del enable_pdl
    return _gated(input, lambda x: F.gelu(x, approximate="tanh"), out)


def gelu_quick(input: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _into(input * torch.sigmoid(1.702 * input), out)
