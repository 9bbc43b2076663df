"""Fused routed-experts MoE: checked wrapper around the Triton kernels, a torch._grouped_mm path, and dispatch.

fused_moe(hidden [T,H], w13 [E,2I,H], w2 [E,H,I], topk_ids [T,K], topk_weights [T,K]) -> [T,H] computes the
same function as moe_reference: sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t,k].

Triton path (three launches plus a deterministic top-k sum, no host sync, CUDA-graph capturable):
  1. moe_align_kernel sorts the T*K slots by expert and pads each expert's run to BM rows;
  2. moe_gate_up_kernel: per (M-block, N-tile of I) both gate and up GEMMs and SiLU(gate)*up, one pass over H;
  3. moe_down_kernel: per (M-block, N-tile of H) the down GEMM times the routing weight, into [T*K, H] fp32;
  4. sum_topk_kernel: sum over k in fixed order (or, with sum_slots=False, the fused add + RMSNorm after the MoE:
     fused_moe returns the slots as a SlotRows and kernels/norm.fused_add_rms_norm sums them in its launch).
With BM >= the most rows any expert can get (T for T <= 64), every routed expert's weights are read once per call.
A slot routed to NO_EXPERT (kernels/moe_reference.py: the pad rows of invariant steps) gets no row in step 1, so it
costs no GEMM work and reads no weights, and step 4 adds 0 for it (its [T*K, H] row is never written).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels.checks import (
    KernelArgumentError,
    check_dim,
    check_same_device,
    check_tensor,
    require,
    triton_interpreting,
)
from specserve.kernels.launch import chained
from specserve.kernels.moe_reference import NO_EXPERT, ExpertRuns, SharedExperts, SlotRows

try:
    import triton

    from specserve.kernels import moe_triton

    HAS_TRITON = True
except ImportError:  # CPU-only installs (CI) have no triton; the torch paths still work.
    HAS_TRITON = False

_FLOAT_DTYPES = (torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALIGN_IN_TRITON_MAX_SLOTS = 4096  # T*K above this: sort with torch ops (same row layout)
BACKENDS = ("auto", "triton", "grouped_mm")


@dataclass(frozen=True)
class MoETileConfig:
    """Tile sizes of the two GEMM kernels. bm rows per M-block (one expert per block)."""

    bm: int
    gu_bn: int
    gu_bk: int
    gu_warps: int
    gu_stages: int
    dn_bn: int
    dn_bk: int
    dn_warps: int
    dn_stages: int

    def __post_init__(self) -> None:
        for name in ("bm", "gu_bn", "gu_bk", "dn_bn", "dn_bk", "gu_warps", "dn_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise KernelArgumentError(f"MoETileConfig.{name} must be a power of two, got {v}")
        for name in ("bm", "gu_bn", "gu_bk", "dn_bn", "dn_bk"):
            if getattr(self, name) < 16:
                raise KernelArgumentError(f"MoETileConfig.{name} must be >= 16 (tl.dot minimum)")
        if self.gu_stages < 1 or self.dn_stages < 1:
            raise KernelArgumentError("MoETileConfig stages must be >= 1")


def default_tile_config(num_tokens: int, hidden: int, inter: int) -> MoETileConfig:
    """Heuristic tiles: decode sizes stream weights with narrow N tiles; prefill sizes use wide tiles. Up to 32 rows
    the blocks hold 16: a padded step of 17 rows (the invariant steps' decode and verify) has few live rows, and 32-row
    blocks cost its decode 0.1 ms of MMA at Moonlight (BENCHMARKS' twelfth pass); an expert that more than 16 live
    rows choose (a shared expert in a 17-token verify) is then read twice."""
    if num_tokens <= 64:
        bm = 16 if num_tokens <= 32 else max(16, triton_next_pow2(num_tokens))
        gu_bn = 32 if bm <= 32 else 64
        return MoETileConfig(bm, gu_bn, 128 if bm <= 32 else 64, 4, 4, 64, 128 if bm <= 32 else 64, 4, 4)
    return MoETileConfig(64, 128, 64, 8, 3, 128, 64, 8, 3)


def triton_next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(1, n) - 1).bit_length()


def check_moe_args(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
) -> tuple[int, int, int, int, int]:
    """Validate the MoE arguments; return (T, H, E, I, K)."""
    check_tensor("hidden", hidden, 2, _FLOAT_DTYPES)
    check_tensor("w13", w13, 3, _FLOAT_DTYPES)
    check_tensor("w2", w2, 3, _FLOAT_DTYPES)
    check_tensor("topk_ids", topk_ids, 2, _ID_DTYPES)
    check_tensor("topk_weights", topk_weights, 2, _WEIGHT_DTYPES)
    t, h = hidden.shape
    e, two_i, _ = w13.shape
    require(t >= 1, f"hidden must hold at least one token, got shape {tuple(hidden.shape)}")
    require(two_i % 2 == 0 and two_i > 0, f"w13.shape[1] must be 2*I (gate rows then up rows), got {two_i}")
    inter = two_i // 2
    check_dim("w13", w13, 2, h, "hidden size H = hidden.shape[1]")
    check_dim("w2", w2, 0, e, "number of experts E = w13.shape[0]")
    check_dim("w2", w2, 1, h, "hidden size H = hidden.shape[1]")
    check_dim("w2", w2, 2, inter, "intermediate size I = w13.shape[1] // 2")
    check_dim("topk_ids", topk_ids, 0, t, "number of tokens T = hidden.shape[0]")
    require(
        topk_weights.shape == topk_ids.shape,
        f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids shape {tuple(topk_ids.shape)}",
    )
    require(
        w13.dtype == hidden.dtype and w2.dtype == hidden.dtype,
        f"hidden, w13, w2 must share a dtype, got {hidden.dtype}, {w13.dtype}, {w2.dtype}",
    )
    check_same_device(
        [("hidden", hidden), ("w13", w13), ("w2", w2), ("topk_ids", topk_ids), ("topk_weights", topk_weights)]
    )
    return t, h, e, inter, topk_ids.shape[1]


def check_shared(shared: SharedExperts | None, hidden: torch.Tensor, inter: int) -> int:  # hidden [T, H]
    """Validate shared experts run as routed experts E..E+count-1; return their count (0 for None)."""
    if shared is None:
        return 0
    require(isinstance(shared, SharedExperts), f"shared must be a SharedExperts, got {type(shared).__name__}")
    require(shared.count >= 1, f"shared.count must be >= 1, got {shared.count}")
    check_tensor("shared.w13", shared.w13, 2, _FLOAT_DTYPES)
    check_tensor("shared.w2", shared.w2, 2, _FLOAT_DTYPES)
    h = hidden.shape[1]
    rows = shared.count * inter
    require(
        tuple(shared.w13.shape) == (2 * rows, h) and tuple(shared.w2.shape) == (h, rows),
        f"shared weights must be [2*{shared.count}*I, H] = {(2 * rows, h)} and [H, {shared.count}*I] = {(h, rows)}, "
        f"got {tuple(shared.w13.shape)} and {tuple(shared.w2.shape)}",
    )
    require(
        shared.w13.dtype == hidden.dtype and shared.w2.dtype == hidden.dtype,
        f"shared weights must have hidden's dtype {hidden.dtype}, got {shared.w13.dtype}, {shared.w2.dtype}",
    )
    check_same_device([("hidden", hidden), ("shared.w13", shared.w13), ("shared.w2", shared.w2)])
    return shared.count


def check_routing_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Check 0 <= topk_ids < E (one device sync; call it in debug paths, not per decode step)."""
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    require(lo >= 0 and hi < num_experts, f"topk_ids must lie in [0, {num_experts}), got range [{lo}, {hi}]")


def align_torch(
    topk_ids: torch.Tensor,  # [T, K]
    num_experts: int,
    bm: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch version of moe_align_kernel (same layout): (sorted_slot [MAXP], block_expert [MAXB], num_blocks [1]).
    Slots of NO_EXPERT get no row (so no block, no work)."""
    flat = topk_ids.reshape(-1).long()  # [N]
    n = flat.numel()
    maxb = max_blocks(n, num_experts, bm)
    dev = flat.device
    key = torch.where(flat == NO_EXPERT, num_experts, flat)  # [N]: skipped slots sort after every expert
    sorted_ids, order = torch.sort(key, stable=True)  # [N], [N]
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).index_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]  # [E]
    blocks_e = (counts + bm - 1) // bm  # [E]
    blk_cum = torch.cumsum(blocks_e, 0)  # [E] inclusive
    seg_start = torch.cumsum(counts, 0) - counts  # [E]
    live = sorted_ids < num_experts  # [N]
    sid = sorted_ids.clamp(max=num_experts - 1)
    pos = torch.arange(n, device=dev) - seg_start[sid]  # [N]
    blk = blk_cum[sid] - blocks_e[sid] + pos // bm  # [N]
    dest = torch.where(live, blk * bm + pos % bm, maxb * bm)  # a skipped slot lands in the extra entry, cut below
    sorted_slot = torch.full((maxb * bm + 1,), n, dtype=torch.int32, device=dev)
    sorted_slot[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(blk_cum, torch.arange(maxb, device=dev), right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_slot[: maxb * bm], block_expert, blk_cum[-1:].to(torch.int32)


def check_runs(runs: ExpertRuns, num_slots: int, num_experts: int, bm: int, device: torch.device) -> None:
    """A layout made elsewhere (the router's launch) must be this call's: same experts, block rows and sizes."""
    require(isinstance(runs, ExpertRuns), f"runs must be an ExpertRuns, got {type(runs).__name__}")
    require(
        runs.bm == bm and runs.num_experts == num_experts,
        f"runs were aligned for {runs.num_experts} experts in blocks of {runs.bm}, this call has {num_experts}, {bm}",
    )
    maxb = max_blocks(num_slots, num_experts, bm)
    for name, tensor, size in (
        ("sorted_slot", runs.sorted_slot, maxb * bm),
        ("block_expert", runs.block_expert, maxb),
        ("num_blocks", runs.num_blocks, 1),
    ):
        check_tensor(f"runs.{name}", tensor, 1, (torch.int32,))
        check_dim(f"runs.{name}", tensor, 0, size, f"the layout of {num_slots} slots")
        require(tensor.device == device, f"runs.{name} is on {tensor.device}, hidden on {device}")


def max_blocks(num_slots: int, num_experts: int, bm: int) -> int:
    """Upper bound on BM-row blocks after padding each expert's run: ceil(N/BM) + min(E, N)."""
    return -(-num_slots // bm) + min(num_experts, num_slots)


def align_triton(
    topk_ids: torch.Tensor,  # [T, K]
    num_experts: int,
    bm: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-program Triton sort-and-pad; same outputs as align_torch."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    n_pad = triton_next_pow2(n)
    maxb = max_blocks(n, num_experts, bm)
    dev = flat.device
    sorted_slot = torch.empty(maxb * bm, dtype=torch.int32, device=dev)
    block_expert = torch.empty(maxb, dtype=torch.int32, device=dev)
    num_blocks = torch.empty(1, dtype=torch.int32, device=dev)
    scratch = torch.empty(n_pad, dtype=torch.int32, device=dev)
    moe_triton.moe_align_kernel[(1,)](
        flat,
        sorted_slot,
        block_expert,
        num_blocks,
        scratch,
        n,
        num_experts,
        maxb * bm,
        N_PAD=n_pad,
        BM=bm,
        FILL=1024,
        num_warps=4 if n_pad <= 1024 else 8,
        **chained(flat),
    )
    return sorted_slot, block_expert, num_blocks


def fused_moe_triton(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    config: MoETileConfig | None = None,
    shared: SharedExperts | None = None,
    sum_slots: bool = True,
    runs: ExpertRuns | None = None,
) -> torch.Tensor | SlotRows:  # [T, H], or the slots before their sum (sum_slots=False)
    """The Triton path (arguments already checked)."""
    t, h = hidden.shape
    e, two_i, _ = w13.shape
    inter, k = two_i // 2, topk_ids.shape[1]
    n = t * k
    cfg = config or default_tile_config(t, h, inter)
    s = 0 if shared is None else shared.count
    if runs is not None:  # aligned in the router's launch (route_gate_with_runs)
        check_runs(runs, n, e + s, cfg.bm, hidden.device)
        sorted_slot, block_expert, num_blocks = runs.sorted_slot, runs.block_expert, runs.num_blocks
    elif n <= ALIGN_IN_TRITON_MAX_SLOTS:
        sorted_slot, block_expert, num_blocks = align_triton(topk_ids, e + s, cfg.bm)
    else:
        sorted_slot, block_expert, num_blocks = align_torch(topk_ids, e + s, cfg.bm)
    ws13, ws2 = (w13, w2) if shared is None else (shared.w13, shared.w2)  # unread without shared
    maxb = block_expert.numel()
    act = torch.empty(maxb * cfg.bm, inter, dtype=hidden.dtype, device=hidden.device)  # [MAXP, I]
    moe_triton.moe_gate_up_kernel[(maxb, triton.cdiv(inter, cfg.gu_bn))](
        hidden,
        w13,
        act,
        sorted_slot,
        block_expert,
        num_blocks,
        ws13,
        n,
        k,
        h,
        inter,
        e,
        s * inter,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        ws13.stride(-2),
        act.stride(0),
        BM=cfg.bm,
        BN=cfg.gu_bn,
        BK=cfg.gu_bk,
        HAS_SHARED=shared is not None,
        num_warps=cfg.gu_warps,
        num_stages=cfg.gu_stages,
        **chained(hidden),
    )
    per_slot = torch.empty(n, h, dtype=torch.float32, device=hidden.device)  # [T*K, H]
    moe_triton.moe_down_kernel[(maxb, triton.cdiv(h, cfg.dn_bn))](
        act,
        w2,
        topk_weights.reshape(-1),
        per_slot,
        sorted_slot,
        block_expert,
        num_blocks,
        ws2,
        n,
        h,
        inter,
        e,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        ws2.stride(-2),
        per_slot.stride(0),
        BM=cfg.bm,
        BN=cfg.dn_bn,
        BK=cfg.dn_bk,
        HAS_SHARED=shared is not None,
        num_warps=cfg.dn_warps,
        num_stages=cfg.dn_stages,
        **chained(act),
    )
    slots = SlotRows(per_slot, topk_ids.reshape(-1), k, hidden.dtype)
    return sum_slots_of(slots) if sum_slots else slots


def sum_slots_of(slots: SlotRows) -> torch.Tensor:  # [T, H] slots.dtype
    """A SlotRows' sum: one Triton launch where it can run (sum_topk_kernel), else SlotRows.total in torch."""
    if not (HAS_TRITON and (slots.rows.is_cuda or triton_interpreting())):
        return slots.total()
    t, h = slots.shape
    out = torch.empty(t, h, dtype=slots.dtype, device=slots.rows.device)
    bh = min(1024, triton_next_pow2(h))
    moe_triton.sum_topk_kernel[(t, triton.cdiv(h, bh))](
        slots.rows, slots.ids, out, h, TOPK=slots.k, BH=bh, SKIP=True, PARTS=1, num_warps=4, **chained(out)
    )
    return out


def moe_grouped_mm(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    shared: SharedExperts | None = None,
) -> torch.Tensor:  # [T, H]
    """Library baseline: tokens sorted by expert, two torch._grouped_mm calls, SiLU*up between (no host sync).
    Shared chunks (ids E..) run as dense MLPs over every row, times each row's weight for them (0 if not chosen)."""
    check_moe_args(hidden, w13, w2, topk_ids, topk_weights)
    t, k = topk_ids.shape
    e, inter = w13.shape[0], w13.shape[1] // 2
    check_shared(shared, hidden, inter)
    flat = topk_ids.reshape(-1).long()  # [N]
    live = (flat != NO_EXPERT) & (flat < e)  # [N] routed slots
    key = torch.where(live, flat, e)  # skipped slots sort last, past every group's rows
    order = torch.argsort(key, stable=True)  # [N]
    tok = order // k  # [N]
    counts = torch.zeros(e + 1, dtype=torch.int32, device=flat.device).index_add_(
        0, key, torch.ones_like(key, dtype=torch.int32)
    )[:e]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E]
    gu = torch._grouped_mm(hidden[tok], w13.transpose(1, 2), offs=offs)  # [N, 2I]
    act = F.silu(gu[:, :inter]) * gu[:, inter:]  # [N, I]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [N, H]
    y = y.float() * topk_weights.reshape(-1)[order, None].float()
    y = torch.where(live[order, None], y, 0.0)  # rows past the last group are not computed
    out = torch.zeros(t, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    out.index_add_(0, tok, y)
    for j in range(0 if shared is None else shared.count):
        gu_w, down_w = shared.expert(j, inter)  # [2I, H], [H, I]
        gu = hidden @ gu_w.t()  # [T, 2I]
        weight = (topk_weights.float() * (topk_ids == e + j)).sum(1, keepdim=True)  # [T, 1]
        out += ((F.silu(gu[:, :inter]) * gu[:, inter:]) @ down_w.t()).float() * weight
    return out.to(hidden.dtype)


# Triton measured faster than grouped_mm at every T tried (1..4096 Qwen3-30B-A3B, 1..256 Kimi-K2; NOTES.md);
# above 4096 tokens nothing was measured, so auto falls back to the library path there.
GROUPED_MM_ABOVE_TOKENS = 4096


def pick_backend(hidden: torch.Tensor) -> str:  # hidden [T, H]
    """Auto dispatch: Triton on CUDA up to GROUPED_MM_ABOVE_TOKENS tokens, else grouped_mm (also on CPU)."""
    usable = HAS_TRITON and (hidden.is_cuda or triton_interpreting())
    return "triton" if usable and hidden.shape[0] <= GROUPED_MM_ABOVE_TOKENS else "grouped_mm"


def fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]  gate rows then up rows, per expert
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K] int32/int64 expert ids
    topk_weights: torch.Tensor,  # [T, K] routing weights (applied after the down projection)
    *,
    backend: str = "auto",
    config: MoETileConfig | None = None,
    validate_ids: bool = False,
    shared: SharedExperts | None = None,  # shared experts as routed experts E.. (the router gives their ids)
    sum_slots: bool = True,  # False: the Triton path returns its slots before the top-k sum (SlotRows)
    runs: ExpertRuns | None = None,  # the Triton path's slot layout, made in the router's launch (else aligned here)
) -> torch.Tensor | SlotRows:  # [T, H]
    """Routed-experts MoE; same function as moe_reference. backend: auto | triton | grouped_mm.

    auto = Triton on CUDA for T <= GROUPED_MM_ABOVE_TOKENS, torch._grouped_mm otherwise (CPU included).
    validate_ids=True checks 0 <= topk_ids < E (+ shared.count) first (one device sync); out-of-range ids are not
    caught otherwise.
    """
    _, _, e, inter, _ = check_moe_args(hidden, w13, w2, topk_ids, topk_weights)
    s = check_shared(shared, hidden, inter)
    require(backend in BACKENDS, f"backend must be one of {BACKENDS}, got {backend!r}")
    if validate_ids:
        check_routing_ids(topk_ids, e + s)
    chosen = pick_backend(hidden) if backend == "auto" else backend
    if chosen == "grouped_mm":
        return moe_grouped_mm(hidden, w13, w2, topk_ids, topk_weights, shared)
    require(HAS_TRITON, "backend 'triton' needs the triton package, which is not installed")
    require(
        hidden.is_cuda or triton_interpreting(), f"the Triton MoE needs CUDA tensors, got hidden on {hidden.device}"
    )
    return fused_moe_triton(hidden, w13, w2, topk_ids, topk_weights, config, shared, sum_slots, runs)
