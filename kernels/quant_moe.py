"""Quantized-weight kernels: checked wrappers around quant_moe_triton (references in quant_reference.py).

- ``w4a16_moe``: routed-experts MoE on int4 pack-quantized experts (Kimi-K2), bf16 activations;
- ``fp8_moe``: the same on FP8 block-scaled experts (DeepSeek-V3, Qwen3 FP8);
- ``fp8_linear``: y = x W^T for an FP8 block-scaled dense weight (attention, shared experts).

Same launch plan as fused_moe (align, gate+up with SiLU, down times routing weight, fixed-order top-k sum; a slot of
NO_EXPERT gets no row and adds 0);
only the weight tiles differ: read packed and dequantized in registers, so every touched expert's packed
weights and scales are read once per call when BM covers its rows (T <= 64). Activations are not quantized.
Their argument checks are kernels/quant_args.py; the W4A16 MoE's per-slot GEMV path (up to W4A16_GEMV_MAX_TOKENS
tokens) and its tiles are kernels/quant_gemv.py.
"""

from __future__ import annotations

import torch

from specserve.kernels.fused_moe import (
    ALIGN_IN_TRITON_MAX_SLOTS,
    HAS_TRITON,
    MoETileConfig,
    align_torch,
    align_triton,
    triton_next_pow2,
)
from specserve.kernels.launch import chained
from specserve.kernels.quant_args import check_fp8_linear_args, check_fp8_moe_args, check_w4a16_args, require_triton
from specserve.kernels.quant_gemv import GEMV_TILES, W4A16_GEMV_MAX_TOKENS, GemvTiles, sum_rows, w4a16_gemv

if HAS_TRITON:
    import triton

    from specserve.kernels import quant_moe_triton


def quant_tile_config(num_tokens: int, int4: bool) -> MoETileConfig:
    """Decode / verify sizes (T <= 64): one BM block per expert, narrow N tiles, long K tiles (INT4: 32 words a
    row); larger T: wide tiles. FP8 K tiles stay at 128 so a tile lies in one 128-wide scale block."""
    if num_tokens <= 64:  # measured on the H200 (BENCHMARKS.md): INT4 runs best unpipelined, FP8 with 3 stages
        bm = max(16, triton_next_pow2(num_tokens))
        bk, stages = (256, 1) if int4 else (128, 3)
        return MoETileConfig(bm, 32, bk, 4, stages, 64, bk, 4, stages)
    return MoETileConfig(64, 64, 128, 8, 3, 64, 128, 8, 3)


def _int4_bk(bk: int) -> int:
    """INT4 K tiles hold whole words and each nibble's dot needs K >= 16: at least 128 columns."""
    return max(128, bk)


def _moe(hidden, w13, s13, w2, s2, topk_ids, topk_weights, e, inter, config, int4, group, block):
    t, h = hidden.shape
    k = topk_ids.shape[1]
    n = t * k
    cfg = config or quant_tile_config(t, int4)
    gu_bk, dn_bk = (_int4_bk(cfg.gu_bk), _int4_bk(cfg.dn_bk)) if int4 else (cfg.gu_bk, cfg.dn_bk)
    align = align_triton if n <= ALIGN_IN_TRITON_MAX_SLOTS else align_torch
    sorted_slot, block_expert, num_blocks = align(topk_ids, e, cfg.bm)
    maxb = block_expert.numel()
    consts = dict(INT4=int4, G=group, BO=block[0], BI=block[1], BM=cfg.bm)
    act = torch.empty(maxb * cfg.bm, inter, dtype=hidden.dtype, device=hidden.device)  # [MAXP, I]
    quant_moe_triton.quant_moe_gate_up_kernel[(maxb, triton.cdiv(inter, cfg.gu_bn))](
        hidden,
        w13,
        s13,
        act,
        sorted_slot,
        block_expert,
        num_blocks,
        n,
        k,
        h,
        inter,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        act.stride(0),
        BN=cfg.gu_bn,
        BK=gu_bk,
        num_warps=cfg.gu_warps,
        num_stages=cfg.gu_stages,
        **consts,
        **chained(hidden),
    )
    per_slot = torch.empty(n, h, dtype=torch.float32, device=hidden.device)  # [T*K, H]
    quant_moe_triton.quant_moe_down_kernel[(maxb, triton.cdiv(h, cfg.dn_bn))](
        act,
        w2,
        s2,
        topk_weights.reshape(-1),
        per_slot,
        sorted_slot,
        block_expert,
        num_blocks,
        n,
        h,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        per_slot.stride(0),
        BN=cfg.dn_bn,
        BK=dn_bk,
        num_warps=cfg.dn_warps,
        num_stages=cfg.dn_stages,
        **consts,
        **chained(act),
    )
    return sum_rows(per_slot.view(t, k, h), hidden.dtype, topk_ids.reshape(-1))


def w4a16_moe(
    hidden: torch.Tensor,  # [T, H] bf16 / f16
    w13_packed: torch.Tensor,  # [E, 2I, H / 8] int32 (gate rows then up rows)
    w13_scale: torch.Tensor,  # [E, 2I, H / G]
    w2_packed: torch.Tensor,  # [E, H, I / 8] int32
    w2_scale: torch.Tensor,  # [E, H, I / G]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    group_size: int = 32,
    config: MoETileConfig | None = None,
    gemv_max_tokens: int = W4A16_GEMV_MAX_TOKENS,
    gemv_tiles: GemvTiles | None = None,
) -> torch.Tensor:  # [T, H]
    """Same function as quant_reference.w4a16_moe_reference (Triton on CUDA or under TRITON_INTERPRET).

    Up to gemv_max_tokens tokens (and no config given) the per-slot GEMVs run, else the expert-sorted dot path. The
    target's invariant steps raise it to their row count (Int4StackedExperts.gemv_max_tokens): the GEMV's rows do not
    depend on T, and a step's pad rows (NO_EXPERT) then cost nothing, so a padded decode reads one token's experts.
    gemv_tiles: the GEMV kernels' tiles (default GEMV_TILES; one engine must keep one, see GemvTile)."""
    t, _, e, inter = check_w4a16_args(
        hidden, w13_packed, w13_scale, w2_packed, w2_scale, topk_ids, topk_weights, group_size
    )
    require_triton(hidden)
    if config is None and t <= gemv_max_tokens:
        return w4a16_gemv(
            hidden,
            w13_packed,
            w13_scale,
            w2_packed,
            w2_scale,
            topk_ids,
            topk_weights,
            group_size,
            gemv_tiles or GEMV_TILES,
        )
    return _moe(
        hidden,
        w13_packed,
        w13_scale,
        w2_packed,
        w2_scale,
        topk_ids,
        topk_weights,
        e,
        inter,
        config,
        True,
        group_size,
        (1, 1),
    )


def fp8_moe(
    hidden: torch.Tensor,  # [T, H] bf16 / f16
    w13: torch.Tensor,  # [E, 2I, H] e4m3
    w13_scale_inv: torch.Tensor,  # [E, ceil(2I / BO), ceil(H / BI)]
    w2: torch.Tensor,  # [E, H, I] e4m3
    w2_scale_inv: torch.Tensor,  # [E, ceil(H / BO), ceil(I / BI)]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    block: tuple[int, int] = (128, 128),
    config: MoETileConfig | None = None,
) -> torch.Tensor:  # [T, H]
    """Same function as quant_reference.fp8_moe_reference."""
    _, _, e, inter = check_fp8_moe_args(hidden, w13, w13_scale_inv, w2, w2_scale_inv, topk_ids, topk_weights, block)
    require_triton(hidden)
    return _moe(
        hidden, w13, w13_scale_inv, w2, w2_scale_inv, topk_ids, topk_weights, e, inter, config, False, 8, tuple(block)
    )


def fp8_linear(
    x: torch.Tensor,  # [T, in] bf16 / f16
    weight: torch.Tensor,  # [out, in] e4m3
    scale_inv: torch.Tensor,  # [ceil(out / BO), ceil(in / BI)]
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:  # [T, out]
    """Same function as quant_reference.fp8_linear_reference (a GEMV for decode sizes, a GEMM beyond)."""
    t, k, n = check_fp8_linear_args(x, weight, scale_inv, block)
    require_triton(x)
    bm = max(16, min(64, triton_next_pow2(t)))
    bn, bk = (32, 128) if t <= 16 else (64, 64)
    split, k_chunk = _split_k(x, t, n, k, bm, bn, bk)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    # [T, SPLIT, N] fp32 partials when K is split, summed below
    dst = y if split == 1 else torch.empty(t, split, n, dtype=torch.float32, device=x.device)
    quant_moe_triton.fp8_linear_kernel[(triton.cdiv(t, bm), triton.cdiv(n, bn), split)](
        x,
        weight,
        scale_inv,
        dst,
        t,
        n,
        k,
        k_chunk,
        x.stride(0),
        weight.stride(0),
        scale_inv.stride(0),
        y.stride(0),
        BO=block[0],
        BI=block[1],
        BM=bm,
        BN=bn,
        BK=bk,
        SPLIT=split,
        num_warps=4,
        num_stages=2,
        **chained(x),
    )
    return y if split == 1 else sum_rows(dst, x.dtype)


def _split_k(x: torch.Tensor, t: int, n: int, k: int, bm: int, bn: int, bk: int) -> tuple[int, int]:
    """(splits, columns per split): at decode sizes (T <= 16), enough programs for about two per SM, each
    with at least two K tiles; otherwise no split."""
    k_tiles = triton.cdiv(k, bk)
    programs = triton.cdiv(t, bm) * triton.cdiv(n, bn)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    split = 1 if t > 16 else max(1, min(k_tiles // 2, triton.cdiv(2 * sms, programs)))
    k_chunk = triton.cdiv(k_tiles, split) * bk
    return triton.cdiv(k, k_chunk), k_chunk
