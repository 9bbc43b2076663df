"""Triton kernel of the skinny GEMM (kernels/skinny_gemm.py; imported only where triton is installed).

One program per BLOCK_N output columns (silu_mul: BLOCK_N gate columns and the matching up columns) over every row
(M <= BLOCK_M, padded by masking) and the whole K, BLOCK_K at a time in order: no split-K, so a row's result is a
function of that row alone and the same whatever M is (the row-count invariance of the target's steps).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def skinny_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] (silu_mul: gate rows [0, N_OUT), up rows [N_OUT, 2 N_OUT))
    bias_ptr,  # [N] or a dummy (HAS_BIAS False)
    add_ptr,  # [M, N_OUT] or a dummy (HAS_ADD False)
    out_ptr,  # [M, N_OUT]
    M,
    K,
    N_OUT,
    stride_xm,
    stride_wn,
    stride_am,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N_OUT
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N] (W^T tile: k down, n across)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up_rows = w_rows + N_OUT.to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if SILU_MUL:
            u = tl.load(up_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(x, u, acc_up, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(bias_ptr + N_OUT + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    ok = m_ok[:, None] & n_ok[None, :]
    if HAS_ADD:
        acc += tl.load(add_ptr + offs_m[:, None] * stride_am + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
