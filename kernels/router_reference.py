"""Pure-torch reference for the MoE router kernel (router.py): the routing rule of specserve's TopKRouter.

scores = softmax(logits) or sigmoid(logits) (fp32); choice = scores + correction_bias (selection only); with
n_group > 1 only the topk_group groups of best group score (sum of the group's top two choice scores) stay
eligible; ids = top_k of choice, in descending order of choice; weights = scores at ids, renormalised to sum 1
(norm_topk_prob; + 1e-20 in the sigmoid rule's denominator, as DeepSeek-V3 does), times routed_scaling_factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.checks import KernelArgumentError

SCORINGS = ("softmax", "sigmoid")
SIGMOID_RENORM_EPS = 1e-20


@dataclass(frozen=True)
class RouterConfig:
    """One router's rule. Qwen3-MoE / Mixtral: softmax, n_group 1, no bias; DeepSeek-V3 / Kimi-K2: sigmoid with
    correction bias (noaux_tc) and n_group / topk_group. The model's softmax rule ignores groups and bias: give
    n_group = 1 and no bias there to match it."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise KernelArgumentError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if min(self.num_experts, self.top_k, self.n_group, self.topk_group) < 1:
            raise KernelArgumentError(f"num_experts, top_k, n_group, topk_group must be >= 1: {self}")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise KernelArgumentError(
                f"need num_experts % n_group == 0 and topk_group <= n_group, got {self.num_experts}, "
                f"{self.n_group}, {self.topk_group}"
            )
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise KernelArgumentError(f"top_k {self.top_k} exceeds the experts in {self.topk_group} groups")
        if not self.routed_scaling_factor > 0:
            raise KernelArgumentError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")

    @property
    def renorm_eps(self) -> float:
        return SIGMOID_RENORM_EPS if self.scoring == "sigmoid" else 0.0


def router_scores(logits: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:  # [T, E] fp32
    x = logits.float()
    return x.sigmoid() if cfg.scoring == "sigmoid" else torch.softmax(x, dim=-1)


def router_reference(
    logits: torch.Tensor,  # [T, E] gate GEMM output
    cfg: RouterConfig,
    correction_bias: torch.Tensor | None = None,  # [E] added to the scores for the choice only
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_ids [T, K] int64, topk_weights [T, K] fp32)
    scores = router_scores(logits, cfg)
    choice = scores + correction_bias.float() if correction_bias is not None else scores
    if cfg.n_group > 1:
        per_group = cfg.num_experts // cfg.n_group
        grouped = choice.view(-1, cfg.n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1)  # [T, n_group]
        best = torch.topk(group_scores, cfg.topk_group, dim=-1)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep[:, :, None].expand(-1, -1, per_group).reshape(-1, cfg.num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=True)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + cfg.renorm_eps)
    return ids, weights * cfg.routed_scaling_factor
