"""Triton kernels of the RMSNorms (imported only where triton is installed; see norm.py for the wrappers).

Row r of a program's [ROWS, BLOCK] tile lives at (r // HEADS) * stride_a + (r % HEADS) * stride_b, so one kernel
serves [T, H] hidden states (HEADS = 1) and strided [N, heads, D] views (QK-norm on a slice of the qkv output).
fp32 math; the normalised value is rounded to the io dtype before the weight multiply, like the torch layer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.kernels.chain_triton import chain_in


@triton.jit
def _normed(h, w, eps, H: tl.constexpr, io_dtype: tl.constexpr):
    """h [ROWS, BLOCK] fp32 (zeros past H), w [BLOCK] fp32 -> weight * round(h * rstd), fp32."""
    rstd = tl.rsqrt(tl.sum(h * h, 1) / H + eps)
    normed = (h * rstd[:, None]).to(io_dtype).to(tl.float32)
    return w[None, :] * normed


@triton.jit
def rms_norm_kernel(
    x_ptr,
    w_ptr,  # [H]
    out_ptr,
    num_rows,
    eps,
    stride_xa,
    stride_xb,
    stride_oa,
    stride_ob,
    H: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    chain_in(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = r < num_rows
    mask = row_ok[:, None] & (cols < H)[None, :]
    r64 = r.to(tl.int64)
    x_off = (r64 // HEADS) * stride_xa + (r64 % HEADS) * stride_xb
    o_off = (r64 // HEADS) * stride_oa + (r64 % HEADS) * stride_ob
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    y = _normed(x.to(tl.float32), w, eps, H, x.dtype)
    tl.store(out_ptr + o_off[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_rms_norm_kernel(
    x_ptr,  # [T, H], or [T * TOPK, H] fp32 slot rows (TOPK > 0)
    ids_ptr,  # [T * TOPK] the slots' expert ids (TOPK > 0): a slot of NO_EXPERT (< 0) adds 0, its row unread
    res_ptr,  # [T, H]
    w_ptr,  # [H]
    out_ptr,  # [T, H] normed (may be x)
    res_out_ptr,  # [T, H] x + residual (may be residual)
    num_rows,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    TOPK: tl.constexpr,  # > 0: x is a MoE's slots, summed here in order (moe_triton.sum_topk_kernel's sum)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    chain_in(PDL)
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    row_ok = r < num_rows
    mask = row_ok[:, None] & (cols < H)[None, :]
    res = tl.load(res_ptr + r[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    if TOPK > 0:
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            slot = r * TOPK + j  # [ROWS]
            live = tl.load(ids_ptr + slot, mask=row_ok, other=-1) >= 0
            acc += tl.load(x_ptr + slot[:, None] * stride_x + cols[None, :], mask=mask & live[:, None], other=0.0)
        x = acc.to(res.dtype)
    else:
        x = tl.load(x_ptr + r[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    s = (x.to(tl.float32) + res.to(tl.float32)).to(res.dtype)  # the residual stream stays in the io dtype
    tl.store(res_out_ptr + r[:, None] * stride_ro + cols[None, :], s, mask=mask)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    y = _normed(s.to(tl.float32), w, eps, H, res.dtype)
    tl.store(out_ptr + r[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
