"""Pure-torch references for quantized weights as published checkpoints store them (the oracles of the
W4A16 and FP8 kernels, and the CPU path that dequantizes and computes).

INT4, compressed-tensors ``pack-quantized`` (symmetric, group strategy; Kimi-K2's routed experts):
    weight_packed int32 [out, ceil(in / 8)]: eight consecutive input-dim values per word, value j of a
    word at bits 4j..4j+3, each stored as q + 8 (q in [-8, 7]);
    weight_scale [out, ceil(in / group)] (bf16 as published);  W[o, i] = q[o, i] * scale[o, i // group].
FP8 block (DeepSeek-V3/R1, Qwen3 FP8):
    weight float8_e4m3fn [out, in];  weight_scale_inv [ceil(out / bo), ceil(in / bi)] (float32, bf16 or
    f16), edge blocks partial;  W[o, i] = float(weight[o, i]) * scale_inv[o // bo, i // bi].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.moe_reference import used_experts

INT4_PER_WORD = 8
INT4_OFFSET = 8


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:  # [R, W] int32 -> [R, 8 * W] int8 in [-8, 7]
    """Each int32 word holds 8 nibbles, value j at bits 4j (little end first), stored as q + 8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # [8]
    nibbles = (packed.to(torch.int32)[..., None] >> shifts) & 0xF  # [R, W, 8]
    return (nibbles - INT4_OFFSET).to(torch.int8).flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:  # [R, C] int8 in [-8, 7] -> [R, ceil(C / 8)] int32
    """Inverse of unpack_int4 (the tail of the last word is zero padding, i.e. stored nibble 0)."""
    rows, cols = q.shape
    pad = -cols % INT4_PER_WORD
    u = F.pad(q.to(torch.int64) + INT4_OFFSET, (0, pad)).view(rows, -1, INT4_PER_WORD)  # [R, W, 8]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (u << shifts).sum(-1)  # [R, W] in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequant_int4(
    packed: torch.Tensor,  # [R, ceil(C / 8)] int32
    scale: torch.Tensor,  # [R, ceil(C / group)]
    group_size: int,
    cols: int,
) -> torch.Tensor:  # [R, C] float32
    """W = q * scale[:, i // group] for the first `cols` input columns."""
    q = unpack_int4(packed)[:, :cols].float()
    s = scale.float().repeat_interleave(group_size, dim=1)[:, :cols]
    return q * s


def dequant_fp8_block(
    weight: torch.Tensor,  # [R, C] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(R / bo), ceil(C / bi)]
    block: tuple[int, int],
    origin: tuple[int, int] = (0, 0),
) -> torch.Tensor:  # [R, C] float32
    """W = float(weight) * scale_inv[o // bo, i // bi] (edge blocks partial). origin: where weight[0, 0]
    sits inside the block of scale_inv[0, 0] (a view of a larger tensor that starts mid-block)."""
    rows, cols = weight.shape
    (r, c), (bo, bi) = origin, block
    s = scale_inv.float().repeat_interleave(bo, dim=0)[r : r + rows].repeat_interleave(bi, dim=1)[:, c : c + cols]
    return weight.float() * s


def w4a16_moe_reference(
    hidden: torch.Tensor,  # [T, H] bf16 / f16 / f32
    w13_packed: torch.Tensor,  # [E, 2I, H / 8] int32 (gate rows then up rows)
    w13_scale: torch.Tensor,  # [E, 2I, H / group]
    w2_packed: torch.Tensor,  # [E, H, I / 8] int32
    w2_scale: torch.Tensor,  # [E, H, I / group]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    group_size: int,
) -> torch.Tensor:  # [T, H]
    """The MoE of moe_reference on int4 experts: each touched expert dequantized, then computed in fp32."""
    h = hidden.shape[1]
    inter = w13_packed.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in used_experts(topk_ids):  # NO_EXPERT slots add nothing
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13 = dequant_int4(w13_packed[e], w13_scale[e], group_size, h)  # [2I, H]
        w2 = dequant_int4(w2_packed[e], w2_scale[e], group_size, inter)  # [H, I]
        out.index_add_(0, rows, _expert(hidden[rows].float(), w13, w2) * topk_weights[rows, slot, None].float())
    return out.to(hidden.dtype)


def fp8_moe_reference(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] float8_e4m3fn
    w13_scale_inv: torch.Tensor,  # [E, ceil(2I / bo), ceil(H / bi)]
    w2: torch.Tensor,  # [E, H, I] float8_e4m3fn
    w2_scale_inv: torch.Tensor,  # [E, ceil(H / bo), ceil(I / bi)]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    block: tuple[int, int],
) -> torch.Tensor:  # [T, H]
    """The MoE of moe_reference on FP8 block-scaled experts (weights dequantized, activations unquantized).

    With 2I not a multiple of bo the gate and up halves share a scale row block, as a stacked [2I, H]
    tensor would; the kernels and checkpoints stack gate and up with I a multiple of bo."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in used_experts(topk_ids):  # NO_EXPERT slots add nothing
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        a = dequant_fp8_block(w13[e], w13_scale_inv[e], block)
        b = dequant_fp8_block(w2[e], w2_scale_inv[e], block)
        out.index_add_(0, rows, _expert(hidden[rows].float(), a, b) * topk_weights[rows, slot, None].float())
    return out.to(hidden.dtype)


def fp8_linear_reference(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(out / bo), ceil(in / bi)]
    block: tuple[int, int],
) -> torch.Tensor:  # [T, out]
    """y = x W^T with W dequantized (fp32 accumulation, activations unquantized)."""
    return (x.float() @ dequant_fp8_block(weight, scale_inv, block).t()).to(x.dtype)


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:  # [n, H] fp32 -> [n, H]
    inter = w2.shape[1]
    gate_up = x @ w13.t()
    return (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2.t()
