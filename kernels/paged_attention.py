"""Paged decode + verify attention in Triton for any head sizes (GQA and absorbed MLA), with an optional tree mask.

FlashInfer covers GQA head dims 64/128/256 and MLA 512/64 only; these kernels take any sizes (the demo's MLA
latent 64 + rope 16, the mini presets' GQA head_dim 16/32/...). Metadata is PagedRows (paged_rows.py): static
device tensors, so a call is CUDA-graph capturable: no host syncs, grids sized by N, heads and num_splits only.

  paged_gqa_attention(q [N, Hq, D], kv_cache [num_blocks, block_size, 2, Hkv, D], rows) -> out [N, Hq, D]
  paged_mla_attention(q_nope [N, H, R], q_pe [N, H, P], cache [num_blocks, block_size, R + P], rows, sm_scale)
      -> out [N, H, R] = softmax(sm_scale * (q_nope . latent + q_pe . k_pe)) @ latent
Same functions as gqa_rows_reference / mla_rows_reference (paged_attention_reference.py). Padding rows write 0.

num_splits > 1 splits each row's kv range into that many contiguous chunks (more programs for long contexts at
small N), then merges them in a second launch; `workspace` ([N * H * num_splits * (Dv + 2)] fp32) can be passed
so nothing is allocated per call.
"""

from __future__ import annotations

import math

import torch

from specserve.kernels.checks import check_dim, check_same_device, check_tensor, require, triton_interpreting
from specserve.kernels.launch import chained
from specserve.kernels.paged_rows import PagedRows, check_rows_match

try:
    import triton

    from specserve.kernels import paged_attention_triton as _k

    HAS_TRITON = True
except ImportError:  # CPU-only installs (CI) have no triton; the references still work.
    HAS_TRITON = False

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2E = 1.4426950408889634
MAX_SPLITS = 64


def _pow2(n: int, floor: int = 16) -> int:
    """Smallest power of two >= max(n, floor) (tl.dot needs every dim >= 16)."""
    return max(floor, 1 << (max(1, n) - 1).bit_length())


def _check_query(name: str, q: object, heads: int | None, dim: int | None, dtype: torch.dtype | None) -> torch.Tensor:
    t = check_tensor(name, q, 3, _DTYPES, contiguous=False)
    require(t.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}")
    if heads is not None:
        check_dim(name, t, 1, heads, "the number of query heads")
    if dim is not None:
        check_dim(name, t, 2, dim, "the head dim")
    if dtype is not None:
        require(t.dtype == dtype, f"{name} has dtype {t.dtype}, expected {dtype} like the cache")
    return t


def _out_buffer(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_tensor("out", out, len(shape), (like.dtype,))
    require(tuple(out.shape) == shape, f"out has shape {tuple(out.shape)}, expected {shape}")
    require(out.device == like.device, f"out is on {out.device} but q is on {like.device}")
    return out


def _workspace(
    workspace: torch.Tensor | None, n: int, heads: int, splits: int, dv: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(acc [N*H*S*Dv], m/l [N*H*S*2]) fp32 views; allocated when not given."""
    need = n * heads * splits * (dv + 2)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=device)
    check_tensor("workspace", workspace, 1, (torch.float32,))
    require(workspace.numel() >= need, f"workspace holds {workspace.numel()} floats, needs {need}")
    require(workspace.device == device, f"workspace is on {workspace.device} but q is on {device}")
    acc_n = n * heads * splits * dv
    return workspace[:acc_n], workspace[acc_n:need]


def _check_launch(rows: PagedRows, tensors: list[tuple[str, torch.Tensor]], num_splits: int) -> None:
    require(HAS_TRITON, "the Triton paged attention needs the triton package, which is not installed")
    require(
        tensors[0][1].is_cuda or triton_interpreting(),
        f"the Triton paged attention needs CUDA tensors, got {tensors[0][0]} on {tensors[0][1].device}",
    )
    check_same_device(tensors + [("row metadata", rows.row_request)])
    require(
        isinstance(num_splits, int) and 1 <= num_splits <= MAX_SPLITS,
        f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}",
    )


def _check_split_chunk(split_chunk: int, block_n: int) -> None:
    require(
        isinstance(split_chunk, int) and split_chunk >= 0 and split_chunk % block_n == 0,
        f"split_chunk must be 0 or a multiple of block_n = {block_n}, got {split_chunk!r}",
    )


def fixed_splits(max_kv_len: int, granule: int = 64) -> tuple[int, int]:
    """(num_splits, split_chunk) of token-count invariant steps over up to max_kv_len keys: each row splits what it
    sees into at most num_splits ranges of a multiple of `granule` keys (a multiple of 64, so of every block_n), sized
    from that row's own visible length (paged_attention_triton._row_chunk). The split count is the same in every step
    of a model, so a row's ranges are a function of the row alone."""
    require(granule >= 64 and granule % 64 == 0, f"granule must be a positive multiple of 64, got {granule}")
    return int(min(MAX_SPLITS, max(1, -(-max_kv_len // granule)))), granule


def _combine(
    ws_acc: torch.Tensor,
    ws_ml: torch.Tensor,
    out: torch.Tensor,
    rows: PagedRows,
    split_chunk: int,
    n: int,
    heads: int,
    dv: int,
    splits: int,
    block_size: int,
) -> None:
    """Merge the split partials into out [N, H, DV]: per-row ranges (up to the row's last) or derived ranges."""
    if split_chunk:
        dv_block = min(_pow2(dv), 64)  # [S_PAD, 64] fp32 partials a program: no spills at 64 splits
        _k.combine_fixed_splits_kernel[(n, heads, triton.cdiv(dv, dv_block))](
            ws_acc,
            ws_ml,
            out,
            rows.row_request,
            rows.row_index,
            rows.kv_lens,
            rows.new_starts,
            rows.num_requests,
            rows.max_blocks * block_size,
            split_chunk,
            out.stride(0),
            out.stride(1),
            H=heads,
            DV=dv,
            DV_BLOCK=dv_block,
            SPLITS=splits,
            S_PAD=_pow2(splits, 2),
            HAS_TREE=rows.tree_mask is not None,
            num_warps=4,
            **chained(ws_acc),
        )
        return
    _k.combine_splits_kernel[(n, heads)](
        ws_acc,
        ws_ml,
        out,
        out.stride(0),
        out.stride(1),
        H=heads,
        DV=dv,
        DV_PAD=_pow2(dv),
        SPLITS=splits,
        S_PAD=_pow2(splits, 2),
        num_warps=4,
        **chained(ws_acc),
    )


def _meta_args(rows: PagedRows) -> tuple:
    tree = rows.tree_mask.view(torch.uint8) if rows.tree_mask is not None else rows.row_index
    paths = rows.tree_paths if rows.tree_paths is not None else rows.row_index
    max_new = rows.tree_mask.shape[1] if rows.tree_mask is not None else 0
    return (
        rows.block_tables,
        rows.kv_lens,
        rows.new_starts,
        rows.row_request,
        rows.row_index,
        tree,
        paths,
        rows.num_requests,
        rows.max_blocks,
        max_new,
    )


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16/fp16 operands


def default_block_n(dim: int) -> int:
    """kv indices per tile: 64 for heads up to 32 wide, else 32 (sm_90 builds then stay under 255 registers
    without spills: GQA D=128 at 64 kv per tile and 4 warps spilled)."""
    return 64 if _pow2(dim) <= 32 else 32


def paged_gqa_attention(
    q: torch.Tensor,  # [N, Hq, D] (rows/heads may be strided; last dim contiguous)
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]
    rows: PagedRows,
    sm_scale: float | None = None,
    *,
    out: torch.Tensor | None = None,  # [N, Hq, D] contiguous, q's dtype
    num_splits: int = 1,
    workspace: torch.Tensor | None = None,  # [>= N * Hq * num_splits * (D + 2)] fp32 (num_splits > 1)
    split_chunk: int = 0,  # > 0: per-row ranges in multiples of it over what each row sees (fixed_splits)
    block_n: int | None = None,
    validate: bool = False,
) -> torch.Tensor:  # [N, Hq, D]
    """GQA attention of each row over the kv indices it sees. validate=True checks the metadata values first
    (host syncs; out-of-range block ids or rows are not caught otherwise)."""
    check_tensor("kv_cache", kv_cache, 5, _DTYPES)
    nb, bs, two, hkv, d = kv_cache.shape
    check_dim("kv_cache", kv_cache, 2, 2, "2 (K then V)")
    q = _check_query("q", q, None, d, kv_cache.dtype)
    check_rows_match(rows, "q", q)
    n, hq = q.shape[0], q.shape[1]
    require(hkv >= 1 and hq % hkv == 0, f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    _check_launch(rows, [("q", q), ("kv_cache", kv_cache)], num_splits)
    out = _out_buffer(out, (n, hq, d), q)
    if validate:
        rows.validate(nb, bs)
    scale = d**-0.5 if sm_scale is None else float(sm_scale)
    require(math.isfinite(scale), f"sm_scale must be finite, got {sm_scale}")
    g = hq // hkv
    bn = block_n or default_block_n(d)
    require(bn >= 16 and bn & (bn - 1) == 0, f"block_n must be a power of two >= 16, got {bn}")
    _check_split_chunk(split_chunk, bn)
    ws_acc, ws_ml = _workspace(workspace, n, hq, num_splits, d, q.device) if num_splits > 1 else (out, out)
    _k.gqa_rows_kernel[(n, hkv, num_splits)](
        q,
        kv_cache,
        out,
        ws_acc,
        ws_ml,
        *_meta_args(rows),
        scale * LOG2E,
        split_chunk,
        q.stride(0),
        q.stride(1),
        rows.block_tables.stride(0),
        rows.tree_mask.stride(0) if rows.tree_mask is not None else 0,
        rows.tree_paths.stride(0) if rows.tree_paths is not None else 0,
        out.stride(0),
        out.stride(1),
        BLOCK_SIZE=bs,
        HKV=hkv,
        D=d,
        G=g,
        G_PAD=_pow2(g),
        D_PAD=_pow2(d),
        BLOCK_N=bn,
        HAS_TREE=rows.tree_mask is not None,
        PATHS=rows.tree_paths is not None,
        SPLITS=num_splits,
        PRECISION=_precision(q.dtype),
        ROW_RANGES=split_chunk > 0,
        num_warps=4 if _pow2(d) <= 64 else 8,
        **chained(q),
    )
    if num_splits > 1:
        _combine(ws_acc, ws_ml, out, rows, split_chunk, n, hq, d, num_splits, bs)
    return out


def paged_mla_attention(
    q_nope: torch.Tensor,  # [N, H, R] query in latent space (W_UK absorbed)
    q_pe: torch.Tensor,  # [N, H, P] rope part of the query
    cache: torch.Tensor,  # [num_blocks, block_size, R + P] (latent, then rope key)
    rows: PagedRows,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,  # [N, H, R] contiguous, q's dtype
    num_splits: int = 1,
    workspace: torch.Tensor | None = None,  # [>= N * H * num_splits * (R + 2)] fp32 (num_splits > 1)
    split_chunk: int = 0,  # > 0: per-row ranges in multiples of it over what each row sees (fixed_splits)
    heads_per_program: int | None = None,
    block_n: int | None = None,
    validate: bool = False,
) -> torch.Tensor:  # [N, H, R]
    """Absorbed MLA over the paged latent cache; every head reads the same latent and rope key."""
    check_tensor("cache", cache, 3, _DTYPES)
    nb, bs, width = cache.shape
    q_nope = _check_query("q_nope", q_nope, None, None, cache.dtype)
    n, h, r = q_nope.shape
    q_pe = _check_query("q_pe", q_pe, h, None, cache.dtype)
    p = q_pe.shape[2]
    check_dim("q_pe", q_pe, 0, n, "the number of rows N = q_nope.shape[0]")
    check_dim("cache", cache, 2, r + p, "kv_lora_rank + rope_dim (q_nope.shape[2] + q_pe.shape[2])")
    check_rows_match(rows, "q_nope", q_nope)
    _check_launch(rows, [("q_nope", q_nope), ("q_pe", q_pe), ("cache", cache)], num_splits)
    out = _out_buffer(out, (n, h, r), q_nope)
    if validate:
        rows.validate(nb, bs)
    require(math.isfinite(sm_scale) and sm_scale > 0, f"sm_scale must be a positive number, got {sm_scale}")
    hb = heads_per_program or min(_pow2(h), 64 if r <= 128 else 16)
    require(hb >= 16 and hb & (hb - 1) == 0, f"heads_per_program must be a power of two >= 16, got {hb}")
    bn = block_n or default_block_n(r)
    require(bn >= 16 and bn & (bn - 1) == 0, f"block_n must be a power of two >= 16, got {bn}")
    _check_split_chunk(split_chunk, bn)
    ws_acc, ws_ml = _workspace(workspace, n, h, num_splits, r, q_nope.device) if num_splits > 1 else (out, out)
    _k.mla_rows_kernel[(n, triton.cdiv(h, hb), num_splits)](
        q_nope,
        q_pe,
        cache,
        out,
        ws_acc,
        ws_ml,
        *_meta_args(rows),
        float(sm_scale) * LOG2E,
        split_chunk,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        rows.block_tables.stride(0),
        rows.tree_mask.stride(0) if rows.tree_mask is not None else 0,
        rows.tree_paths.stride(0) if rows.tree_paths is not None else 0,
        out.stride(0),
        out.stride(1),
        BLOCK_SIZE=bs,
        H=h,
        R=r,
        P=p,
        HB=hb,
        R_PAD=_pow2(r),
        P_PAD=_pow2(p),
        BLOCK_N=bn,
        HAS_TREE=rows.tree_mask is not None,
        PATHS=rows.tree_paths is not None,
        SPLITS=num_splits,
        PRECISION=_precision(q_nope.dtype),
        ROW_RANGES=split_chunk > 0,
        num_warps=4 if r <= 128 else 8,
        **chained(q_nope),
    )
    if num_splits > 1:
        _combine(ws_acc, ws_ml, out, rows, split_chunk, n, h, r, num_splits, bs)
    return out


def num_splits_for(max_kv_len: int, programs: int, target_programs: int = 132, min_chunk: int = 256) -> int:
    """A static split count for a graph: enough programs to fill ~target_programs SMs, chunks >= min_chunk."""
    by_len = max(1, max_kv_len // min_chunk)
    by_grid = max(1, -(-target_programs // max(1, programs)))
    return int(min(MAX_SPLITS, by_len, by_grid))
