"""Pure-torch references for the RMSNorm kernels (norm.py): the numerics of specserve's RMSNorm layer.

RMSNorm(x) = weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype), the product rounded once to x.dtype;
the residual add rounds x + residual to the io dtype first (as `x + f(x)` does in the decoder layer).
"""

from __future__ import annotations

import torch


def rms_norm_reference(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [..., H]
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new residual [T, H])
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual
