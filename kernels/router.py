"""The MoE router after the gate GEMM in one kernel: scores, correction bias, grouped top-k, top-k,
renormalisation and scaling.

  route(logits [T, E], cfg: RouterConfig, correction_bias [E] | None) -> (topk_ids [T, K] int32,
                                                                          topk_weights [T, K] fp32)
Same rule as router_reference.py (the model's TopKRouter): on inputs without ties the ids are equal and in the
same order (descending choice score); ties go to the lowest expert id. One program per token, no host syncs
(CUDA-graph capturable); `topk_ids=` / `topk_weights=` take caller buffers. `live_rows=` ([1] int64, device data:
the target's invariant steps) routes the rows from it on to NO_EXPERT (-1) at weight 0 without scoring them.
`shared=S` appends S columns routing every live row to experts E..E+S-1 at weight 1: the shared experts run as
routed ones by kernels/fused_moe.py (moe_reference.SharedExperts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.checks import check_dim, check_same_device, check_tensor, require, triton_interpreting
from specserve.kernels.fused_moe import max_blocks
from specserve.kernels.launch import chained
from specserve.kernels.moe_reference import ExpertRuns
from specserve.kernels.router_reference import RouterConfig

try:
    import triton

    from specserve.kernels import router_triton as _k

    HAS_TRITON = True
except ImportError:  # CPU-only installs (CI) have no triton; router_reference.py still works.
    HAS_TRITON = False

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_EXPERTS = 4096
MAX_TOP_K = 64


def _out(
    name: str, buf: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype, like: torch.Tensor
) -> torch.Tensor:
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    check_tensor(name, buf, 2, (dtype,))
    require(tuple(buf.shape) == shape, f"{name} has shape {tuple(buf.shape)}, expected {shape}")
    check_same_device([("logits", like), (name, buf)])
    return buf


def _check_same_device_with(
    *,
    named: list[tuple[str, torch.Tensor]],
    correction_bias: torch.Tensor | None,  # [E]
    live_rows: torch.Tensor | None,  # [1] int64
    e: int,
) -> None:
    """The router's optional inputs checked (route and route_gate), then every tensor on one device."""
    named = list(named)
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, 1, _LOGIT_DTYPES)
        check_dim("correction_bias", correction_bias, 0, e, "the number of experts E")
        named.append(("correction_bias", correction_bias))
    if live_rows is not None:
        check_tensor("live_rows", live_rows, 1, (torch.int64,))
        check_dim("live_rows", live_rows, 0, 1, "one count")
        named.append(("live_rows", live_rows))
    check_same_device(named)


def route(
    logits: torch.Tensor,  # [T, E] gate GEMM output (rows may be strided; last dim contiguous)
    cfg: RouterConfig,
    correction_bias: torch.Tensor | None = None,  # [E] fp32/bf16/fp16, for the choice only
    *,
    topk_ids: torch.Tensor | None = None,  # [T, K] int32 out
    topk_weights: torch.Tensor | None = None,  # [T, K] fp32 out
    live_rows: torch.Tensor | None = None,  # [1] int64 on the logits' device: rows from it on route to NO_EXPERT
    shared: int = 0,  # shared experts run as routed ones (fused_moe's `shared`): K + shared columns, ids E.. at 1.0
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_ids [T, K + shared] int32, topk_weights [T, K + shared] fp32)
    require(isinstance(cfg, RouterConfig), f"cfg must be a RouterConfig, got {type(cfg).__name__}")
    check_tensor("logits", logits, 2, _LOGIT_DTYPES, contiguous=False)
    require(logits.stride(1) == 1, f"logits must be contiguous in its last dim, strides {logits.stride()}")
    t, e = logits.shape
    check_dim("logits", logits, 1, cfg.num_experts, "cfg.num_experts")
    require(
        e <= MAX_EXPERTS and cfg.top_k <= MAX_TOP_K,
        f"at most {MAX_EXPERTS} experts and top_k {MAX_TOP_K}, got {e} and {cfg.top_k}",
    )
    _check_same_device_with(named=[("logits", logits)], correction_bias=correction_bias, live_rows=live_rows, e=e)
    require(HAS_TRITON, "the Triton router needs the triton package, which is not installed")
    require(logits.is_cuda or triton_interpreting(), f"the Triton router needs CUDA tensors, got {logits.device}")
    require(0 <= shared <= MAX_TOP_K, f"shared must lie in [0, {MAX_TOP_K}], got {shared}")
    k = cfg.top_k
    topk_ids = _out("topk_ids", topk_ids, (t, k + shared), torch.int32, logits)
    topk_weights = _out("topk_weights", topk_weights, (t, k + shared), torch.float32, logits)
    if t == 0:
        return topk_ids, topk_weights
    _k.router_kernel[(t,)](
        logits,
        correction_bias if correction_bias is not None else logits,
        topk_ids,
        topk_weights,
        live_rows if live_rows is not None else topk_ids,
        logits.stride(0),
        topk_ids.stride(0),
        topk_weights.stride(0),
        float(cfg.routed_scaling_factor),
        cfg.renorm_eps,
        **_rule_args(cfg, e, live_rows is not None, correction_bias is not None, shared),
        **chained(logits),
    )
    return topk_ids, topk_weights


def _rule_args(cfg: RouterConfig, e: int, has_live: bool, has_bias: bool, shared: int) -> dict:
    """The routing rule's compile-time arguments (both kernels) and the program's warps."""
    per_group = e // cfg.n_group
    g_pad, pg_pad = triton.next_power_of_2(cfg.n_group), triton.next_power_of_2(per_group)
    return dict(
        E=e,
        K=cfg.top_k,
        K_PAD=triton.next_power_of_2(cfg.top_k),
        N_GROUP=cfg.n_group,
        PER_GROUP=per_group,
        TOPK_GROUP=cfg.topk_group,
        G_PAD=g_pad,
        PG_PAD=pg_pad,
        SIGMOID=cfg.scoring == "sigmoid",
        HAS_BIAS=has_bias,
        RENORM=cfg.norm_topk_prob,
        HAS_LIVE=has_live,
        SHARED=shared,
        S_PAD=triton.next_power_of_2(max(1, shared)),
        num_warps=1 if g_pad * pg_pad <= 128 else 2 if g_pad * pg_pad <= 512 else 4,
    )


GATE_MAX_ROWS = 64  # route_gate takes up to this many rows (a step's); the counters hold one per row


@dataclass(frozen=True)
class GateTile:
    """route_gate's programs: eb experts each (a power of two), bk of H a load, warps."""

    eb: int
    bk: int
    warps: int = 4


def default_gate_tile(num_experts: int, hidden: int) -> GateTile:
    """One expert a program, 2 warps: the fastest tile of the H200 sweep at Moonlight's, Qwen3-30B-A3B's and K2.6's
    gates (BENCHMARKS' eleventh pass, `gate-sweep.json`: 5.0-6.2 us a call against 7.4-29 us for the float32 GEMM
    and the router kernel; more experts a program was slower at every width)."""
    return GateTile(1, max(16, min(triton.next_power_of_2(hidden), 4096)), 2)


def new_gate_counters(device: torch.device | str) -> torch.Tensor:  # [GATE_MAX_ROWS + 1] int32 zeros
    """Arrival counters for route_gate: one a row, then the routed-rows count of route_gate_with_runs (each call
    leaves them at zero; a model's routers run one at a time)."""
    return torch.zeros(GATE_MAX_ROWS + 1, dtype=torch.int32, device=device)


def can_route_gate(x: torch.Tensor, weight: torch.Tensor) -> bool:  # x [T, H], weight [E, H]
    """Whether route_gate takes this call (else the gate GEMM, then route)."""
    return (
        HAS_TRITON
        and (x.is_cuda or triton_interpreting())
        and x.dim() == 2
        and 1 <= x.shape[0] <= GATE_MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.is_contiguous()
    )


def route_gate(
    x: torch.Tensor,  # [T, H] the MoE block's input, T <= GATE_MAX_ROWS
    weight: torch.Tensor,  # [E, H] the gate weight, x's dtype
    cfg: RouterConfig,
    counters: torch.Tensor,  # [GATE_MAX_ROWS] int32 from new_gate_counters
    correction_bias: torch.Tensor | None = None,  # [E]
    *,
    live_rows: torch.Tensor | None = None,  # [1] int64
    shared: int = 0,
    tile: GateTile | None = None,  # None: default_gate_tile
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_ids [T, K + shared] int32, topk_weights [T, K + shared] fp32)
    """The gate GEMM and route() in one launch. The logits are fp32 sums of x's products with the weight (the
    sigmoid rule's float32 GEMM up to summation order), rounded to x's dtype for the softmax rule (its GEMM's
    output dtype); then the rule as route() applies it."""
    ids, weights, _ = _route_gate(x, weight, cfg, counters, correction_bias, live_rows, shared, tile, 0)
    return ids, weights


def route_gate_with_runs(
    x: torch.Tensor,  # [T, H] the MoE block's input, T <= GATE_MAX_ROWS
    weight: torch.Tensor,  # [E, H] the gate weight, x's dtype
    cfg: RouterConfig,
    counters: torch.Tensor,  # [GATE_MAX_ROWS + 1] int32 from new_gate_counters
    bm: int,  # fused_moe's block rows for T tokens (fused_moe.default_tile_config(T, ...).bm)
    correction_bias: torch.Tensor | None = None,  # [E]
    *,
    live_rows: torch.Tensor | None = None,  # [1] int64
    shared: int = 0,
    tile: GateTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor, ExpertRuns]:  # route_gate's two, and fused_moe's slot layout of them
    """route_gate, and in the same launch fused_moe's align step over the T * (K + shared) slots (the program that
    routes the step's last row sorts them): fused_moe(runs=...) then skips its own align launch. Same layout as
    fused_moe.align_triton of the returned ids."""
    require(isinstance(bm, int) and bm >= 1 and not bm & (bm - 1), f"bm must be a power of two, got {bm!r}")
    require(counters.numel() > GATE_MAX_ROWS, f"counters hold {counters.numel()}, need {GATE_MAX_ROWS + 1}")
    return _route_gate(x, weight, cfg, counters, correction_bias, live_rows, shared, tile, bm)


def _route_gate(
    x: torch.Tensor,
    weight: torch.Tensor,
    cfg: RouterConfig,
    counters: torch.Tensor,
    correction_bias: torch.Tensor | None,
    live_rows: torch.Tensor | None,
    shared: int,
    tile: GateTile | None,
    bm: int,  # > 0: also the slots' layout (route_gate_with_runs)
) -> tuple[torch.Tensor, torch.Tensor, ExpertRuns | None]:
    require(isinstance(cfg, RouterConfig), f"cfg must be a RouterConfig, got {type(cfg).__name__}")
    require(can_route_gate(x, weight), "route_gate needs bf16/fp16 x [T <= 64, H] and weight [E, H] on CUDA")
    check_tensor("counters", counters, 1, (torch.int32,))
    require(counters.numel() >= x.shape[0], f"counters hold {counters.numel()} rows, x has {x.shape[0]}")
    t, h = x.shape
    e = cfg.num_experts
    check_dim("weight", weight, 0, e, "cfg.num_experts")
    check_dim("weight", weight, 1, h, "the hidden size H = x.shape[1]")
    require(
        e <= MAX_EXPERTS and cfg.top_k <= MAX_TOP_K and 0 <= shared <= MAX_TOP_K,
        f"at most {MAX_EXPERTS} experts, top_k {MAX_TOP_K} and {MAX_TOP_K} shared, got {e}, {cfg.top_k}, {shared}",
    )
    named = [("x", x), ("weight", weight), ("counters", counters)]
    _check_same_device_with(named=named, correction_bias=correction_bias, live_rows=live_rows, e=e)
    k = cfg.top_k
    ids = torch.empty(t, k + shared, dtype=torch.int32, device=x.device)
    weights = torch.empty(t, k + shared, dtype=torch.float32, device=x.device)
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    tile = tile or default_gate_tile(e, h)
    require(
        isinstance(tile, GateTile)
        and min(tile.eb, tile.bk // 16) >= 1
        and not (tile.eb & (tile.eb - 1) or tile.bk & (tile.bk - 1)),
        f"tile must be a GateTile with powers of two eb and bk >= 16, got {tile}",
    )
    runs, n_pad = None, 1
    if bm:
        n = t * (k + shared)
        n_pad = triton.next_power_of_2(n)
        maxb = max_blocks(n, e + shared, bm)
        runs = ExpertRuns(
            torch.empty(maxb * bm, dtype=torch.int32, device=x.device),
            torch.empty(maxb, dtype=torch.int32, device=x.device),
            torch.empty(1, dtype=torch.int32, device=x.device),
            bm,
            e + shared,
        )
    scratch = torch.empty(n_pad, dtype=torch.int32, device=x.device) if bm else ids
    _k.gate_router_kernel[(t, triton.cdiv(e, tile.eb))](
        x,
        weight,
        logits,
        counters,
        correction_bias if correction_bias is not None else logits,
        ids,
        weights,
        live_rows if live_rows is not None else ids,
        h,
        x.stride(0),
        weight.stride(0),
        ids.stride(0),
        weights.stride(0),
        float(cfg.routed_scaling_factor),
        cfg.renorm_eps,
        EB=tile.eb,
        BK=tile.bk,
        ROUND_LOGITS=cfg.scoring != "sigmoid",
        sorted_slot_ptr=runs.sorted_slot if runs else ids,
        block_expert_ptr=runs.block_expert if runs else ids,
        num_blocks_ptr=runs.num_blocks if runs else ids,
        scratch_ptr=scratch,
        all_at=GATE_MAX_ROWS,
        align_experts=e + shared,
        maxp=runs.sorted_slot.numel() if runs else 0,
        ALIGN=bool(bm),
        N_PAD=n_pad,
        BM=max(bm, 1),
        FILL=1024,
        **dict(_rule_args(cfg, e, live_rows is not None, correction_bias is not None, shared), num_warps=tile.warps),
        **chained(x),
    )
    return ids, weights, runs
