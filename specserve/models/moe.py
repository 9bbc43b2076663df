"""Routed-experts MoE block: router (softmax top-k or DeepSeek sigmoid/noaux_tc) + stacked experts.

Routed experts are stored stacked: w13 [E, 2*I, H] (gate rows then up rows) and w2 [E, H, I]. They are
computed through ONE call site, ``self.experts_fn`` (default: the pure-torch moe_reference), so a fused
GPU kernel with the same signature can be swapped in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels.moe_reference import NO_EXPERT, ExpertRuns, SharedExperts, SlotRows, moe_reference
from specserve.kernels.router_reference import RouterConfig
from specserve.models.config import MoEConfig, ParallelConfig
from specserve.models.layers import (
    GatedMLP,
    WeightShapeError,
    all_reduce,
    copy_checked,
    divide,
    new_param,
    shard,
)

# (hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, K], topk_weights [T, K]) -> [T, H]
# (may also take shared=SharedExperts: the shared experts as routed experts E.., MoEBlock.set_shared_as_routed)
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

EXPERT_SHARDS = ("gate", "up", "gate_up", "down")


class TopKRouter(nn.Module):
    """Chooses top_k experts per token; weights applied after each expert's down projection."""

    def __init__(self, cfg: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = new_param((cfg.num_experts, hidden))
        self.weight.weight_loader = lambda p, w: copy_checked(p.data, w)
        if cfg.correction_bias:
            self.e_score_correction_bias = new_param((cfg.num_experts,), dtype=torch.float32)
            self.e_score_correction_bias.weight_loader = lambda p, w: copy_checked(p.data, w)
        self.use_kernel = False  # CausalLM.set_fused_layers: the rule after the gate GEMM in one Triton launch
        self.skinny = None  # CausalLM.set_fused_layers: the skinny GEMM's counters for the gate GEMM
        # CausalLM.set_fused_layers: the arrival counters of kernels/router.route_gate (gate GEMM + rule, one launch)
        self.gate_counters = None

    def forward(
        self, x: torch.Tensor, live_rows: torch.Tensor | None = None, shared: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], live_rows [1] int64 on x's device or None (all T) -> (topk_ids [T, K + shared] int64 (int32 from
        the kernel), topk_weights [T, K + shared] float32). Rows from live_rows on (pad rows) get NO_EXPERT at weight
        0. `shared` columns after the top-k route every live row to experts E.. at weight 1 (SharedExperts)."""
        if self.use_kernel:
            return self._kernel(x, live_rows, shared)
        ids, weights = self._sigmoid_grouped(x) if self.cfg.scoring == "sigmoid" else self._softmax(x)
        if shared:
            e = self.cfg.num_experts
            ids = torch.cat([ids, torch.arange(e, e + shared, device=x.device).expand(x.shape[0], shared)], dim=1)
            weights = torch.cat([weights, weights.new_ones(x.shape[0], shared)], dim=1)
        if live_rows is not None:
            pad = torch.arange(x.shape[0], device=x.device)[:, None] >= live_rows  # [T, 1]
            ids, weights = ids.masked_fill(pad, NO_EXPERT), weights.masked_fill(pad, 0.0)
        return ids, weights

    def route_with_runs(
        self, x: torch.Tensor, live_rows: torch.Tensor | None, shared: int, bm: int
    ) -> tuple[torch.Tensor, torch.Tensor, ExpertRuns | None]:  # forward's two, and fused_moe's layout of the slots
        """forward, and, where route_gate takes the call, fused_moe's slot layout in the same launch (else None:
        fused_moe aligns the slots itself)."""
        from specserve.kernels.router import can_route_gate, route_gate_with_runs

        if not (self.use_kernel and self.gate_counters is not None and can_route_gate(x, self.weight)):
            return *self.forward(x, live_rows, shared), None
        rule, bias = self._rule()
        return route_gate_with_runs(
            x, self.weight, rule, self.gate_counters, bm, bias, live_rows=live_rows, shared=shared
        )

    def _rule(self) -> tuple[RouterConfig, torch.Tensor | None]:  # the kernels' rule and its correction bias
        cfg = self.cfg
        sigmoid = cfg.scoring == "sigmoid"
        rule = RouterConfig(  # the softmax rule ignores groups and bias, as _softmax does
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            scoring=cfg.scoring,
            n_group=cfg.n_group if sigmoid else 1,
            topk_group=cfg.topk_group if sigmoid else 1,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )
        bias = self.e_score_correction_bias if sigmoid and cfg.correction_bias else None
        return rule, bias

    def _kernel(
        self, x: torch.Tensor, live_rows: torch.Tensor | None, shared: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from specserve.kernels.router import can_route_gate, route, route_gate

        rule, bias = self._rule()
        sigmoid = self.cfg.scoring == "sigmoid"
        if self.gate_counters is not None and can_route_gate(x, self.weight):
            return route_gate(x, self.weight, rule, self.gate_counters, bias, live_rows=live_rows, shared=shared)
        return route(self._logits(x, sigmoid), rule, bias, live_rows=live_rows, shared=shared)

    def _logits(self, x: torch.Tensor, sigmoid: bool) -> torch.Tensor:  # x [T, H] -> [T, E]
        """The gate GEMM as the torch rules compute it (sigmoid: float32 products and sums, softmax: x's dtype). A
        step's few rows go through the skinny GEMM: bf16 products are exact in float32, so the float32 logits differ
        from the float32 GEMM's only in summation order, and one launch replaces the GEMM, its split-K reduce and x's
        float32 copy."""
        from specserve.kernels.skinny_gemm import can_run, skinny_linear

        if self.skinny is not None and can_run(x, self.weight):
            return skinny_linear(x, self.weight, out_dtype=torch.float32 if sigmoid else None, counters=self.skinny)
        return F.linear(x.float(), self._weight_f32()) if sigmoid else F.linear(x, self.weight)

    def _weight_f32(self) -> torch.Tensor:  # [E, H] float32
        """The gate weight in float32 for the sigmoid rule, converted once (again only if the weight changes: the key
        is its storage and in-place version), not on every step."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype)
        if getattr(self, "_f32_key", None) != key:
            self._f32, self._f32_key = w.detach().float(), key
        return self._f32

    def _softmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * self.cfg.routed_scaling_factor

    def _sigmoid_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias if cfg.correction_bias else scores
        if cfg.n_group > 1:
            per_group = cfg.num_experts // cfg.n_group
            grouped = choice.view(-1, cfg.n_group, per_group)
            group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1)  # [T, n_group]
            best = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            keep = keep[:, :, None].expand(-1, -1, per_group).reshape(-1, cfg.num_experts)
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * cfg.routed_scaling_factor


class StackedExperts(nn.Module):
    """Parameters of the routed experts held by this rank (EP: a contiguous expert range; TP: an I-slice)."""

    def __init__(self, cfg: MoEConfig, hidden: int, parallel: ParallelConfig) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_experts = cfg.num_experts
        if parallel.ep:
            self.num_local = divide(cfg.num_experts, parallel.tp_size, "num_experts")
            self.first_expert = parallel.tp_rank * self.num_local
            self.inter = cfg.intermediate_size
        else:
            self.num_local, self.first_expert = cfg.num_experts, 0
            self.inter = divide(cfg.intermediate_size, parallel.tp_size, "moe_intermediate_size")
        self._make_params(hidden)

    def _make_params(self, hidden: int) -> None:
        self.w13 = new_param((self.num_local, 2 * self.inter, hidden))
        self.w2 = new_param((self.num_local, hidden, self.inter))
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

    def run(
        self,
        experts_fn: ExpertsFn,
        x: torch.Tensor,  # [T, H]
        ids: torch.Tensor,  # [T, K (+ shared.count)] local ids
        weights: torch.Tensor,  # [T, K (+ shared.count)]
        shared: SharedExperts | None = None,  # the shared experts as routed experts E.. (MoEBlock.shared_as_routed)
        slots_out: bool = False,  # fused_moe's slots before their sum (MoEBlock.set_slots_out)
        runs: ExpertRuns | None = None,  # fused_moe's slot layout, made in the router's launch
    ) -> torch.Tensor | SlotRows:  # [T, H]
        """The routed experts (and the shared ones riding along) through the block's experts_fn."""
        kwargs: dict[str, object] = {}
        if shared is not None:
            kwargs["shared"] = shared
        if slots_out:
            kwargs["sum_slots"] = False
        if runs is not None:
            kwargs["runs"] = runs
        return experts_fn(x, self.w13, self.w2, ids, weights, **kwargs)

    def local_experts(self) -> range:
        """Global ids of the experts stored here."""
        return range(self.first_expert, self.first_expert + self.num_local)

    def localize(
        self,
        topk_ids: torch.Tensor,  # [T, K] global expert ids
        topk_weights: torch.Tensor,  # [T, K]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, K] local ids, [T, K] weights)
        """EP: ids into this rank's expert stack; choices of other ranks' experts get weight 0 (and local
        expert 0, so any experts_fn can run them), so summing every rank's output counts each choice once."""
        if not self.parallel.ep or self.parallel.tp_size == 1:
            return topk_ids, topk_weights
        local = topk_ids - self.first_expert
        here = (local >= 0) & (local < self.num_local)
        return torch.where(here, local, 0), torch.where(here, topk_weights, 0.0)

    def _tp_slice(self, w: torch.Tensor, dim: int) -> torch.Tensor:
        return w if self.parallel.ep else shard(w, dim, self.parallel.tp_rank, self.parallel.tp_size)

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, expert: int | None = None, shard_id: str = ""
    ) -> None:
        """One expert's gate/up [I, H] or down [H, I] (expert given), or all experts fused: gate_up
        [E, 2I, H] / down [E, H, I] (expert None). Experts outside this rank are skipped."""
        if shard_id not in EXPERT_SHARDS:
            raise WeightShapeError(f"unknown expert shard {shard_id!r}")
        if expert is None:
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise WeightShapeError(
                    f"fused experts tensor has shape {tuple(loaded.shape)}, expected {self.num_experts} experts"
                )
            for e in self.local_experts():
                if shard_id == "gate_up":
                    full = loaded.shape[1] // 2
                    self.weight_loader(param, loaded[e, :full], e, "gate")
                    self.weight_loader(param, loaded[e, full:], e, "up")
                else:
                    self.weight_loader(param, loaded[e], e, shard_id)
            return
        if expert not in self.local_experts():
            return
        local = expert - self.first_expert
        if shard_id == "down":
            copy_checked(param.data[local], self._tp_slice(loaded, 1))
            return
        rows = slice(0, self.inter) if shard_id == "gate" else slice(self.inter, 2 * self.inter)
        copy_checked(param.data[local, rows], self._tp_slice(loaded, 0))


class MoEBlock(nn.Module):
    """Routed experts + optional shared experts; returns the routing for the verify-tax accounting."""

    def __init__(
        self,
        cfg: MoEConfig,
        hidden: int,
        parallel: ParallelConfig,
        experts_fn: ExpertsFn = moe_reference,
        experts: StackedExperts | None = None,  # e.g. int4 experts kept packed (models/quant_experts.py)
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = TopKRouter(cfg, hidden)
        self.experts = experts if experts is not None else StackedExperts(cfg, hidden, parallel)
        self.shared_experts = (
            GatedMLP(hidden, cfg.intermediate_size * cfg.n_shared_experts, parallel, reduce_results=False)
            if cfg.n_shared_experts
            else None
        )
        self.experts_fn = experts_fn
        self.parallel = parallel
        self.shared_as_routed: SharedExperts | None = None  # set_shared_as_routed
        self.slots_out = False  # set_slots_out

    def set_shared_as_routed(self, enabled: bool) -> None:
        """Run the shared experts as always-routed experts of the routed experts' launches (SharedExperts): one
        gate-up and one down launch for both, summed with the routed outputs in one fixed order, instead of a gate-up
        GEMM, its SiLU * up, a down GEMM and an add. The weights stay the shared MLP's own (its gate and up merged
        in place). Taken where the layout allows: float routed experts (int4 ones run their own kernels), no bias,
        the shared intermediate a multiple of the routed experts' (under tp: this rank's slices of both), and not
        expert-parallel (there the shared experts are tp slices and the routed ones whole)."""
        self.shared_as_routed = None
        mlp = self.shared_experts
        if not enabled or mlp is None or type(self.experts) is not StackedExperts:
            return
        if (self.parallel.ep and self.parallel.tp_size > 1) or mlp.down_proj.bias is not None:
            return
        inter, local = self.experts.inter, mlp.gate_proj.weight.shape[0]
        if local % inter or mlp.gate_proj.bias is not None:
            return
        if mlp.gate_up is None:
            mlp.fuse(True)
        self.shared_as_routed = SharedExperts(mlp.gate_up[0], mlp.down_proj.weight, local // inter)

    def set_slots_out(self, enabled: bool) -> None:
        """Return the experts' slots before their top-k sum (kernels/moe_reference.SlotRows) for the fused add +
        RMSNorm after the block to sum, and have the router's launch sort the slots by expert for fused_moe
        (TopKRouter.route_with_runs): two launches fewer a layer. Taken only where the experts_fn is fused_moe (the
        one that can return them) over float experts (int4 ones run their own kernels), no all-reduce follows (tp 1)
        and no shared MLP adds to the sum after it."""
        from specserve.kernels.fused_moe import fused_moe

        self.slots_out = (
            enabled
            and self.experts_fn is fused_moe
            and type(self.experts) is StackedExperts
            and self.parallel.tp_size == 1
            and (self.shared_experts is None or self.shared_as_routed is not None)
        )

    def forward(
        self, x: torch.Tensor, live_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | SlotRows, torch.Tensor]:
        """x [T, H], live_rows [1] int64 on x's device (None: all T) -> (out [T, H], topk_ids [T, K]).

        Rows from live_rows on are pad rows (AttentionBatch.pad_rows): they route to NO_EXPERT at weight 0, so every
        experts_fn gives them no expert work and 0, and topk_ids says so. live_rows is device data: a CUDA graph
        captured at the padded row count skips however many rows each replay pads.
        Under tp each rank's routed output is partial (TP: its I-slice of every expert; EP: its experts'
        choices only), as is its shared-experts output (TP slice); one all-reduce sums both."""
        shared = self.shared_as_routed
        if self.slots_out:  # float experts through fused_moe at tp 1 (set_slots_out): aligned in the router's launch
            from specserve.kernels.fused_moe import default_tile_config

            count = 0 if shared is None else shared.count
            bm = default_tile_config(x.shape[0], x.shape[1], self.experts.inter).bm
            topk_ids, topk_weights, runs = self.gate.route_with_runs(x, live_rows, count, bm)
            out = self.experts.run(self.experts_fn, x, topk_ids, topk_weights, shared, slots_out=True, runs=runs)
            return out, topk_ids[:, : self.cfg.top_k]
        if shared is not None:  # one launch set for routed and shared experts; ids E.. are the shared ones
            topk_ids, topk_weights = self.gate(x, live_rows, shared=shared.count)
            out = self.experts.run(self.experts_fn, x, topk_ids, topk_weights, shared)
            return all_reduce(out, self.parallel), topk_ids[:, : self.cfg.top_k]
        topk_ids, topk_weights = self.gate(x, live_rows)
        ids, weights = self.experts.localize(topk_ids, topk_weights)
        out = self.experts.run(self.experts_fn, x, ids, weights)
        if self.shared_experts is not None:  # the routed sum added in the shared down GEMM's epilogue (fused layers)
            out = self.shared_experts(x, add=out)
        return all_reduce(out, self.parallel), topk_ids
