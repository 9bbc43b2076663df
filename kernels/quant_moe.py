"""Quantized-weight kernels: checked wrappers around quant_moe_triton (references in quant_reference.py).

- ``w4a16_moe``: routed-experts MoE on int4 pack-quantized experts (Kimi-K2), bf16 activations;
- ``fp8_moe``: the same on FP8 block-scaled experts (DeepSeek-V3, Qwen3 FP8);
- ``fp8_linear``: y = x W^T for an FP8 block-scaled dense weight (attention, shared experts).

Same launch plan as fused_moe (align, gate+up with SiLU, down times routing weight, fixed-order top-k sum; a slot of
NO_EXPERT gets no row and adds 0);
only the weight tiles differ: read packed and dequantized in registers, so every touched expert's packed
weights and scales are read once per call when BM covers its rows (T <= 64). Activations are not quantized.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from specserve.kernels.checks import check_dim, check_same_device, check_tensor, require, triton_interpreting
from specserve.kernels.fused_moe import (
    ALIGN_IN_TRITON_MAX_SLOTS,
    HAS_TRITON,
    MoETileConfig,
    align_torch,
    align_triton,
    triton_next_pow2,
)

if HAS_TRITON:
    import triton

    from specserve.kernels import moe_triton, quant_gemv_triton, quant_moe_triton

_ACT_DTYPES = (torch.bfloat16, torch.float16)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)
_FP8 = (torch.float8_e4m3fn,)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _check_routing(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    check_tensor("topk_ids", topk_ids, 2, _ID_DTYPES)
    check_tensor("topk_weights", topk_weights, 2, _SCALE_DTYPES)
    check_dim("topk_ids", topk_ids, 0, hidden.shape[0], "number of tokens T = hidden.shape[0]")
    require(
        topk_weights.shape == topk_ids.shape,
        f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids shape {tuple(topk_ids.shape)}",
    )


def _require_triton(hidden: torch.Tensor) -> None:
    require(HAS_TRITON, "the quantized kernels need the triton package, which is not installed")
    require(hidden.is_cuda or triton_interpreting(), f"the quantized kernels need CUDA tensors, got {hidden.device}")


def check_w4a16_args(
    hidden: torch.Tensor,  # [T, H]
    w13_packed: torch.Tensor,  # [E, 2I, H / 8] int32
    w13_scale: torch.Tensor,  # [E, 2I, H / G]
    w2_packed: torch.Tensor,  # [E, H, I / 8] int32
    w2_scale: torch.Tensor,  # [E, H, I / G]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    group_size: int,
) -> tuple[int, int, int, int]:
    """Validate; return (T, H, E, I). H and I must be multiples of group_size (whole words and groups)."""
    check_tensor("hidden", hidden, 2, _ACT_DTYPES)
    for name, t in (("w13_packed", w13_packed), ("w2_packed", w2_packed)):
        check_tensor(name, t, 3, (torch.int32,))
    for name, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        check_tensor(name, t, 3, _SCALE_DTYPES)
    require(group_size > 0 and group_size % 8 == 0, f"group_size must be a positive multiple of 8, got {group_size}")
    t, h = hidden.shape
    e, two_i, _ = w13_packed.shape
    inter = two_i // 2
    require(
        t >= 1 and two_i % 2 == 0 and two_i > 0, f"need T >= 1 and w13 rows 2*I, got {tuple(hidden.shape)}, {two_i}"
    )
    require(
        h % group_size == 0 and inter % group_size == 0,
        f"H = {h} and I = {inter} must be multiples of group_size {group_size}",
    )
    check_dim("w13_packed", w13_packed, 2, h // 8, "H / 8 words")
    require(
        tuple(w13_scale.shape) == (e, two_i, h // group_size),
        f"w13_scale shape {tuple(w13_scale.shape)} must be {(e, two_i, h // group_size)}",
    )
    require(
        tuple(w2_packed.shape) == (e, h, inter // 8),
        f"w2_packed shape {tuple(w2_packed.shape)} must be {(e, h, inter // 8)}",
    )
    require(
        tuple(w2_scale.shape) == (e, h, inter // group_size),
        f"w2_scale shape {tuple(w2_scale.shape)} must be {(e, h, inter // group_size)}",
    )
    _check_routing(hidden, topk_ids, topk_weights)
    check_same_device(
        [
            ("hidden", hidden),
            ("w13_packed", w13_packed),
            ("w13_scale", w13_scale),
            ("w2_packed", w2_packed),
            ("w2_scale", w2_scale),
            ("topk_ids", topk_ids),
            ("topk_weights", topk_weights),
        ]
    )
    return t, h, e, inter


def check_fp8_moe_args(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] e4m3
    w13_scale_inv: torch.Tensor,  # [E, ceil(2I / BO), ceil(H / BI)]
    w2: torch.Tensor,  # [E, H, I] e4m3
    w2_scale_inv: torch.Tensor,  # [E, ceil(H / BO), ceil(I / BI)]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    block: tuple[int, int],
) -> tuple[int, int, int, int]:
    """Validate; return (T, H, E, I)."""
    check_tensor("hidden", hidden, 2, _ACT_DTYPES)
    check_tensor("w13", w13, 3, _FP8)
    check_tensor("w2", w2, 3, _FP8)
    check_tensor("w13_scale_inv", w13_scale_inv, 3, _SCALE_DTYPES)
    check_tensor("w2_scale_inv", w2_scale_inv, 3, _SCALE_DTYPES)
    require(len(block) == 2 and min(block) > 0, f"block must be two positive ints, got {block}")
    bo, bi = block
    t, h = hidden.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    require(
        t >= 1 and two_i % 2 == 0 and two_i > 0, f"need T >= 1 and w13 rows 2*I, got {tuple(hidden.shape)}, {two_i}"
    )
    check_dim("w13", w13, 2, h, "hidden size H = hidden.shape[1]")
    require(tuple(w2.shape) == (e, h, inter), f"w2 shape {tuple(w2.shape)} must be {(e, h, inter)}")
    for name, s, rows, cols in (("w13_scale_inv", w13_scale_inv, two_i, h), ("w2_scale_inv", w2_scale_inv, h, inter)):
        want = (e, _ceil(rows, bo), _ceil(cols, bi))
        require(tuple(s.shape) == want, f"{name} shape {tuple(s.shape)} must be {want} (blocks of {list(block)})")
    _check_routing(hidden, topk_ids, topk_weights)
    check_same_device(
        [
            ("hidden", hidden),
            ("w13", w13),
            ("w13_scale_inv", w13_scale_inv),
            ("w2", w2),
            ("w2_scale_inv", w2_scale_inv),
            ("topk_ids", topk_ids),
            ("topk_weights", topk_weights),
        ]
    )
    return t, h, e, inter


W4A16_GEMV_MAX_TOKENS = 8  # up to here the W4A16 MoE runs as per-slot GEMVs (no tensor cores): BENCHMARKS.md
GEMV_LANE_TOKENS = 4  # past W4A16_GEMV_MAX_TOKENS: program rows per k (GemvTile.lanes; the sweep tries others)


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


@dataclass(frozen=True)
class GemvTile:
    """One W4A16 GEMV kernel's launch (kernels/quant_gemv_triton.py): a program computes `bn` output rows of a slot,
    walking the input `bkw` packed words (8 * bkw columns) a step; `warps` and `stages` are Triton's num_warps and
    num_stages; `split` cuts the input into that many fixed chunks, each its own program, whose fp32 partial sums a
    second pass adds in chunk order; `prefetch` loads the next step's words while computing this one; `lanes`:
    past W4A16_GEMV_MAX_TOKENS tokens, the program rows per k that take the slots in turn (gemv_lanes). A slot's
    reduction order depends on the tile (bkw, split, the warps' layout) and never on the row count, so any tile
    keeps the GEMV token-count invariant as long as every step runs the same one."""

    bn: int = 32
    bkw: int = 32
    warps: int = 4
    stages: int = 1
    split: int = 1
    prefetch: bool = False
    lanes: int = GEMV_LANE_TOKENS

    def __post_init__(self) -> None:
        require(
            _pow2(self.bn)
            and _pow2(self.bkw)
            and _pow2(self.warps)
            and self.warps <= 32
            and self.stages >= 1
            and self.split >= 1
            and self.lanes >= 1,
            f"GemvTile needs bn, bkw and warps powers of two (warps <= 32), stages, split and lanes >= 1, got {self}",
        )

    def label(self) -> str:
        """bn16_bkw64_w2_s1, then _k<split>, _pf and _l<lanes> where they are not the defaults."""
        extra = (f"_k{self.split}" if self.split > 1 else "") + ("_pf" if self.prefetch else "")
        extra += f"_l{self.lanes}" if self.lanes != GEMV_LANE_TOKENS else ""
        return f"bn{self.bn}_bkw{self.bkw}_w{self.warps}_s{self.stages}{extra}"

    def source(self) -> str:
        """The tile as Python (GemvTile(16, 64, 2, 1, split=2, prefetch=True)): the sweep's default line."""
        extra = "".join(
            f", {f.name}={getattr(self, f.name)!r}" for f in fields(self)[4:] if getattr(self, f.name) != f.default
        )
        return f"GemvTile({self.bn}, {self.bkw}, {self.warps}, {self.stages}{extra})"


@dataclass(frozen=True)
class GemvTiles:
    """The tile of each GEMV kernel: gate/up reads [2I, H / 8] words of an expert, down [H, I / 8]."""

    gate_up: GemvTile = GemvTile()
    down: GemvTile = GemvTile()


GEMV_TILES = GemvTiles(
    gate_up=GemvTile(16, 64, 2, 1), down=GemvTile(16, 64, 2, 1)
)  # the H200 sweep's best (BENCHMARKS.md)


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
    )
    return _sum_rows(per_slot.view(t, k, h), hidden.dtype, topk_ids.reshape(-1))


def gemv_lanes(num_tokens: int, top_k: int, lane_tokens: int = GEMV_LANE_TOKENS) -> int:
    """Program rows of the GEMV: one a slot up to W4A16_GEMV_MAX_TOKENS tokens, past that (the invariant steps' 17
    rows, most of them pad rows of NO_EXPERT) lane_tokens * K that take the slots in turn, so pad slots cost a load
    in a running program, not programs of their own."""
    n = num_tokens * top_k
    return n if num_tokens <= W4A16_GEMV_MAX_TOKENS else min(n, lane_tokens * top_k)


def _gemv_chunk(words: int, tile: GemvTile, group: int) -> tuple[int, bool]:
    """(words per input chunk: whole steps, tile.split chunks cover the row; every step whole)."""
    require(8 * tile.bkw % group == 0, f"a GEMV step of {tile.bkw} words must hold whole groups of {group} columns")
    steps = triton.cdiv(words, tile.bkw)
    return triton.cdiv(steps, tile.split) * tile.bkw, words % tile.bkw == 0


def w4a16_gemv_gate_up(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H / 8] int32
    s13: torch.Tensor,  # [E, 2I, H / G]
    ids: torch.Tensor,  # [T*K] expert of each flat slot
    weights: torch.Tensor,  # [T*K] routing weight of each flat slot
    group: int,
    tile: GemvTile,
) -> torch.Tensor:  # [T*K, I] silu(gate) * up per slot (a NO_EXPERT slot's row unwritten)
    """The GEMV's first kernel, unchecked (w4a16_moe checks its arguments; the GEMV tile sweep calls it alone); a
    split tile writes [T*K, split, 2I] fp32 partial sums and w4a16_gemv_act_kernel adds them."""
    t, h = hidden.shape
    n = ids.numel()
    inter = w13.shape[1] // 2
    lanes = gemv_lanes(t, n // t, tile.lanes)
    chunk, even = _gemv_chunk(h // 8, tile, group)
    act = torch.empty(n, inter, dtype=hidden.dtype, device=hidden.device)
    out = act if tile.split == 1 else torch.empty(n, tile.split, 2 * inter, dtype=torch.float32, device=hidden.device)
    quant_gemv_triton.w4a16_gemv_gate_up_kernel[(lanes, triton.cdiv(inter, tile.bn), tile.split)](
        hidden,
        w13,
        s13,
        ids,
        weights,
        out,
        n,
        lanes,
        n // t,
        h,
        inter,
        chunk,
        quant_gemv_triton.EXP_BITS,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        act.stride(0),
        G=group,
        BN=tile.bn,
        BKW=tile.bkw,
        SPLIT=tile.split,
        PREFETCH=tile.prefetch,
        EVEN_K=even,
        num_warps=tile.warps,
        num_stages=tile.stages,
    )
    if tile.split > 1:
        ba = min(1024, triton_next_pow2(inter))
        quant_gemv_triton.w4a16_gemv_act_kernel[(n, triton.cdiv(inter, ba))](
            out, ids, act, inter, act.stride(0), SPLIT=tile.split, BA=ba, num_warps=4
        )
    return act


def w4a16_gemv_down(
    act: torch.Tensor,  # [T*K, I]
    w2: torch.Tensor,  # [E, H, I / 8] int32
    s2: torch.Tensor,  # [E, H, I / G]
    ids: torch.Tensor,  # [T*K]
    weights: torch.Tensor,  # [T*K]
    group: int,
    tile: GemvTile,
    num_tokens: int,
) -> torch.Tensor:  # [T*K, split, H] fp32 weighted expert output per slot and input chunk (NO_EXPERT: unwritten)
    """The GEMV's second kernel, unchecked (as w4a16_gemv_gate_up); the top-k sum adds a slot's chunks."""
    n, inter = act.shape
    h = w2.shape[1]
    lanes = gemv_lanes(num_tokens, n // num_tokens, tile.lanes)
    chunk, even = _gemv_chunk(inter // 8, tile, group)
    per_slot = torch.empty(n, tile.split, h, dtype=torch.float32, device=act.device)
    quant_gemv_triton.w4a16_gemv_down_kernel[(lanes, triton.cdiv(h, tile.bn), tile.split)](
        act,
        w2,
        s2,
        ids,
        weights,
        per_slot,
        n,
        lanes,
        h,
        inter,
        chunk,
        quant_gemv_triton.EXP_BITS,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        per_slot.stride(0),
        G=group,
        BN=tile.bn,
        BKW=tile.bkw,
        SPLIT=tile.split,
        PREFETCH=tile.prefetch,
        EVEN_K=even,
        num_warps=tile.warps,
        num_stages=tile.stages,
    )
    return per_slot


def _w4a16_gemv(hidden, w13, s13, w2, s2, topk_ids, topk_weights, group, tiles: GemvTiles):
    """A program row per (token, k) slot, no expert sort (gemv_lanes: past W4A16_GEMV_MAX_TOKENS the rows take the
    slots in turn), each kernel with its tile of `tiles`."""
    t = hidden.shape[0]
    ids = topk_ids.reshape(-1)  # [T*K]
    weights = topk_weights.reshape(-1)  # [T*K]
    act = w4a16_gemv_gate_up(hidden, w13, s13, ids, weights, group, tiles.gate_up)
    return w4a16_gemv_sum(w4a16_gemv_down(act, w2, s2, ids, weights, group, tiles.down, t), ids, t, hidden.dtype)


def w4a16_gemv_sum(
    per_slot: torch.Tensor,  # [T*K, split, H] fp32 (w4a16_gemv_down)
    ids: torch.Tensor,  # [T*K]
    num_tokens: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [T, H]
    """The GEMV's last pass: each token's slots and their chunks added in (k, chunk) order; NO_EXPERT slots skipped."""
    n, split, h = per_slot.shape
    return _sum_rows(per_slot.view(num_tokens, n // num_tokens * split, h), dtype, ids, split)


def _sum_rows(
    parts: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor | None = None, per_id: int = 1
) -> torch.Tensor:  # [T, S, H] fp32 (ids [T, S / per_id]) -> [T, H]
    """Sum over S in a fixed order (deterministic), cast to dtype; with ids, a part of NO_EXPERT adds 0 unread
    (per_id consecutive parts share an id: the split GEMV's chunks of one slot)."""
    t, s, h = parts.shape
    out = torch.empty(t, h, dtype=dtype, device=parts.device)
    bh = min(1024, triton_next_pow2(h))
    moe_triton.sum_topk_kernel[(t, triton.cdiv(h, bh))](
        parts, parts if ids is None else ids, out, h, TOPK=s, BH=bh, SKIP=ids is not None, PARTS=per_id, num_warps=4
    )
    return out


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
    _require_triton(hidden)
    if config is None and t <= gemv_max_tokens:
        return _w4a16_gemv(
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
    _require_triton(hidden)
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
    check_tensor("x", x, 2, _ACT_DTYPES)
    check_tensor("weight", weight, 2, _FP8)
    check_tensor("scale_inv", scale_inv, 2, _SCALE_DTYPES)
    require(len(block) == 2 and min(block) > 0, f"block must be two positive ints, got {block}")
    t, k = x.shape
    n = weight.shape[0]
    require(t >= 1, "x must hold at least one row")
    check_dim("weight", weight, 1, k, "input features = x.shape[1]")
    want = (_ceil(n, block[0]), _ceil(k, block[1]))
    require(
        tuple(scale_inv.shape) == want,
        f"scale_inv shape {tuple(scale_inv.shape)} must be {want} (blocks of {list(block)})",
    )
    check_same_device([("x", x), ("weight", weight), ("scale_inv", scale_inv)])
    _require_triton(x)
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
    )
    return y if split == 1 else _sum_rows(dst, x.dtype)


def _split_k(x: torch.Tensor, t: int, n: int, k: int, bm: int, bn: int, bk: int) -> tuple[int, int]:
    """(splits, columns per split): at decode sizes (T <= 16), enough programs for about two per SM, each
    with at least two K tiles; otherwise no split."""
    k_tiles = triton.cdiv(k, bk)
    programs = triton.cdiv(t, bm) * triton.cdiv(n, bn)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    split = 1 if t > 16 else max(1, min(k_tiles // 2, triton.cdiv(2 * sms, programs)))
    k_chunk = triton.cdiv(k_tiles, split) * bk
    return triton.cdiv(k, k_chunk), k_chunk
