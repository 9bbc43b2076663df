"""Triton kernel of the MoE router (imported only where triton is installed; see router.py for the wrapper).

One program per token. Its E logits are held as a [G_PAD, PG_PAD] tile, row g = expert group g (expert
g * PER_GROUP + p), so group scores are row reductions. Selection is K rounds of "take the largest remaining
choice score" (ties: the lowest expert id), which yields the ids in descending order of the choice score.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _flat_argmax(x, G_PAD: tl.constexpr, PG_PAD: tl.constexpr):
    """Flat index (g * PG_PAD + p) of the largest element of x [G_PAD, PG_PAD], the first one on ties."""
    flat = tl.reshape(x, [G_PAD * PG_PAD])
    return tl.argmax(flat, 0, tie_break_left=True)


@triton.jit
def router_kernel(
    logits_ptr,  # [T, E]
    bias_ptr,  # [E] fp32 (HAS_BIAS)
    ids_ptr,  # [T, K] int32 out
    weights_ptr,  # [T, K] fp32 out
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
):
    t = tl.program_id(0).to(tl.int64)
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
        first = tl.argmax(choice, 1, tie_break_left=True)
        group_score = top1
        if PER_GROUP > 1:
            rest = tl.where(p == first[:, None], NEG_INF, choice)
            group_score = top1 + tl.max(rest, 1)
        group_score = tl.where(tl.arange(0, G_PAD) < N_GROUP, group_score, NEG_INF)
        keep = tl.zeros([G_PAD], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(group_score, 0, tie_break_left=True)
            hit = tl.arange(0, G_PAD) == best
            keep = keep | hit
            group_score = tl.where(hit, NEG_INF, group_score)
        choice = tl.where(keep[:, None], choice, NEG_INF)
    flat_idx = g * PG_PAD + p  # [G_PAD, PG_PAD] position in the flattened tile
    offs_k = tl.arange(0, K_PAD)
    sel_ids = tl.zeros([K_PAD], dtype=tl.int32)
    sel_w = tl.zeros([K_PAD], dtype=tl.float32)
    for k in tl.static_range(K):
        f = _flat_argmax(choice, G_PAD, PG_PAD)
        hit = flat_idx == f
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0)
        sel_ids = tl.where(offs_k == k, (f // PG_PAD) * PER_GROUP + f % PG_PAD, sel_ids)
        sel_w = tl.where(offs_k == k, w, sel_w)
        choice = tl.where(hit, NEG_INF, choice)
    if RENORM:
        sel_w = sel_w / (tl.sum(sel_w, 0) + renorm_eps)
    tl.store(ids_ptr + t * stride_i + offs_k, sel_ids, mask=offs_k < K)
    tl.store(weights_ptr + t * stride_w + offs_k, sel_w * scaling, mask=offs_k < K)
