"""Pure-torch references for the row-metadata paged attention kernels (paged_attention.py), fp32, one row at a time.

Same layouts as attention_reference.py:
  GQA cache [num_blocks, block_size, 2, n_kv_heads, head_dim]  (K then V on dim 2)
  MLA cache [num_blocks, block_size, kv_lora_rank + rope_dim]  (latent, then rope key)
A padding row (row_request -1) and a row that sees no token get zeros.
"""

from __future__ import annotations

import torch

from specserve.kernels.paged_rows import PagedRows


def _attend_row(
    q: torch.Tensor,  # [H, Dk] fp32
    k: torch.Tensor,  # [S, H, Dk] fp32
    v: torch.Tensor,  # [S, H, Dv] fp32
    scale: float,
) -> torch.Tensor:  # [H, Dv]
    scores = torch.einsum("hd,shd->hs", q, k) * scale
    return torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), v)


def gqa_rows_reference(
    q: torch.Tensor,  # [N, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]
    rows: PagedRows,
    sm_scale: float | None = None,
) -> torch.Tensor:  # [N, Hq, D]
    """Each row's softmax attention over the kv indices it sees; query head h reads kv head h // (Hq // Hkv)."""
    n, hq, d = q.shape
    block_size, hkv = kv_cache.shape[1], kv_cache.shape[3]
    scale = d**-0.5 if sm_scale is None else sm_scale
    flat = kv_cache.reshape(-1, 2, hkv, d)  # [slots, 2, Hkv, D]
    out = torch.zeros(n, hq, d, dtype=torch.float32, device=q.device)
    for i in range(n):
        seen = rows.slots(i, block_size)[rows.visible(i, block_size)]
        if seen.numel() == 0:
            continue
        kv = flat[seen.to(kv_cache.device)].float()  # [S, 2, Hkv, D]
        k = kv[:, 0].repeat_interleave(hq // hkv, dim=1)
        v = kv[:, 1].repeat_interleave(hq // hkv, dim=1)
        out[i] = _attend_row(q[i].float(), k, v, scale)
    return out.to(q.dtype)


def mla_rows_reference(
    q_nope: torch.Tensor,  # [N, H, R] query already in latent space (absorbed W_UK)
    q_pe: torch.Tensor,  # [N, H, P]
    cache: torch.Tensor,  # [num_blocks, block_size, R + P]
    rows: PagedRows,
    sm_scale: float,
) -> torch.Tensor:  # [N, H, R] = softmax(q_nope . latent + q_pe . k_pe) @ latent
    n, h, r = q_nope.shape
    block_size = cache.shape[1]
    flat = cache.reshape(-1, cache.shape[-1])  # [slots, R + P]
    out = torch.zeros(n, h, r, dtype=torch.float32, device=q_nope.device)
    for i in range(n):
        seen = rows.slots(i, block_size)[rows.visible(i, block_size)]
        if seen.numel() == 0:
            continue
        ent = flat[seen.to(cache.device)].float()  # [S, R + P]
        latent = ent[:, None, :r].expand(-1, h, r)
        k = torch.cat([latent, ent[:, None, r:].expand(-1, h, ent.shape[1] - r)], dim=-1)
        q = torch.cat([q_nope[i], q_pe[i]], dim=-1).float()
        out[i] = _attend_row(q, k, latent, sm_scale)
    return out.to(q_nope.dtype)
