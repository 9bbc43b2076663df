"""Triton kernels for quantized weights (imported only where triton is installed; wrappers in quant_moe.py).

Weights stay packed in memory, are read once with coalesced loads and dequantized in registers, then fed to
tl.dot in the activations' dtype (bf16 / f16) with fp32 accumulation. Formats: kernels/quant_reference.py.

- INT4: a tile is BKW = BK / 8 packed words per weight row. Nibble j of word w is input column 8w + j, so the
  tile's dot is split into 8 dots, one per nibble position j, each against the activation columns
  k0 + 8w + j (a strided load of the small, cache-resident activations). No unpacking shuffle, and the group
  scale of column 8w + j depends on w only (group sizes are multiples of 8).
- FP8: when a K-tile lies inside one scale block (BK divides BI), the e4m3 tile is converted exactly to the
  activations' dtype, multiplied by the activations, and the [BN] row scales are applied to that partial dot;
  otherwise each weight is scaled before the dot (any block shape, slower).

The MoE kernels use moe_triton's row space: the T*K (token, k) slots sorted by expert, each expert's run
padded to BM rows (`sorted_slot`, `block_expert`, `num_blocks`), so one M-block reads one expert's weights.
The W4A16 per-slot GEMV (few tokens, no tensor cores) has its own module: quant_gemv_triton.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.kernels.chain_triton import chain_in


@triton.jit
def _int4_load(wp_ptr, ws_ptr, offs_n, nvalid, wcols, K, stride_pn, stride_sn, G: tl.constexpr):
    """Packed words [BN, BKW] int32 of rows offs_n at word columns wcols, and their scales [BN, BKW] fp32."""
    m = nvalid[:, None] & (wcols * 8 < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    words = tl.load(wp_ptr + rows * stride_pn + wcols[None, :], mask=m, other=0)
    s = tl.load(ws_ptr + rows * stride_sn + (wcols * 8 // G)[None, :], mask=m, other=0.0)
    return words, s.to(tl.float32)


@triton.jit
def _int4_nibble(words, s, j: tl.constexpr, dtype: tl.constexpr):
    """[BN, BKW] weights of input columns 8w + j: (nibble j - 8) * scale, in `dtype`."""
    q = ((words >> (4 * j)) & 0xF) - 8
    return (q.to(tl.float32) * s).to(dtype)


@triton.jit
def _fp8_scaled_tile(w_ptr, s_ptr, offs_n, nvalid, cols, K, stride_wn, stride_sn, BO: tl.constexpr, BI: tl.constexpr):
    """[BN, BK] fp32 weight rows offs_n, columns cols: e4m3 value times its [BO, BI] block's scale_inv."""
    m = nvalid[:, None] & (cols < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    w = tl.load(w_ptr + rows * stride_wn + cols[None, :], mask=m, other=0.0)
    s = tl.load(s_ptr + (offs_n // BO).to(tl.int64)[:, None] * stride_sn + (cols // BI)[None, :], mask=m, other=0.0)
    return w.to(tl.float32) * s.to(tl.float32)


@triton.jit
def _fp8_dot(
    acc,
    x,
    w_ptr,
    s_ptr,
    offs_n,
    nvalid,
    k0,
    cols,
    K,
    stride_wn,
    stride_sn,
    BO: tl.constexpr,
    BI: tl.constexpr,
    BK: tl.constexpr,
):
    """acc [BM, BN] += x [BM, BK] @ W[offs_n, cols]^T for an FP8 block-scaled W."""
    if BI % BK == 0:  # the tile lies in one scale block column: scale the partial dot per output row
        m = nvalid[:, None] & (cols < K)[None, :]
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + cols[None, :], mask=m, other=0.0)
        s = tl.load(s_ptr + (offs_n // BO).to(tl.int64) * stride_sn + k0 // BI, mask=nvalid, other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype))) * s.to(tl.float32)[None, :]
    else:
        w = _fp8_scaled_tile(w_ptr, s_ptr, offs_n, nvalid, cols, K, stride_wn, stride_sn, BO, BI)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    return acc


@triton.jit
def quant_moe_gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H / 8] int32 (INT4) or [E, 2I, H] e4m3
    s_ptr,  # [E, 2I, H / G] (INT4) or [E, ceil(2I / BO), ceil(H / BI)]
    act_ptr,  # [MAXP, I] out: silu(gate) * up per padded row
    sorted_slot_ptr,  # [MAXP] int32
    block_expert_ptr,  # [MAXB] int32
    num_blocks_ptr,  # [1] int32
    N,
    TOPK,
    H,
    I,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_am,
    INT4: tl.constexpr,
    G: tl.constexpr,
    BO: tl.constexpr,
    BI: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
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
    x_rows = x_ptr + (slot // TOPK).to(tl.int64)[:, None] * stride_xt  # [BM, 1]
    offs_n = pid_n * BN + tl.arange(0, BN)
    nvalid = offs_n < I
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        if INT4:
            offs_w = tl.arange(0, BK // 8)
            wcols = k0 // 8 + offs_w
            words_g, s_g = _int4_load(w_e, s_e, offs_n, nvalid, wcols, H, stride_wn, stride_sn, G)
            words_u, s_u = _int4_load(w_e, s_e, offs_n + I, nvalid, wcols, H, stride_wn, stride_sn, G)
            for j in tl.static_range(8):
                cols = k0 + offs_w * 8 + j
                x = tl.load(x_rows + cols[None, :], mask=rvalid[:, None] & (cols < H)[None, :], other=0.0)
                acc_g = tl.dot(x, tl.trans(_int4_nibble(words_g, s_g, j, x.dtype)), acc_g)
                acc_u = tl.dot(x, tl.trans(_int4_nibble(words_u, s_u, j, x.dtype)), acc_u)
        else:
            cols = k0 + tl.arange(0, BK)
            x = tl.load(x_rows + cols[None, :], mask=rvalid[:, None] & (cols < H)[None, :], other=0.0)
            acc_g = _fp8_dot(acc_g, x, w_e, s_e, offs_n, nvalid, k0, cols, H, stride_wn, stride_sn, BO, BI, BK)
            acc_u = _fp8_dot(acc_u, x, w_e, s_e, offs_n + I, nvalid, k0, cols, H, stride_wn, stride_sn, BO, BI, BK)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_am + offs_n[None, :]
    tl.store(a_ptrs, act.to(act_ptr.dtype.element_ty), mask=nvalid[None, :])


@triton.jit
def quant_moe_down_kernel(
    act_ptr,  # [MAXP, I]
    w_ptr,  # [E, H, I / 8] int32 (INT4) or [E, H, I] e4m3
    s_ptr,  # [E, H, I / G] (INT4) or [E, ceil(H / BO), ceil(I / BI)]
    tw_ptr,  # [N] routing weight of each flat slot
    out_ptr,  # [N, H] fp32 out: weighted expert output per flat slot
    sorted_slot_ptr,  # [MAXP] int32
    block_expert_ptr,  # [MAXB] int32
    num_blocks_ptr,  # [1] int32
    N,
    H,
    I,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_on,
    INT4: tl.constexpr,
    G: tl.constexpr,
    BO: tl.constexpr,
    BI: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
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
    a_rows = act_ptr + rows.to(tl.int64)[:, None] * stride_am  # [BM, 1]
    offs_n = pid_n * BN + tl.arange(0, BN)
    nvalid = offs_n < H
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        if INT4:
            offs_w = tl.arange(0, BK // 8)
            words, s = _int4_load(w_e, s_e, offs_n, nvalid, k0 // 8 + offs_w, I, stride_wn, stride_sn, G)
            for j in tl.static_range(8):
                cols = k0 + offs_w * 8 + j
                a = tl.load(a_rows + cols[None, :], mask=(cols < I)[None, :], other=0.0)
                acc = tl.dot(a, tl.trans(_int4_nibble(words, s, j, a.dtype)), acc)
        else:
            cols = k0 + tl.arange(0, BK)
            a = tl.load(a_rows + cols[None, :], mask=(cols < I)[None, :], other=0.0)
            acc = _fp8_dot(acc, a, w_e, s_e, offs_n, nvalid, k0, cols, I, stride_wn, stride_sn, BO, BI, BK)
    tw = tl.load(tw_ptr + slot, mask=rvalid, other=0.0).to(tl.float32)
    acc = acc * tw[:, None]
    o_ptrs = out_ptr + slot[:, None].to(tl.int64) * stride_on + offs_n[None, :]
    tl.store(o_ptrs, acc, mask=rvalid[:, None] & nvalid[None, :])


@triton.jit
def fp8_linear_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [N, K] e4m3
    s_ptr,  # [ceil(N / BO), ceil(K / BI)]
    y_ptr,  # [T, N] out, or [T, SPLIT, N] fp32 partial sums when SPLIT > 1
    T,
    N,
    K,
    k_chunk,  # input columns per split (a multiple of BK)
    stride_xt,
    stride_wn,
    stride_sn,
    stride_yt,
    BO: tl.constexpr,
    BI: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    """y = x W^T, W dequantized tile by tile. Decode sizes split K over SPLIT programs (moe_triton's
    sum_topk_kernel then adds the partials in a fixed order), so a small N still fills the GPU."""
    chain_in(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mvalid = offs_m < T
    offs_n = pid_n * BN + tl.arange(0, BN)
    nvalid = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_start = pid_k * k_chunk
    for k0 in range(k_start, tl.minimum(k_start + k_chunk, K), BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_rows + cols[None, :], mask=mvalid[:, None] & (cols < K)[None, :], other=0.0)
        acc = _fp8_dot(acc, x, w_ptr, s_ptr, offs_n, nvalid, k0, cols, K, stride_wn, stride_sn, BO, BI, BK)
    if SPLIT == 1:
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mvalid[:, None] & nvalid[None, :])
    else:
        y_ptrs = y_ptr + (offs_m.to(tl.int64)[:, None] * SPLIT + pid_k) * N + offs_n[None, :]
        tl.store(y_ptrs, acc, mask=mvalid[:, None] & nvalid[None, :])
