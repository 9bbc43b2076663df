"""The skinny GEMM: y = x W^T for a few rows (decode and verify steps), with its epilogue, in one launch.

  skinny_linear(x [M, K], w [N, K], bias [N] | None, epilogue="none" | "silu_mul", add [M, N'] | None) -> [M, N']
      (in x's dtype, or float32 with out_dtype=torch.float32)
Same function as skinny_gemm_reference.py (fp32 accumulation, one rounding to the io dtype at the end).

Why: at M <= 32 every projection of a layer is a matrix-vector product bound by reading W once; cuBLAS reads these
shapes at about a third of the bandwidth (BENCHMARKS.md, the fused-layer census) and needs a split-K reduce and
separate launches for SiLU * up and the residual adds. Here programs own BLOCK_N output columns over all rows and a
K range (one range by default; with a split the column block's last program sums them in order) and apply the
epilogue (kernels/skinny_gemm_triton.py): one launch, and a row's bits do not depend on how many rows the step
carries. Measured beside cuBLAS on the H200 it is slower (BENCHMARKS' tenth pass), so the engine uses it only when
asked (EngineConfig.skinny_gemm; the census mode `skinny`). No host syncs: CUDA-graph capturable (the counters are left at zero by every call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.checks import check_dim, check_same_device, check_tensor, require, triton_interpreting
from specserve.kernels.launch import chained

try:
    import triton

    from specserve.kernels import skinny_gemm_triton as _k

    HAS_TRITON = True
except ImportError:  # CPU-only installs (CI) have no triton; skinny_gemm_reference.py still works.
    HAS_TRITON = False

_DTYPES = (torch.bfloat16, torch.float16)
MAX_ROWS = 32  # BLOCK_M: every call up to this many rows runs the same tiles (row-count invariant)


@dataclass(frozen=True)
class SkinnyTile:
    """The kernel's tile and K split; a function of the weight's shape only, never of M (row-count invariance)."""

    block_n: int = 16
    block_k: int = 256
    split_k: int = 1  # K ranges per column block, summed in order by the block's last program
    num_warps: int = 4
    num_stages: int = 4


TARGET_PROGRAMS = 1024  # ~8 a multiprocessor on the H200's 132: enough loads in flight to stream a few MB at once
MAX_SPLIT_K = 16


def default_tile(n_out: int, k: int) -> SkinnyTile:
    """The tile for an [n_out, k] weight (silu_mul: n_out gate columns): no K split. On the H200's Moonlight decode
    (BENCHMARKS' tenth pass) its 161 projections took 1.20 ms unsplit and 1.76 ms split to ~1024 programs a call
    (split_tile: the partials' round trip and the last program's sum in turn cost more than the extra loads in
    flight bought); cuBLAS's projections were faster than either, so the engine keeps cuBLAS by default."""
    return SkinnyTile(block_k=256 if k >= 256 else max(16, triton.next_power_of_2(k)))


def split_tile(n_out: int, k: int) -> SkinnyTile:
    """The K-split tile for an [n_out, k] weight: ~TARGET_PROGRAMS programs a call (measured slower; kept to measure)."""
    block_k = default_tile(n_out, k).block_k
    blocks = -(-n_out // 16)
    split = max(1, min(MAX_SPLIT_K, TARGET_PROGRAMS // blocks, -(-k // block_k)))
    return SkinnyTile(block_k=block_k, split_k=split)


def new_counters(device: torch.device | str, size: int = 8192) -> torch.Tensor:  # [size] int32 zeros
    """The per-column-block arrival counters a model's skinny GEMMs share (each call leaves them at zero again; the
    calls of one stream never overlap). A call with more column blocks than counters runs without a K split."""
    return torch.zeros(size, dtype=torch.int32, device=device)


def can_run(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether skinny_linear takes this call (the fused layers fall back to F.linear otherwise)."""
    return (
        HAS_TRITON
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.dtype in _DTYPES
        and w.dtype == x.dtype
        and (x.is_cuda or triton_interpreting())
        and w.is_contiguous()
        and x.stride(1) == 1
    )


def skinny_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS, contiguous in K
    w: torch.Tensor,  # [N, K] contiguous
    bias: torch.Tensor | None = None,  # [N]
    *,
    epilogue: str = "none",
    add: torch.Tensor | None = None,  # [M, N'] added before the rounding (a residual, the routed experts' sum)
    out: torch.Tensor | None = None,  # [M, N']
    out_dtype: torch.dtype | None = None,  # default x's dtype; float32 for a router's logits
    counters: torch.Tensor | None = None,  # [>= column blocks] int32 zeros (new_counters); None: one per call
    tile: SkinnyTile | None = None,
) -> torch.Tensor:  # [M, N'] out_dtype; N' = N, or N / 2 for silu_mul
    x = check_tensor("x", x, 2, _DTYPES, contiguous=False)
    require(x.stride(1) == 1, f"x must be contiguous in its last dim, strides {x.stride()}")
    m, k = x.shape
    require(1 <= m <= MAX_ROWS, f"skinny_linear takes 1 to {MAX_ROWS} rows, got {m}")
    check_tensor("w", w, 2, (x.dtype,))
    check_dim("w", w, 1, k, "x's last dim K")
    require(epilogue in ("none", "silu_mul"), f"epilogue must be 'none' or 'silu_mul', got {epilogue!r}")
    n = w.shape[0]
    require(epilogue == "none" or n % 2 == 0, f"silu_mul needs an even number of weight rows, got {n}")
    n_out = n // 2 if epilogue == "silu_mul" else n
    named = [("x", x), ("w", w)]
    if bias is not None:
        check_tensor("bias", bias, 1, (x.dtype,))
        check_dim("bias", bias, 0, n, "the weight's rows N")
        named.append(("bias", bias))
    if add is not None:
        check_tensor("add", add, 2, (x.dtype,), contiguous=False)
        require(
            tuple(add.shape) == (m, n_out) and add.stride(1) == 1,
            f"add must be [{m}, {n_out}] contiguous in its last dim, got {tuple(add.shape)} {add.stride()}",
        )
        named.append(("add", add))
    out_dtype = out_dtype or x.dtype
    require(out_dtype in (x.dtype, torch.float32), f"out_dtype must be x's dtype or float32, got {out_dtype}")
    if out is None:
        out = torch.empty(m, n_out, dtype=out_dtype, device=x.device)
    check_tensor("out", out, 2, (out_dtype,), contiguous=False)
    require(
        tuple(out.shape) == (m, n_out) and out.stride(1) == 1,
        f"out must be [{m}, {n_out}] contiguous in its last dim, got {tuple(out.shape)}",
    )
    named.append(("out", out))
    if counters is not None:
        check_tensor("counters", counters, 1, (torch.int32,))
        named.append(("counters", counters))
    check_same_device(named)
    require(HAS_TRITON, "the skinny GEMM needs the triton package, which is not installed")
    require(x.is_cuda or triton_interpreting(), f"the skinny GEMM needs CUDA tensors, got x on {x.device}")
    t = tile or default_tile(n_out, k)
    blocks = triton.cdiv(n_out, t.block_n)
    split = t.split_k
    if split > 1 and counters is None:
        counters = new_counters(x.device, blocks)
    if split > 1 and counters.numel() < blocks:
        split = 1  # too few counters for this many column blocks: no K split
    k_chunk = triton.cdiv(triton.cdiv(k, split), t.block_k) * t.block_k
    split = triton.cdiv(k, k_chunk)  # no empty split
    ws = torch.empty(
        split * (2 if epilogue == "silu_mul" else 1) * m * n_out if split > 1 else 1,
        dtype=torch.float32,
        device=x.device,
    )
    _k.skinny_gemm_kernel[(blocks, split)](
        x,
        w,
        bias if bias is not None else w,
        add if add is not None else out,
        out,
        ws,
        counters if split > 1 else ws,
        m,
        k,
        n_out,
        k_chunk,
        x.stride(0),
        w.stride(0),
        add.stride(0) if add is not None else 0,
        out.stride(0),
        BLOCK_M=MAX_ROWS,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        SPLIT_K=split,
        SILU_MUL=epilogue == "silu_mul",
        HAS_BIAS=bias is not None,
        HAS_ADD=add is not None,
        PRECISION="ieee",
        num_warps=t.num_warps,
        num_stages=t.num_stages,
        **chained(x),
    )
    return out
