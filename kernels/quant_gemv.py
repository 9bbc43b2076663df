"""The W4A16 MoE's per-slot GEMV path (kernels/quant_gemv_triton.py's kernels; no tensor cores): a program row per
(token, k) slot with no expert sort, each kernel with its tile (GemvTile; the defaults GEMV_TILES, the H200 sweep's
best), and the fixed-order sum of a token's slots (sum_rows, which the dot path and fp8_linear share). Unchecked:
kernels/quant_moe.py's w4a16_moe checks the arguments and picks this path up to W4A16_GEMV_MAX_TOKENS tokens."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from specserve.kernels.checks import require
from specserve.kernels.fused_moe import HAS_TRITON, triton_next_pow2
from specserve.kernels.launch import chained

if HAS_TRITON:
    import triton

    from specserve.kernels import moe_triton, quant_gemv_triton

W4A16_GEMV_MAX_TOKENS = 16  # up to here the W4A16 MoE runs as per-slot GEMVs (no tensor cores): BENCHMARKS.md
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
        **chained(hidden),
    )
    if tile.split > 1:
        ba = min(1024, triton_next_pow2(inter))
        quant_gemv_triton.w4a16_gemv_act_kernel[(n, triton.cdiv(inter, ba))](
            out, ids, act, inter, act.stride(0), SPLIT=tile.split, BA=ba, num_warps=4, **chained(out)
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
        **chained(act),
    )
    return per_slot


def w4a16_gemv(hidden, w13, s13, w2, s2, topk_ids, topk_weights, group, tiles: GemvTiles):
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
    return sum_rows(per_slot.view(num_tokens, n // num_tokens * split, h), dtype, ids, split)


def sum_rows(
    parts: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor | None = None, per_id: int = 1
) -> torch.Tensor:  # [T, S, H] fp32 (ids [T, S / per_id]) -> [T, H]
    """Sum over S in a fixed order (deterministic), cast to dtype; with ids, a part of NO_EXPERT adds 0 unread
    (per_id consecutive parts share an id: the split GEMV's chunks of one slot)."""
    t, s, h = parts.shape
    out = torch.empty(t, h, dtype=dtype, device=parts.device)
    bh = min(1024, triton_next_pow2(h))
    moe_triton.sum_topk_kernel[(t, triton.cdiv(h, bh))](
        parts,
        parts if ids is None else ids,
        out,
        h,
        TOPK=s,
        BH=bh,
        SKIP=ids is not None,
        PARTS=per_id,
        num_warps=4,
        **chained(out),
    )
    return out
