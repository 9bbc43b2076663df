"""Triton kernel of the MoE router (imported only where triton is installed; see router.py for the wrapper).

One program per token. Its E logits are held as a [G_PAD, PG_PAD] tile, row g = expert group g (expert
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

NEG_INF = tl.constexpr(float("-inf"))
BIG = tl.constexpr(1 << 30)


@triton.jit
def _first_max(x, idx):
    """Smallest idx among the largest elements of x (x, idx [G_PAD, PG_PAD])."""
    m = tl.max(tl.max(x, 1), 0)
    return tl.min(tl.min(tl.where(x == m, idx, BIG), 1), 0)


@triton.jit
def router_kernel(
    logits_ptr,  # [T, E]
    bias_ptr,  # [E] fp32 (HAS_BIAS)
    ids_ptr,  # [T, K] int32 out
    weights_ptr,  # [T, K] fp32 out
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
):
    t = tl.program_id(0).to(tl.int64)
    if HAS_LIVE:
        if t >= tl.load(live_ptr):
            k_out = tl.arange(0, K_PAD)
            tl.store(ids_ptr + t * stride_i + k_out, tl.full([K_PAD], -1, dtype=tl.int32), mask=k_out < K)
            tl.store(weights_ptr + t * stride_w + k_out, tl.zeros([K_PAD], dtype=tl.float32), mask=k_out < K)
            return
    g = tl.arange(0, G_PAD)[:, None]
    p = tl.arange(0, PG_PAD)[None, :]
    valid = (g < N_GROUP) & (p < PER_GROUP)  # [G_PAD, PG_PAD]
    expert = g * PER_GROUP + p
    x = tl.load(logits_ptr + t * stride_l + expert, mask=valid, other=0.0).to(tl.float32)
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
    tl.store(ids_ptr + t * stride_i + offs_k, sel_ids, mask=offs_k < K)
    tl.store(weights_ptr + t * stride_w + offs_k, sel_w * scaling, mask=offs_k < K)
