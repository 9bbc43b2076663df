"""Triton kernel of the MoE router (imported only where triton is installed; see router.py for the wrapper).

router_kernel: one program per token over logits the gate GEMM wrote. gate_router_kernel: the gate GEMM too, in
one launch: program (t, b) computes row t's logits of experts b*EB.. (fp32 sums of x's products with the bf16
weight, in a fixed order), writes them to a scratch row and counts itself in at row t's arrival counter; the
program that arrives last (acq_rel atomics at gpu scope, the others' logits read past L1) routes the row and
resets the counter. A row's logits and routing depend on that row only.

Each routing program: its E logits are held as a [G_PAD, PG_PAD] tile, row g = expert group g (expert
g * PER_GROUP + p), so group scores are row reductions. Selection is K rounds of "take the largest remaining
choice score" (ties: the lowest expert id), which yields the ids in descending order of the choice score.
Each pick is a max, then a min over the tile positions holding that max: plain max/min reductions on the 2-D
tile. v1 flattened the tile with tl.reshape and took tl.argmax; the sm_90 build marks that reshape
`allow_reorder` (TTGIR), so the argmax index no longer named the element it found and the same expert was
picked again (seen on the H200: repeated experts for 128-expert softmax top-8). The interpreter keeps the order,
so only the compiled kernel showed it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.kernels.chain_triton import chain_in
from specserve.kernels.moe_triton import align_slots

NEG_INF = tl.constexpr(float("-inf"))
BIG = tl.constexpr(1 << 30)


@triton.jit
def _first_max(x, idx):
    """Smallest idx among the largest elements of x (x, idx [G_PAD, PG_PAD])."""
    m = tl.max(tl.max(x, 1), 0)
    return tl.min(tl.min(tl.where(x == m, idx, BIG), 1), 0)


@triton.jit
def _route_pad_row(
    ids_row, weights_row, K: tl.constexpr, K_PAD: tl.constexpr, SHARED: tl.constexpr, S_PAD: tl.constexpr
):
    """A pad row: NO_EXPERT (-1) at weight 0 in every column, shared ones included."""
    k_out = tl.arange(0, K_PAD)
    tl.store(ids_row + k_out, tl.full([K_PAD], -1, dtype=tl.int32), mask=k_out < K)
    tl.store(weights_row + k_out, tl.zeros([K_PAD], dtype=tl.float32), mask=k_out < K)
    if SHARED > 0:
        j = tl.arange(0, S_PAD)
        tl.store(ids_row + K + j, tl.full([S_PAD], -1, dtype=tl.int32), mask=j < SHARED)
        tl.store(weights_row + K + j, tl.zeros([S_PAD], dtype=tl.float32), mask=j < SHARED)


@triton.jit
def _route_row(
    logits_row,  # [E] this row's logits
    bias_ptr,
    ids_row,  # [K + SHARED] int32 out
    weights_row,  # [K + SHARED] fp32 out
    scaling,
    renorm_eps,
    E: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr,
    PER_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    PG_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    SHARED: tl.constexpr,
    S_PAD: tl.constexpr,
    CACHE: tl.constexpr,  # the logits' load cache modifier ("" or ".cg": written by other programs of this launch)
):
    if SHARED > 0:  # apart from the top-k's K_PAD vectors, so the weights' sums keep their order and bits
        j = tl.arange(0, S_PAD)
        tl.store(ids_row + K + j, E + j, mask=j < SHARED)
        tl.store(weights_row + K + j, tl.full([S_PAD], 1.0, dtype=tl.float32), mask=j < SHARED)
    g = tl.arange(0, G_PAD)[:, None]
    p = tl.arange(0, PG_PAD)[None, :]
    valid = (g < N_GROUP) & (p < PER_GROUP)  # [G_PAD, PG_PAD]
    expert = g * PER_GROUP + p
    x = tl.load(logits_row + expert, mask=valid, other=0.0, cache_modifier=CACHE).to(tl.float32)
    if SIGMOID:
        scores = tl.where(valid, tl.sigmoid(x), 0.0)
    else:
        x = tl.where(valid, x, NEG_INF)
        e = tl.exp(x - tl.max(tl.max(x, 1), 0))
        scores = e / tl.sum(tl.sum(e, 1), 0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, NEG_INF)
    if N_GROUP > 1:
        # group score: sum of the group's top two choice scores (one when a group holds one expert)
        top1 = tl.max(choice, 1)  # [G_PAD]
        group_score = top1
        if PER_GROUP > 1:
            first = tl.min(tl.where(choice == top1[:, None], p, BIG), 1)  # [G_PAD] position of the top one
            rest = tl.where(p == first[:, None], NEG_INF, choice)
            group_score = top1 + tl.max(rest, 1)
        gidx = tl.arange(0, G_PAD)
        group_score = tl.where(gidx < N_GROUP, group_score, NEG_INF)
        keep = tl.zeros([G_PAD], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best_score = tl.max(group_score, 0)
            best = tl.min(tl.where(group_score == best_score, gidx, BIG), 0)
            hit = gidx == best
            keep = keep | hit
            group_score = tl.where(hit, NEG_INF, group_score)
        choice = tl.where(keep[:, None], choice, NEG_INF)
    flat_idx = g * PG_PAD + p  # [G_PAD, PG_PAD] position in the tile, row-major
    offs_k = tl.arange(0, K_PAD)
    sel_ids = tl.zeros([K_PAD], dtype=tl.int32)
    sel_w = tl.zeros([K_PAD], dtype=tl.float32)
    for k in tl.static_range(K):
        f = _first_max(choice, flat_idx)
        hit = flat_idx == f
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0)
        sel_ids = tl.where(offs_k == k, (f // PG_PAD) * PER_GROUP + f % PG_PAD, sel_ids)
        sel_w = tl.where(offs_k == k, w, sel_w)
        choice = tl.where(hit, NEG_INF, choice)
    if RENORM:
        sel_w = sel_w / (tl.sum(sel_w, 0) + renorm_eps)
    tl.store(ids_row + offs_k, sel_ids, mask=offs_k < K)
    tl.store(weights_row + offs_k, sel_w * scaling, mask=offs_k < K)


@triton.jit
def router_kernel(
    logits_ptr,  # [T, E]
    bias_ptr,  # [E] fp32 (HAS_BIAS)
    ids_ptr,  # [T, K + SHARED] int32 out
    weights_ptr,  # [T, K + SHARED] fp32 out
    live_ptr,  # [1] int64 (HAS_LIVE): rows from it on are pad rows, routed to NO_EXPERT (-1) at weight 0 unscored
    stride_l,
    stride_i,
    stride_w,
    scaling,  # routed_scaling_factor
    renorm_eps,
    E: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr,
    PER_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    PG_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    SHARED: tl.constexpr,  # shared experts as routed ones: columns K.. get ids E.. at weight 1 (fused_moe's shared)
    S_PAD: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    chain_in(PDL)
    t = tl.program_id(0).to(tl.int64)
    if HAS_LIVE:
        if t >= tl.load(live_ptr):
            _route_pad_row(ids_ptr + t * stride_i, weights_ptr + t * stride_w, K, K_PAD, SHARED, S_PAD)
            return
    _route_row(
        logits_ptr + t * stride_l,
        bias_ptr,
        ids_ptr + t * stride_i,
        weights_ptr + t * stride_w,
        scaling,
        renorm_eps,
        E,
        K,
        K_PAD,
        N_GROUP,
        PER_GROUP,
        TOPK_GROUP,
        G_PAD,
        PG_PAD,
        SIGMOID,
        HAS_BIAS,
        RENORM,
        SHARED,
        S_PAD,
        "",
    )


@triton.jit
def gate_router_kernel(
    x_ptr,  # [T, H] the MoE input
    w_ptr,  # [E, H] the gate weight
    logits_ptr,  # [T, E] fp32 scratch
    counter_ptr,  # [>= T] int32 arrival counters, zero between calls
    bias_ptr,  # [E] (HAS_BIAS)
    ids_ptr,  # [T, K + SHARED] int32 out
    weights_ptr,  # [T, K + SHARED] fp32 out
    live_ptr,  # [1] int64 (HAS_LIVE)
    H,
    stride_x,
    stride_wr,
    stride_i,
    stride_w,
    scaling,
    renorm_eps,
    E: tl.constexpr,
    EB: tl.constexpr,  # experts a program scores
    BK: tl.constexpr,
    ROUND_LOGITS: tl.constexpr,  # round each logit to x's dtype first (the softmax rule's bf16 GEMM output)
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr,
    PER_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    PG_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    SHARED: tl.constexpr,
    S_PAD: tl.constexpr,
    sorted_slot_ptr,  # [MAXP] int32 out (ALIGN): fused_moe's slot layout, moe_triton.align_slots
    block_expert_ptr,  # [MAXB] int32 out (ALIGN)
    num_blocks_ptr,  # [1] int32 out (ALIGN)
    scratch_ptr,  # [N_PAD] int32 (ALIGN)
    all_at,  # counter_ptr + all_at: the routed-rows counter (ALIGN)
    align_experts,  # experts the layout sorts by: E + SHARED (ALIGN)
    maxp,  # MAXB * BM (ALIGN)
    ALIGN: tl.constexpr,  # the program that routes the step's last row also aligns its slots (fused_moe's step 1)
    N_PAD: tl.constexpr,
    BM: tl.constexpr,
    FILL: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    chain_in(PDL)
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    nb = tl.num_programs(1)
    if HAS_LIVE:
        if t >= tl.load(live_ptr):
            if b == 0:
                _route_pad_row(ids_ptr + t * stride_i, weights_ptr + t * stride_w, K, K_PAD, SHARED, S_PAD)
                if ALIGN:
                    _row_routed(
                        counter_ptr,
                        all_at,
                        ids_ptr,
                        sorted_slot_ptr,
                        block_expert_ptr,
                        num_blocks_ptr,
                        scratch_ptr,
                        (K + SHARED) * tl.num_programs(0),
                        align_experts,
                        maxp,
                        N_PAD,
                        BM,
                        FILL,
                    )
            return
    offs_e = b * EB + tl.arange(0, EB)
    e_ok = offs_e < E
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([EB], dtype=tl.float32)
    for k0 in range(0, H, BK):
        k_ok = (offs_k + k0) < H
        xk = tl.load(x_ptr + t * stride_x + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + offs_e[:, None].to(tl.int64) * stride_wr + k0 + offs_k[None, :],
            mask=e_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(w * xk[None, :], 1)
    if ROUND_LOGITS:
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + t * E + offs_e, acc, mask=e_ok)
    arrived = tl.atomic_add(counter_ptr + t, 1, sem="acq_rel", scope="gpu")
    if arrived == nb - 1:  # the last of row t's programs: every logit of the row is written
        _route_row(
            logits_ptr + t * E,
            bias_ptr,
            ids_ptr + t * stride_i,
            weights_ptr + t * stride_w,
            scaling,
            renorm_eps,
            E,
            K,
            K_PAD,
            N_GROUP,
            PER_GROUP,
            TOPK_GROUP,
            G_PAD,
            PG_PAD,
            SIGMOID,
            HAS_BIAS,
            RENORM,
            SHARED,
            S_PAD,
            ".cg",
        )
        tl.atomic_xchg(counter_ptr + t, 0, sem="relaxed", scope="gpu")  # ready for the next call
        if ALIGN:
            _row_routed(
                counter_ptr,
                all_at,
                ids_ptr,
                sorted_slot_ptr,
                block_expert_ptr,
                num_blocks_ptr,
                scratch_ptr,
                (K + SHARED) * tl.num_programs(0),
                align_experts,
                maxp,
                N_PAD,
                BM,
                FILL,
            )


@triton.jit
def _row_routed(
    counter_ptr,
    all_at,
    ids_ptr,  # [T * (K + SHARED)] int32: every row's ids, contiguous
    sorted_slot_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    scratch_ptr,
    n_slots,
    align_experts,
    maxp,
    N_PAD: tl.constexpr,
    BM: tl.constexpr,
    FILL: tl.constexpr,
):
    """Count a routed row in (after its ids are stored); the program that counts the step's last row aligns every
    row's slots (their ids read past L1: other programs wrote them) and resets the counter for the next call."""
    if tl.atomic_add(counter_ptr + all_at, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        align_slots(
            ids_ptr,
            sorted_slot_ptr,
            block_expert_ptr,
            num_blocks_ptr,
            scratch_ptr,
            n_slots,
            align_experts,
            maxp,
            N_PAD,
            BM,
            FILL,
            ".cg",
        )
        tl.atomic_xchg(counter_ptr + all_at, 0, sem="relaxed", scope="gpu")
