"""Triton kernels of the fused MoE (imported only where triton is installed; see fused_moe.py for the wrapper).

Row space: the T*K (token, k) slots are sorted by expert and each expert's run is padded to a multiple of BM
rows, so one M-block holds rows of a single expert. `sorted_slot[r]` is the flat slot t*K+k of padded row r, or
N = T*K for a padding row; `block_expert[b]` is the expert of M-block b; `num_blocks[0]` how many blocks are used.

Shared experts (HAS_SHARED) are always-routed experts of the same launches: a shared MLP of intermediate S * I is
S chunks of the routed experts' I, chunk j being expert E + j (kernels/moe_reference.SharedExperts). A block of
such an expert reads its rows of the shared weights in place, so nothing is copied into the routed stack.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.kernels.chain_triton import chain_in


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def moe_align_kernel(
    ids_ptr,  # [N] expert id of each flat slot
    sorted_slot_ptr,  # [MAXP] int32 out
    block_expert_ptr,  # [MAXB] int32 out
    num_blocks_ptr,  # [1] int32 out
    scratch_ptr,  # [N_PAD] int32 scratch
    N,
    E,
    MAXP,
    N_PAD: tl.constexpr,
    BM: tl.constexpr,
    FILL: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    """One program: align_slots."""
    chain_in(PDL)
    align_slots(
        ids_ptr, sorted_slot_ptr, block_expert_ptr, num_blocks_ptr, scratch_ptr, N, E, MAXP, N_PAD, BM, FILL, ""
    )


@triton.jit
def align_slots(
    ids_ptr,
    sorted_slot_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    scratch_ptr,
    N,
    E,
    MAXP,
    N_PAD: tl.constexpr,
    BM: tl.constexpr,
    FILL: tl.constexpr,
    CACHE: tl.constexpr,  # the ids' load cache modifier ("" or ".cg": written by other programs of the launch)
):
    """Sort slots by (expert, slot), cut each expert's run into BM-row blocks, scatter (one program: moe_align_kernel,
    or the router's last program, router_triton.gate_router_kernel ALIGN). A slot of NO_EXPERT (< 0) sorts with the
    padding, after every expert, and gets no row."""
    offs = tl.arange(0, N_PAD)
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=E, cache_modifier=CACHE).to(tl.int32)  # padding sorts last
    ids = tl.where(ids < 0, E, ids)
    key = tl.sort(ids * N_PAD + offs)
    sid = key // N_PAD  # [N_PAD] expert of sorted position p
    slot = key % N_PAD  # [N_PAD] flat slot at sorted position p
    valid = sid < E  # a routed slot (the routed ones come first)
    tl.store(scratch_ptr + offs, sid)
    tl.debug_barrier()
    prev = tl.load(scratch_ptr + offs - 1, mask=offs > 0, other=-1)
    seg_start = tl.associative_scan(tl.where(sid != prev, offs, 0), 0, _max_combine)
    pos = offs - seg_start  # rank of p inside its expert's run
    new_block = ((pos % BM) == 0) & valid
    blk = tl.cumsum(new_block.to(tl.int32), 0) - 1
    dest = blk * BM + pos % BM
    for start in range(0, MAXP, FILL):
        f = start + tl.arange(0, FILL)
        tl.store(sorted_slot_ptr + f, tl.zeros([FILL], dtype=tl.int32) + N, mask=f < MAXP)
    tl.debug_barrier()
    tl.store(sorted_slot_ptr + dest, slot, mask=valid)
    tl.store(block_expert_ptr + blk, sid, mask=new_block)
    tl.store(num_blocks_ptr, tl.sum(new_block.to(tl.int32), 0))


@triton.jit
def moe_gate_up_kernel(
    x_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H]
    act_ptr,  # [MAXP, I] out: silu(gate) * up per padded row
    sorted_slot_ptr,  # [MAXP] int32
    block_expert_ptr,  # [MAXB] int32
    num_blocks_ptr,  # [1] int32
    ws13_ptr,  # [2 * S * I, H] (HAS_SHARED): the shared experts' gate rows then up rows, expert E + j = chunk j
    N,
    TOPK,
    H,
    I,
    E,  # routed experts: block experts >= E are shared chunks (HAS_SHARED)
    S_ROWS,  # S * I: where the shared up rows start
    stride_xt,
    stride_we,
    stride_wn,
    stride_sn,
    stride_am,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    chain_in(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    slot = tl.load(sorted_slot_ptr + rows)
    rvalid = slot < N
    tok = (slot // TOPK).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nvalid = offs_n < I
    offs_k = tl.arange(0, BK)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    wg_ptrs = w13_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    wu_ptrs = wg_ptrs + I * stride_wn
    if HAS_SHARED:
        if e >= E:  # shared chunk j: gate rows j*I.., up rows S*I + j*I.. of the shared gate_up weight
            wg_ptrs = ws13_ptr + ((e - E) * I + offs_n[:, None].to(tl.int64)) * stride_sn + offs_k[None, :]
            wu_ptrs = wg_ptrs + S_ROWS * stride_sn
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        kvalid = (offs_k + k0) < H
        x = tl.load(x_ptrs, mask=rvalid[:, None] & kvalid[None, :], other=0.0)
        wg = tl.load(wg_ptrs, mask=nvalid[:, None] & kvalid[None, :], other=0.0)
        wu = tl.load(wu_ptrs, mask=nvalid[:, None] & kvalid[None, :], other=0.0)
        acc_g = tl.dot(x, tl.trans(wg), acc_g)
        acc_u = tl.dot(x, tl.trans(wu), acc_u)
        x_ptrs += BK
        wg_ptrs += BK
        wu_ptrs += BK
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_am + offs_n[None, :]
    tl.store(a_ptrs, act.to(act_ptr.dtype.element_ty), mask=nvalid[None, :])


@triton.jit
def moe_down_kernel(
    act_ptr,  # [MAXP, I]
    w2_ptr,  # [E, H, I]
    tw_ptr,  # [N] routing weight of each flat slot
    out_ptr,  # [N, H] fp32 out: weighted expert output per flat slot
    sorted_slot_ptr,  # [MAXP] int32
    block_expert_ptr,  # [MAXB] int32
    num_blocks_ptr,  # [1] int32
    ws2_ptr,  # [H, S * I] (HAS_SHARED): the shared experts' down weight, expert E + j = columns j*I..
    N,
    H,
    I,
    E,  # routed experts: block experts >= E are shared chunks (HAS_SHARED)
    stride_am,
    stride_we,
    stride_wn,
    stride_sn,
    stride_on,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    chain_in(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    slot = tl.load(sorted_slot_ptr + rows)
    rvalid = slot < N
    offs_n = pid_n * BN + tl.arange(0, BN)
    nvalid = offs_n < H
    offs_k = tl.arange(0, BK)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w2_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    if HAS_SHARED:
        if e >= E:  # shared chunk j: columns j*I.. of the shared down weight
            w_ptrs = ws2_ptr + (e - E) * I + offs_n[:, None].to(tl.int64) * stride_sn + offs_k[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        kvalid = (offs_k + k0) < I
        a = tl.load(a_ptrs, mask=kvalid[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=nvalid[:, None] & kvalid[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BK
        w_ptrs += BK
    tw = tl.load(tw_ptr + slot, mask=rvalid, other=0.0).to(tl.float32)
    acc = acc * tw[:, None]
    o_ptrs = out_ptr + slot[:, None].to(tl.int64) * stride_on + offs_n[None, :]
    tl.store(o_ptrs, acc, mask=rvalid[:, None] & nvalid[None, :])


@triton.jit
def sum_topk_kernel(
    src_ptr,  # [T, K, H] fp32
    ids_ptr,  # [T, K / PARTS] expert ids (read when SKIP): a slot of NO_EXPERT (< 0) adds 0, its src rows unread
    out_ptr,  # [T, H]
    H,
    TOPK: tl.constexpr,
    BH: tl.constexpr,
    SKIP: tl.constexpr,
    PARTS: tl.constexpr,  # src rows a slot (the split W4A16 GEMV's input chunks; else 1)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    """out[t] = sum_k src[t, k] in fp32, cast to out's dtype (fixed order: deterministic)."""
    chain_in(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    m = offs < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        mk = m
        if SKIP:
            mk = m & (tl.load(ids_ptr + (t * TOPK + k) // PARTS) >= 0)
        acc += tl.load(src_ptr + (t * TOPK + k) * H + offs, mask=mk, other=0.0)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=m)
