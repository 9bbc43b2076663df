"""Pure-torch references for the fused (QK-norm +) RoPE + paged-cache-write kernels (rope_cache.py).

RoPE as specserve's RotaryEmbedding.apply computes it, op by op in the io dtype: with (x1, x2) the two halves of a
head (neox) or its even and odd elements (interleaved), out = cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin]);
the interleaved output is laid out [even pairs', odd pairs'] (transformers' layout, used for q and k alike).
cos / sin are tables [max_positions, rope_dim / 2] in the io dtype, indexed by each token's position.
Cache layouts: GQA [num_blocks, block_size, 2, Hkv, D] (roped k, v); MLA [num_blocks, block_size, R + P]
(latent, roped k_pe). Slot -1 = do not write.
"""

from __future__ import annotations

import torch

from specserve.kernels.norm_reference import rms_norm_reference


def rope_reference(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, D / 2] (rows already gathered by position)
    sin: torch.Tensor,  # [T, D / 2]
    interleaved: bool,
) -> torch.Tensor:  # [T, H, D]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _write(cache: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor) -> None:
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    keep = slots >= 0
    flat.index_copy_(0, slots[keep].to(torch.int64), entries[keep].to(cache.dtype))


def rope_cache_gqa_reference(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos_table: torch.Tensor,  # [max_positions, D / 2]
    sin_table: torch.Tensor,  # [max_positions, D / 2]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D] written in place
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    interleaved: bool = False,
    q_norm_weight: torch.Tensor | None = None,  # [D] QK-norm (Qwen3) before RoPE
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps: float = 1e-6,
) -> torch.Tensor:  # roped q [T, Hq, D]
    if q_norm_weight is not None:
        q = rms_norm_reference(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = rms_norm_reference(k, k_norm_weight, eps)
    pos = positions.long()
    cos, sin = cos_table[pos], sin_table[pos]
    q = rope_reference(q, cos, sin, interleaved)
    k = rope_reference(k, cos, sin, interleaved)
    _write(kv_cache, slot_mapping, torch.stack([k, v], dim=1))
    return q


def rope_cache_mla_reference(
    q_pe: torch.Tensor,  # [T, H, P]
    k_pe: torch.Tensor,  # [T, P] shared rope key
    latent: torch.Tensor,  # [T, R] (before kv_a_layernorm when latent_norm_weight is given)
    positions: torch.Tensor,  # [T]
    cos_table: torch.Tensor,  # [max_positions, P / 2]
    sin_table: torch.Tensor,  # [max_positions, P / 2]
    cache: torch.Tensor,  # [num_blocks, block_size, R + P] written in place
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    interleaved: bool = True,
    latent_norm_weight: torch.Tensor | None = None,  # [R] kv_a_layernorm
    eps: float = 1e-6,
    absorb: tuple[torch.Tensor, torch.Tensor] | None = None,  # (q_nope [T, H, DN], W_UK [H, DN, R])
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # roped q_pe [T, H, P] (, q_latent [T, H, R] with absorb)
    if absorb is not None:  # float32 products and sums, rounded once (the batched GEMM's function)
        q_nope, w_uk = absorb
        q_latent = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk.float()).to(q_nope.dtype)
        return rope_cache_mla_reference(
            q_pe,
            k_pe,
            latent,
            positions,
            cos_table,
            sin_table,
            cache,
            slot_mapping,
            interleaved,
            latent_norm_weight,
            eps,
        ), q_latent
    if latent_norm_weight is not None:
        latent = rms_norm_reference(latent, latent_norm_weight, eps)
    pos = positions.long()
    cos, sin = cos_table[pos], sin_table[pos]
    q_pe = rope_reference(q_pe, cos, sin, interleaved)
    k_rot = rope_reference(k_pe[:, None, :], cos, sin, interleaved)[:, 0]
    _write(cache, slot_mapping, torch.cat([latent, k_rot], dim=-1))
    return q_pe
