"""Triton kernel of the skinny GEMM (kernels/skinny_gemm.py; imported only where triton is installed).

Grid (column blocks, K splits). Program (n, s) computes the [rows, BLOCK_N] tile of its BLOCK_N output columns
(silu_mul: BLOCK_N gate columns and the matching up columns) over K range s, BLOCK_K at a time in order. One split:
it applies the epilogue and stores. Several: it stores its fp32 partial, and the last of the column block's programs
to arrive (a counter per block, reset by that program for the next call) adds the partials in split order, applies
the epilogue and stores. Tiles, splits and the order of every sum are functions of the weight's shape alone, so a
row's result does not depend on the other rows or on how many there are (the target's invariant steps).
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.kernels.chain_triton import chain_in


@triton.jit
def _epilogue_store(
    acc,
    acc_up,
    offs_m,
    offs_n,
    m_ok,
    n_ok,
    bias_ptr,
    add_ptr,
    out_ptr,
    N_OUT,
    stride_am,
    stride_om,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ADD: tl.constexpr,
):
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


@triton.jit
def skinny_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] (silu_mul: gate rows [0, N_OUT), up rows [N_OUT, 2 N_OUT))
    bias_ptr,  # [N] or a dummy (HAS_BIAS False)
    add_ptr,  # [M, N_OUT] or a dummy (HAS_ADD False)
    out_ptr,  # [M, N_OUT]
    ws_ptr,  # [SPLIT_K, 2 if SILU_MUL else 1, M, N_OUT] fp32 partials (SPLIT_K > 1)
    counter_ptr,  # [>= column blocks] int32, zero between calls (SPLIT_K > 1)
    M,
    K,
    N_OUT,
    K_CHUNK,  # K per split, a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    stride_am,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N_OUT
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N] (W^T tile: k down, n across)
    up_rows = w_rows + N_OUT.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = split * K_CHUNK
    k_hi = tl.minimum(k_lo + K_CHUNK, K)
    # the weights do not come from the kernel before: the first K tile is read before waiting for it (with PDL, under
    # that kernel's tail), then the loop goes on from the second, the same sums in the same order
    k = k_lo + offs_k
    k_ok = k < k_hi
    w = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    if SILU_MUL:
        u = tl.load(up_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    chain_in(PDL)
    x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if SILU_MUL:
        acc_up = tl.dot(x, u, acc_up, input_precision=PRECISION)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < k_hi
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if SILU_MUL:
            u = tl.load(up_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(x, u, acc_up, input_precision=PRECISION)
    if SPLIT_K == 1:
        _epilogue_store(
            acc,
            acc_up,
            offs_m,
            offs_n,
            m_ok,
            n_ok,
            bias_ptr,
            add_ptr,
            out_ptr,
            N_OUT,
            stride_am,
            stride_om,
            SILU_MUL,
            HAS_BIAS,
            HAS_ADD,
        )
    else:
        parts: tl.constexpr = 2 if SILU_MUL else 1
        ok = m_ok[:, None] & n_ok[None, :]
        tile = offs_m[:, None] * N_OUT + offs_n[None, :]  # [BLOCK_M, BLOCK_N] offsets in one [M, N_OUT] partial
        plane = M * N_OUT
        tl.store(ws_ptr + (split * parts) * plane + tile, acc, mask=ok)
        if SILU_MUL:
            tl.store(ws_ptr + (split * parts + 1) * plane + tile, acc_up, mask=ok)
        tl.debug_barrier()  # every thread's partial is stored before this program says it is done
        arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last of the block's programs: sum the partials in split order
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(ws_ptr + (s * parts) * plane + tile, mask=ok, other=0.0, cache_modifier=".cg")
                if SILU_MUL:
                    acc_up += tl.load(ws_ptr + (s * parts + 1) * plane + tile, mask=ok, other=0.0, cache_modifier=".cg")
            _epilogue_store(
                acc,
                acc_up,
                offs_m,
                offs_n,
                m_ok,
                n_ok,
                bias_ptr,
                add_ptr,
                out_ptr,
                N_OUT,
                stride_am,
                stride_om,
                SILU_MUL,
                HAS_BIAS,
                HAS_ADD,
            )
            tl.atomic_xchg(counter_ptr + pid, 0, sem="relaxed", scope="gpu")  # ready for the next call
