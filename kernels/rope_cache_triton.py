"""Triton kernels of the fused (QK-norm +) RoPE + paged-cache write (imported only where triton is installed; see
rope_cache.py for the wrappers). One program per token, all its heads.

A head is handled as its two rotation halves x1, x2 [heads, HALF] (neox: elements i and HALF + i; interleaved:
2i and 2i + 1); both layouts write o1 to [0, HALF) and o2 to [HALF, D) (transformers' interleaved output layout).
Every product, sum and difference is rounded to the io dtype as the torch ops of the model round them, so the
results match the eager model bit for bit up to the fp32 rsqrt of the norms, provided the launch turns FMA
contraction off (enable_fp_fusion=False, as rope_cache.py does: with it on, a product and the following
difference become one fma.rn.bf16 and lose the product's rounding).
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.kernels.chain_triton import chain_in


@triton.jit
def _r(x, DT: tl.constexpr):
    """Round fp32 x to the io dtype and back (what one torch op in that dtype does)."""
    return x.to(DT).to(tl.float32)


@triton.jit
def _halves(offs_i, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    if INTERLEAVED:
        return 2 * offs_i, 2 * offs_i + 1
    return offs_i, HALF + offs_i


@triton.jit
def _load_halves(ptr, row_off, offs_i, mask, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """x1, x2 [rows, HALF_PAD] fp32 of the heads at ptr + row_off[rows]."""
    i1, i2 = _halves(offs_i, HALF, INTERLEAVED)
    x1 = tl.load(ptr + row_off[:, None] + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + row_off[:, None] + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _norm_halves(x1, x2, w_ptr, offs_i, i_ok, eps, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, DT: tl.constexpr):
    """RMSNorm of each head (row) over both halves: weight * round(x * rstd), rounded."""
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
    i1, i2 = _halves(offs_i, HALF, INTERLEAVED)
    w1 = tl.load(w_ptr + i1, mask=i_ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + i2, mask=i_ok, other=0.0).to(tl.float32)
    y1 = _r(w1[None, :] * _r(x1 * rstd[:, None], DT), DT)
    y2 = _r(w2[None, :] * _r(x2 * rstd[:, None], DT), DT)
    return y1, y2


@triton.jit
def _rope(x1, x2, c, s, DT: tl.constexpr):
    """o1 = x1 * cos - x2 * sin, o2 = x2 * cos + x1 * sin, each op rounded to the io dtype."""
    o1 = _r(_r(x1 * c[None, :], DT) - _r(x2 * s[None, :], DT), DT)
    o2 = _r(_r(x2 * c[None, :], DT) + _r(x1 * s[None, :], DT), DT)
    return o1, o2


@triton.jit
def _store_halves(ptr, row_off, offs_i, o1, o2, mask, HALF: tl.constexpr):
    ty = ptr.dtype.element_ty
    tl.store(ptr + row_off[:, None] + offs_i[None, :], o1.to(ty), mask=mask)
    tl.store(ptr + row_off[:, None] + HALF + offs_i[None, :], o2.to(ty), mask=mask)


@triton.jit
def _cos_sin(pos_ptr, cos_ptr, sin_ptr, t, max_pos, stride_cos, offs_i, i_ok):
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # memory safety only; validate=True reports bad positions
    c = tl.load(cos_ptr + pos * stride_cos + offs_i, mask=i_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + offs_i, mask=i_ok, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def rope_cache_gqa_kernel(
    q_ptr,  # [T, HQ, D]
    k_ptr,  # [T, HKV, D]
    v_ptr,  # [T, HKV, D]
    pos_ptr,  # [T]
    cos_ptr,  # [max_pos, HALF]
    sin_ptr,  # [max_pos, HALF]
    cache_ptr,  # [num_blocks, block_size, 2, HKV, D] contiguous
    slot_ptr,  # [T] int64
    q_out_ptr,  # [T, HQ, D]
    qw_ptr,  # [D] (Q_NORM)
    kw_ptr,  # [D] (K_NORM)
    max_pos,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_cos,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    Q_NORM: tl.constexpr,
    K_NORM: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    chain_in(PDL)
    t = tl.program_id(0).to(tl.int64)
    DT: tl.constexpr = q_ptr.dtype.element_ty
    offs_i = tl.arange(0, HALF_PAD)
    i_ok = offs_i < HALF
    c, s = _cos_sin(pos_ptr, cos_ptr, sin_ptr, t, max_pos, stride_cos, offs_i, i_ok)

    hq = tl.arange(0, HQ_PAD)
    mq = (hq < HQ)[:, None] & i_ok[None, :]
    x1, x2 = _load_halves(q_ptr + t * stride_qt, hq * stride_qh, offs_i, mq, HALF, INTERLEAVED)
    if Q_NORM:
        x1, x2 = _norm_halves(x1, x2, qw_ptr, offs_i, i_ok, eps, HALF, INTERLEAVED, DT)
    o1, o2 = _rope(x1, x2, c, s, DT)
    _store_halves(q_out_ptr + t * stride_ot, hq * stride_oh, offs_i, o1, o2, mq, HALF)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    write = slot >= 0
    entry = cache_ptr + slot * (2 * HKV * 2 * HALF)
    hk = tl.arange(0, HKV_PAD)
    mk = (hk < HKV)[:, None] & i_ok[None, :] & write
    x1, x2 = _load_halves(k_ptr + t * stride_kt, hk * stride_kh, offs_i, mk, HALF, INTERLEAVED)
    if K_NORM:
        x1, x2 = _norm_halves(x1, x2, kw_ptr, offs_i, i_ok, eps, HALF, INTERLEAVED, DT)
    o1, o2 = _rope(x1, x2, c, s, DT)
    _store_halves(entry, hk * (2 * HALF), offs_i, o1, o2, mk, HALF)
    # v: copied whole, in two halves of the head like the rest
    v1 = tl.load(v_ptr + t * stride_vt + hk[:, None] * stride_vh + offs_i[None, :], mask=mk, other=0.0)
    v2 = tl.load(v_ptr + t * stride_vt + hk[:, None] * stride_vh + HALF + offs_i[None, :], mask=mk, other=0.0)
    _store_halves(entry + HKV * 2 * HALF, hk * (2 * HALF), offs_i, v1, v2, mk, HALF)


@triton.jit
def rope_cache_mla_kernel(
    qpe_ptr,  # [T, H, P]
    kpe_ptr,  # [T, P]
    lat_ptr,  # [T, R]
    pos_ptr,  # [T]
    cos_ptr,  # [max_pos, HALF]
    sin_ptr,  # [max_pos, HALF]
    cache_ptr,  # [num_blocks, block_size, R + P] contiguous
    slot_ptr,  # [T] int64
    q_out_ptr,  # [T, H, P]
    lw_ptr,  # [R] (L_NORM)
    max_pos,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_lt,
    stride_ot,
    stride_oh,
    stride_cos,
    H: tl.constexpr,
    R: tl.constexpr,
    HALF: tl.constexpr,
    H_PAD: tl.constexpr,
    R_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    L_NORM: tl.constexpr,
    qn_ptr,  # [T, H, DN] the query's nope part (ABSORB)
    wuk_ptr,  # [H, DN, R] W_UK, last dim contiguous (ABSORB)
    ql_ptr,  # [T, H, R] out: q_nope W_UK, contiguous (ABSORB)
    stride_qnt,
    stride_qnh,
    stride_wh,
    stride_wd,
    DN: tl.constexpr,
    DN_PAD: tl.constexpr,
    RB: tl.constexpr,  # latent columns a W_UK program computes
    ABSORB: tl.constexpr,
    live_ptr,  # [1] int64 (HAS_LIVE): rows from it on are pad rows, their q_latent not computed
    HAS_LIVE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    """Program (t, 0): RoPE of the row's q_pe and k_pe, the latent's norm, the cache write. With ABSORB, programs
    (t, 1 + b) compute columns b*RB.. of the row's q_latent = q_nope W_UK (per head; float32 sums over DN in one
    fixed order, rounded once), so the absorbed MLA's first per-head product needs no launch of its own."""
    chain_in(PDL)
    t = tl.program_id(0).to(tl.int64)
    if ABSORB:
        part = tl.program_id(1)
        if part > 0:
            if HAS_LIVE:
                if t >= tl.load(live_ptr):
                    return
            blocks: tl.constexpr = (R + RB - 1) // RB
            hh = ((part - 1) // blocks).to(tl.int64)
            offs_c = ((part - 1) % blocks) * RB + tl.arange(0, RB)
            offs_d = tl.arange(0, DN_PAD)
            c_ok = offs_c < R
            d_ok = offs_d < DN
            q = tl.load(qn_ptr + t * stride_qnt + hh * stride_qnh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            w = tl.load(
                wuk_ptr + hh * stride_wh + offs_d[:, None] * stride_wd + offs_c[None, :],
                mask=d_ok[:, None] & c_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc = tl.sum(w * q[:, None], 0)  # [RB]
            tl.store(ql_ptr + (t * H + hh) * R + offs_c, acc.to(ql_ptr.dtype.element_ty), mask=c_ok)
            return
    DT: tl.constexpr = qpe_ptr.dtype.element_ty
    offs_i = tl.arange(0, HALF_PAD)
    i_ok = offs_i < HALF
    c, s = _cos_sin(pos_ptr, cos_ptr, sin_ptr, t, max_pos, stride_cos, offs_i, i_ok)

    h = tl.arange(0, H_PAD)
    mq = (h < H)[:, None] & i_ok[None, :]
    x1, x2 = _load_halves(qpe_ptr + t * stride_qt, h * stride_qh, offs_i, mq, HALF, INTERLEAVED)
    o1, o2 = _rope(x1, x2, c, s, DT)
    _store_halves(q_out_ptr + t * stride_ot, h * stride_oh, offs_i, o1, o2, mq, HALF)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    write = slot >= 0
    entry = cache_ptr + slot * (R + 2 * HALF)
    one = tl.zeros([1], dtype=tl.int64)
    mk = i_ok[None, :] & write
    x1, x2 = _load_halves(kpe_ptr + t * stride_kt, one, offs_i, mk, HALF, INTERLEAVED)
    o1, o2 = _rope(x1, x2, c, s, DT)
    _store_halves(entry + R, one, offs_i, o1, o2, mk, HALF)

    offs_r = tl.arange(0, R_PAD)
    r_ok = (offs_r < R) & write
    lat = tl.load(lat_ptr + t * stride_lt + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    if L_NORM:
        rstd = tl.rsqrt(tl.sum(lat * lat, 0) / R + eps)
        w = tl.load(lw_ptr + offs_r, mask=r_ok, other=0.0).to(tl.float32)
        lat = _r(w * _r(lat * rstd, DT), DT)
    tl.store(entry + offs_r, lat.to(cache_ptr.dtype.element_ty), mask=r_ok)
