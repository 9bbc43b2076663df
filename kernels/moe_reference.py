"""Pure-torch reference for a routed-experts MoE layer (the oracle the Triton kernel is checked against)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# the expert id of a routing slot that goes to no expert (the pad rows of the target's invariant steps: routing weight
# 0 too). Every MoE path (these references, kernels/fused_moe.py, kernels/quant_moe.py) gives such a slot no work and
# a contribution of exactly 0; a row of only such slots gets 0.
NO_EXPERT = -1


@dataclass(frozen=True)
class ExpertRuns:
    """fused_moe's slot layout (its align step): the T * k slots sorted by expert, each expert's run padded to bm rows.
    Made in the router's launch (kernels/router.route_gate_with_runs) so fused_moe skips its own align launch."""

    sorted_slot: torch.Tensor  # [max_blocks * bm] int32: padded row r's flat slot, or T * k for a pad row
    block_expert: torch.Tensor  # [max_blocks] int32: the expert of each bm-row block
    num_blocks: torch.Tensor  # [1] int32: blocks in use
    bm: int
    num_experts: int  # experts the slots were sorted by (routed + shared)


@dataclass(frozen=True)
class SlotRows:
    """A MoE's output before its top-k sum: out[t] = sum over j < k of rows[t * k + j] in float32, in that order, a
    slot routed to NO_EXPERT adding 0 (its row is never written), rounded to `dtype` once. fused_moe(sum_slots=False)
    returns it so the fused add + RMSNorm after the MoE (kernels/norm.fused_add_rms_norm) sums the slots in its own
    launch: the same bits as summing first (kernels.fused_moe.sum_slots), one launch fewer."""

    rows: torch.Tensor  # [T * k, H] float32
    ids: torch.Tensor  # [T * k] int32/int64 expert ids (NO_EXPERT: a slot with no expert)
    k: int
    dtype: torch.dtype  # the sum's dtype (the MoE's input dtype)

    @property
    def shape(self) -> tuple[int, int]:  # (T, H) of the sum
        return self.rows.shape[0] // self.k, self.rows.shape[1]

    def total(self) -> torch.Tensor:  # [T, H] dtype, in torch (the kernels' order)
        t, h = self.shape
        rows = torch.where((self.ids >= 0)[:, None], self.rows, 0.0).view(t, self.k, h)
        acc = torch.zeros(t, h, dtype=torch.float32, device=self.rows.device)
        for j in range(self.k):
            acc += rows[:, j]
        return acc.to(self.dtype)


@dataclass(frozen=True)
class SharedExperts:
    """Shared experts run as always-routed experts of the routed launch: a gated MLP of intermediate count * I (I the
    routed experts') is `count` experts of I, chunk j of its intermediate being expert E + j. The router gives every
    live row those ids at weight 1 (after its top-k), and the down projections' sum adds them with the routed ones.
    The weights are the MLP's own (a GatedMLP's merged gate_up and its down), read in place."""

    w13: torch.Tensor  # [2 * count * I, H]: gate rows then up rows
    w2: torch.Tensor  # [H, count * I]
    count: int

    def expert(self, j: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:  # -> (w13 [2I, H], w2 [H, I])
        """Chunk j as a routed expert's weights (a copy of its gate and up rows)."""
        rows = self.count * inter
        gate = self.w13[j * inter : (j + 1) * inter]
        up = self.w13[rows + j * inter : rows + (j + 1) * inter]
        return torch.cat([gate, up]), self.w2[:, j * inter : (j + 1) * inter]


def expert_weights(
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    e: int,
    shared: SharedExperts | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (w13_e [2I, H], w2_e [H, I])
    """Expert e's weights: a routed one (e < E) or shared chunk e - E."""
    if e < w13.shape[0]:
        return w13[e], w2[e]
    if shared is None or e - w13.shape[0] >= shared.count:
        raise IndexError(f"expert {e} is neither one of the {w13.shape[0]} routed experts nor a shared chunk")
    return shared.expert(e - w13.shape[0], w2.shape[-1])


def used_experts(topk_ids: torch.Tensor) -> list[int]:  # topk_ids [T, K] -> the distinct experts, NO_EXPERT left out
    """The experts a routing uses (one host read)."""
    return [e for e in torch.unique(topk_ids).tolist() if e != NO_EXPERT]


def moe_reference(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2*I, H]  gate rows then up rows, per expert
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K] int64 expert ids
    topk_weights: torch.Tensor,  # [T, K] routing weights (applied after the down projection)
    shared: SharedExperts | None = None,  # ids E.. are its chunks
) -> torch.Tensor:  # [T, H]
    """sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t,k]; each used expert once (a slot of
    NO_EXPERT adds nothing)."""
    out = torch.zeros_like(hidden, dtype=torch.float32)
    inter = w2.shape[-1]
    for e in used_experts(topk_ids):
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        x = hidden[rows]
        w13_e, w2_e = expert_weights(w13, w2, e, shared)
        gate_up = x @ w13_e.t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (act @ w2_e.t()).float() * topk_weights[rows, slot, None].float()
        out.index_add_(0, rows, y)
    return out.to(hidden.dtype)


def moe_reference_fixed_rows(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2*I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K] int64 expert ids
    topk_weights: torch.Tensor,  # [T, K]
    shared: SharedExperts | None = None,  # ids E.. are its chunks
) -> torch.Tensor:  # [T, H]
    """moe_reference's function with every used expert run over all T rows, so each GEMM has M = T whatever the
    routing: a row's result then depends on its own choices only (torch CPU GEMMs pick their kernel by M), and
    its k contributions are added in expert order. The target's invariant steps use it where no fused kernel runs;
    their pad rows route to NO_EXPERT only, so they add no expert to the T-row GEMMs and get 0."""
    out = torch.zeros_like(hidden, dtype=torch.float32)
    inter = w2.shape[-1]
    for e in used_experts(topk_ids):
        chose = topk_ids == e  # [T, K]
        w13_e, w2_e = expert_weights(w13, w2, e, shared)
        gate_up = hidden @ w13_e.t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        weight = (topk_weights.float() * chose).sum(1, keepdim=True)  # [T, 1]: the row's weight for e, or 0
        y = (act @ w2_e.t()).float() * weight
        out += torch.where(chose.any(1, keepdim=True), y, 0.0)
    return out.to(hidden.dtype)
