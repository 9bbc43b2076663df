"""Triton kernels for quantized weights (imported only where triton is installed; wrappers in quant_moe.py).

Weights stay packed in memory and are dequantized in registers, one [BN, BK] tile at a time, then fed to
tl.dot in the activations' dtype (bf16 / f16) with fp32 accumulation. Formats: kernels/quant_reference.py.
The MoE kernels use moe_triton's row space: the T*K (token, k) slots sorted by expert, each expert's run
padded to BM rows (`sorted_slot`, `block_expert`, `num_blocks`), so one M-block reads one expert's weights.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _int4_tile(wp_ptr, ws_ptr, offs_n, nvalid, cols, K, stride_pn, stride_sn, G: tl.constexpr):
    """[BN, BK] fp32 weight rows offs_n, columns cols: nibble cols % 8 of word cols // 8, times its group scale."""
    m = nvalid[:, None] & (cols < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    words = tl.load(wp_ptr + rows * stride_pn + (cols // 8)[None, :], mask=m, other=0)
    q = ((words >> ((cols % 8) * 4)[None, :]) & 0xF) - 8
    s = tl.load(ws_ptr + rows * stride_sn + (cols // G)[None, :], mask=m, other=0.0)
    return q.to(tl.float32) * s.to(tl.float32)


@triton.jit
def _fp8_tile(w_ptr, s_ptr, offs_n, nvalid, cols, K, stride_wn, stride_sn, BO: tl.constexpr, BI: tl.constexpr):
    """[BN, BK] fp32 weight rows offs_n, columns cols: e4m3 value times its [BO, BI] block's scale_inv."""
    m = nvalid[:, None] & (cols < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    w = tl.load(w_ptr + rows * stride_wn + cols[None, :], mask=m, other=0.0)
    s = tl.load(s_ptr + (offs_n // BO).to(tl.int64)[:, None] * stride_sn + (cols // BI)[None, :], mask=m, other=0.0)
    return w.to(tl.float32) * s.to(tl.float32)


@triton.jit
def _tile(w_ptr, s_ptr, offs_n, nvalid, cols, K, stride_wn, stride_sn,
          INT4: tl.constexpr, G: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr):
    if INT4:
        w = _int4_tile(w_ptr, s_ptr, offs_n, nvalid, cols, K, stride_wn, stride_sn, G)
    else:
        w = _fp8_tile(w_ptr, s_ptr, offs_n, nvalid, cols, K, stride_wn, stride_sn, BO, BI)
    return w


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
):
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
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        cols = k0 + offs_k
        x = tl.load(x_ptr + tok[:, None] * stride_xt + cols[None, :], mask=rvalid[:, None] & (cols < H)[None, :], other=0.0)
        wg = _tile(w_e, s_e, offs_n, nvalid, cols, H, stride_wn, stride_sn, INT4, G, BO, BI)
        wu = _tile(w_e, s_e, offs_n + I, nvalid, cols, H, stride_wn, stride_sn, INT4, G, BO, BI)
        acc_g = tl.dot(x, tl.trans(wg.to(x.dtype)), acc_g)
        acc_u = tl.dot(x, tl.trans(wu.to(x.dtype)), acc_u)
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
):
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
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        cols = k0 + offs_k
        a = tl.load(act_ptr + rows[:, None].to(tl.int64) * stride_am + cols[None, :], mask=(cols < I)[None, :], other=0.0)
        w = _tile(w_e, s_e, offs_n, nvalid, cols, I, stride_wn, stride_sn, INT4, G, BO, BI)
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    tw = tl.load(tw_ptr + slot, mask=rvalid, other=0.0).to(tl.float32)
    acc = acc * tw[:, None]
    o_ptrs = out_ptr + slot[:, None].to(tl.int64) * stride_on + offs_n[None, :]
    tl.store(o_ptrs, acc, mask=rvalid[:, None] & nvalid[None, :])


@triton.jit
def fp8_linear_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [N, K] e4m3
    s_ptr,  # [ceil(N / BO), ceil(K / BI)]
    y_ptr,  # [T, N] out
    T,
    N,
    K,
    stride_xt,
    stride_wn,
    stride_sn,
    stride_yt,
    BO: tl.constexpr,
    BI: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """y = x W^T, W dequantized tile by tile (decode T = 1..16: one M-block, W read once)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mvalid = offs_m < T
    offs_n = pid_n * BN + tl.arange(0, BN)
    nvalid = offs_n < N
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + offs_k
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt + cols[None, :],
                    mask=mvalid[:, None] & (cols < K)[None, :], other=0.0)
        w = _fp8_tile(w_ptr, s_ptr, offs_n, nvalid, cols, K, stride_wn, stride_sn, BO, BI)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mvalid[:, None] & nvalid[None, :])
