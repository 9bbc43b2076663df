"""Pure-torch references for paged attention (GQA decode/verify, MLA), computed in fp32 per request.

Layouts (one layer):
  GQA cache [num_blocks, block_size, 2, n_kv_heads, head_dim]  (K and V interleaved on dim 2)
  MLA cache [num_blocks, block_size, kv_lora_rank + rope_dim]  (latent, then rope key)
"""

from __future__ import annotations

import torch

from specserve.kernels.paged_batch import PagedBatch


def _softmax_attend(
    q: torch.Tensor,  # [q, H, Dk] fp32
    k: torch.Tensor,  # [S, H, Dk] fp32
    v: torch.Tensor,  # [S, H, Dv] fp32
    mask: torch.Tensor,  # [q, S] bool
    sm_scale: float,
) -> torch.Tensor:  # [q, H, Dv]
    scores = torch.einsum("qhd,shd->hqs", q, k) * sm_scale
    scores = scores.masked_fill(~mask.to(q.device)[None], float("-inf"))
    return torch.einsum("hqs,shd->qhd", torch.softmax(scores, dim=-1), v)


def paged_attention_reference(
    q: torch.Tensor,  # [Nq, Hq, D] new tokens of all requests, in request order
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]
    batch: PagedBatch,
    sm_scale: float | None = None,
) -> torch.Tensor:  # [Nq, Hq, D]
    """GQA attention of every new token over its request's cached + allowed new tokens (decode: q_len 1)."""
    n_q, hq, d = q.shape
    hkv = kv_cache.shape[3]
    scale = d**-0.5 if sm_scale is None else sm_scale
    flat = kv_cache.reshape(-1, 2, hkv, d)  # [slots, 2, Hkv, D]
    out = torch.empty(n_q, hq, d, dtype=torch.float32, device=q.device)
    for b in range(batch.num_requests):
        s, e = int(batch.qo_indptr[b]), int(batch.qo_indptr[b + 1])
        kv = flat[batch.token_slots(b).to(kv_cache.device)].float()  # [S, 2, Hkv, D]
        k = kv[:, 0].repeat_interleave(hq // hkv, dim=1)
        v = kv[:, 1].repeat_interleave(hq // hkv, dim=1)
        out[s:e] = _softmax_attend(q[s:e].float(), k, v, batch.request_mask(b), scale)
    return out.to(q.dtype)


def mla_attention_reference(
    q_nope: torch.Tensor,  # [Nq, H, R] query already multiplied into latent space (absorbed W_UK)
    q_pe: torch.Tensor,  # [Nq, H, P] rope part of the query
    cache: torch.Tensor,  # [num_blocks, block_size, R + P]
    batch: PagedBatch,
    sm_scale: float,
) -> torch.Tensor:  # [Nq, H, R] attention-weighted latents (apply W_UV afterwards)
    """MLA in absorbed form: score = q_nope . latent + q_pe . k_rope; output = sum p * latent."""
    n_q, h, r = q_nope.shape
    flat = cache.reshape(-1, cache.shape[-1])  # [slots, R + P]
    out = torch.empty(n_q, h, r, dtype=torch.float32, device=q_nope.device)
    for b in range(batch.num_requests):
        s, e = int(batch.qo_indptr[b]), int(batch.qo_indptr[b + 1])
        ent = flat[batch.token_slots(b).to(cache.device)].float()  # [S, R + P]
        latent = ent[:, None, :r].expand(-1, h, r)
        k = torch.cat([latent, ent[:, None, r:].expand(-1, h, ent.shape[1] - r)], dim=-1)
        q = torch.cat([q_nope[s:e], q_pe[s:e]], dim=-1).float()
        out[s:e] = _softmax_attend(q, k, latent, batch.request_mask(b), sm_scale)
    return out.to(q_nope.dtype)
