"""Pure-torch reference for a routed-experts MoE layer (the oracle the Triton kernel is checked against)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_reference(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2*I, H]  gate rows then up rows, per expert
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K] int64 expert ids
    topk_weights: torch.Tensor,  # [T, K] routing weights (applied after the down projection)
) -> torch.Tensor:  # [T, H]
    """sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t,k]; each used expert once."""
    out = torch.zeros_like(hidden, dtype=torch.float32)
    inter = w2.shape[-1]
    for e in torch.unique(topk_ids).tolist():
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        x = hidden[rows]
        gate_up = x @ w13[e].t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (act @ w2[e].t()).float() * topk_weights[rows, slot, None].float()
        out.index_add_(0, rows, y)
    return out.to(hidden.dtype)


def moe_reference_fixed_rows(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2*I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K] int64 expert ids
    topk_weights: torch.Tensor,  # [T, K]
) -> torch.Tensor:  # [T, H]
    """moe_reference's function with every used expert run over all T rows, so each GEMM has M = T whatever the
    routing: a row's result then depends on its own choices only (torch CPU GEMMs pick their kernel by M), and
    its k contributions are added in expert order. The target's invariant steps use it where no fused kernel runs."""
    out = torch.zeros_like(hidden, dtype=torch.float32)
    inter = w2.shape[-1]
    for e in torch.unique(topk_ids).tolist():
        chose = topk_ids == e  # [T, K]
        gate_up = hidden @ w13[e].t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        weight = (topk_weights.float() * chose).sum(1, keepdim=True)  # [T, 1]: the row's weight for e, or 0
        y = (act @ w2[e].t()).float() * weight
        out += torch.where(chose.any(1, keepdim=True), y, 0.0)
    return out.to(hidden.dtype)
