"""RMSNorm kernels: plain, fused residual-add + RMSNorm, and per-head RMSNorm (QK-norm), one launch each.

  rms_norm(x [T, H], weight [H], eps) -> [T, H]
  fused_add_rms_norm(x [T, H], residual [T, H], weight [H], eps) -> (normed [T, H], new_residual [T, H])
      new_residual = x + residual (rounded to the io dtype), normed = rms_norm(new_residual); x may be a MoE's
      slots before their top-k sum (moe_reference.SlotRows), summed in the same launch
  head_rms_norm(x [N, heads, D], weight [D], eps) -> [N, heads, D]  (x may be a strided view, e.g. q inside qkv)
Same numerics as norm_reference.py (fp32 math, bf16/fp16/fp32 io). Every output can be a caller buffer (`out=`,
`residual_out=`); in place is allowed (out=x, residual_out=residual). No host syncs: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from specserve.kernels.checks import check_dim, check_same_device, check_tensor, require, triton_interpreting
from specserve.kernels.launch import chained
from specserve.kernels.moe_reference import SlotRows

try:
    import triton

    from specserve.kernels import norm_triton as _k

    HAS_TRITON = True
except ImportError:  # CPU-only installs (CI) have no triton; norm_reference.py still works.
    HAS_TRITON = False

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_WIDTH = 65536  # one row per tile: wider rows would need a two-pass kernel


def _block(width: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS per program, num_warps) for rows of `width` elements."""
    block = triton.next_power_of_2(width)
    rows = max(1, min(16, 2048 // block))
    warps = 1 if block * rows <= 512 else 4 if block * rows <= 4096 else 8 if block <= 8192 else 16
    return block, rows, warps


def _check_common(x: torch.Tensor, weight: object, width: int, eps: float) -> None:
    check_tensor("weight", weight, 1, _DTYPES)
    check_dim("weight", weight, 0, width, "the normalised width (x's last dim)")
    require(weight.dtype == x.dtype, f"weight has dtype {weight.dtype} but x has {x.dtype}")
    require(1 <= width <= MAX_WIDTH, f"normalised width must be in [1, {MAX_WIDTH}], got {width}")
    require(eps >= 0, f"eps must be >= 0, got {eps}")
    require(HAS_TRITON, "the Triton RMSNorm needs the triton package, which is not installed")
    require(x.is_cuda or triton_interpreting(), f"the Triton RMSNorm needs CUDA tensors, got x on {x.device}")


def _out(name: str, out: torch.Tensor | None, like: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    check_tensor(name, out, like.dim(), (like.dtype,), contiguous=contiguous)
    require(out.shape == like.shape, f"{name} has shape {tuple(out.shape)}, expected {tuple(like.shape)}")
    require(out.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {out.stride()}")
    check_same_device([("x", like), (name, out)])
    return out


def _check_rows(name: str, x: object) -> torch.Tensor:
    t = check_tensor(name, x, 2, _DTYPES, contiguous=False)
    require(t.stride(1) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}")
    return t


def rms_norm(
    x: torch.Tensor,  # [T, H] (rows may be strided; last dim contiguous)
    weight: torch.Tensor,  # [H], x's dtype
    eps: float,
    *,
    out: torch.Tensor | None = None,  # [T, H] (may be x)
) -> torch.Tensor:  # [T, H]
    x = _check_rows("x", x)
    t, h = x.shape
    _check_common(x, weight, h, eps)
    check_same_device([("x", x), ("weight", weight)])
    out = _out("out", out, x, contiguous=False)
    if t == 0:
        return out
    block, rows, warps = _block(h)
    _k.rms_norm_kernel[(triton.cdiv(t, rows),)](
        x,
        weight,
        out,
        t,
        float(eps),
        x.stride(0),
        0,
        out.stride(0),
        0,
        H=h,
        HEADS=1,
        BLOCK=block,
        ROWS=rows,
        num_warps=warps,
        **chained(x),
    )
    return out


def _check_slots(slots: SlotRows, residual: torch.Tensor) -> None:
    """A MoE's slots (SlotRows) in place of x: float32 [T * k, H] rows, [T * k] ids, summing to residual's shape."""
    check_tensor("slot rows", slots.rows, 2, (torch.float32,))
    check_tensor("slot ids", slots.ids, 1, (torch.int32, torch.int64))
    require(slots.k >= 1, f"slots need k >= 1, got {slots.k}")
    require(
        slots.rows.shape[0] == residual.shape[0] * slots.k and slots.rows.shape[1] == residual.shape[1],
        f"slot rows {tuple(slots.rows.shape)} do not sum to residual's {tuple(residual.shape)} at k = {slots.k}",
    )
    check_dim("slot ids", slots.ids, 0, slots.rows.shape[0], "the slot rows")
    require(slots.dtype == residual.dtype, f"the slots sum to {slots.dtype} but residual has {residual.dtype}")
    check_same_device([("slot rows", slots.rows), ("slot ids", slots.ids), ("residual", residual)])


def fused_add_rms_norm(
    x: torch.Tensor | SlotRows,  # [T, H] this sublayer's output, or a MoE's slots before their top-k sum
    residual: torch.Tensor,  # [T, H] residual stream so far
    weight: torch.Tensor,  # [H]
    eps: float,
    *,
    out: torch.Tensor | None = None,  # [T, H] normed (may be x)
    residual_out: torch.Tensor | None = None,  # [T, H] x + residual (may be residual)
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new residual [T, H])
    """x may be a SlotRows (fused_moe(sum_slots=False)): its top-k sum is taken in this launch, the same bits as
    summing it first."""
    residual = _check_rows("residual", residual)
    slots = x if isinstance(x, SlotRows) else None
    if slots is not None:
        _check_slots(slots, residual)
        x, k, ids = slots.rows, slots.k, slots.ids
    else:
        x, k = _check_rows("x", x), 0
        require(residual.shape == x.shape, f"residual has shape {tuple(residual.shape)}, x has {tuple(x.shape)}")
        require(residual.dtype == x.dtype, f"residual has dtype {residual.dtype} but x has {x.dtype}")
        ids = x
    t, h = residual.shape
    _check_common(residual, weight, h, eps)
    check_same_device([("x", x), ("residual", residual), ("weight", weight)])
    out = _out("out", out, residual, contiguous=False)
    residual_out = _out("residual_out", residual_out, residual, contiguous=False)
    require(out.data_ptr() != residual_out.data_ptr() or t == 0, "out and residual_out must be different buffers")
    if t == 0:
        return out, residual_out
    block, rows, warps = _block(h)
    _k.add_rms_norm_kernel[(triton.cdiv(t, rows),)](
        x,
        ids,
        residual,
        weight,
        out,
        residual_out,
        t,
        float(eps),
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        residual_out.stride(0),
        H=h,
        BLOCK=block,
        ROWS=rows,
        TOPK=k,
        num_warps=warps,
        **chained(x),
    )
    return out, residual_out


def head_rms_norm(
    x: torch.Tensor,  # [N, heads, D] (N and heads may be strided; last dim contiguous)
    weight: torch.Tensor,  # [D]
    eps: float,
    *,
    out: torch.Tensor | None = None,  # [N, heads, D] (may be x: normalise q or k in place inside qkv)
) -> torch.Tensor:  # [N, heads, D]
    """RMSNorm over the last dim of every (token, head): Qwen3's q_norm / k_norm."""
    check_tensor("x", x, 3, _DTYPES, contiguous=False)
    require(x.stride(2) == 1, f"x must be contiguous in its last dim, strides {x.stride()}")
    n, heads, d = x.shape
    _check_common(x, weight, d, eps)
    check_same_device([("x", x), ("weight", weight)])
    out = _out("out", out, x, contiguous=False)
    if n * heads == 0:
        return out
    block, rows, warps = _block(d)
    _k.rms_norm_kernel[(triton.cdiv(n * heads, rows),)](
        x,
        weight,
        out,
        n * heads,
        float(eps),
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        H=d,
        HEADS=heads,
        BLOCK=block,
        ROWS=rows,
        num_warps=warps,
        **chained(x),
    )
    return out
