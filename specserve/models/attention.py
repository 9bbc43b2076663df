"""Attention over the paged cache: GQA (Llama/Qwen3/Mixtral) and MLA (DeepSeek-V3), plain torch.

Both write this step's cache entries first, then for each sequence attend over its cached context
(gathered through the block table) plus its new tokens under the causal or tree mask.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.models.attn_metadata import AttentionBatch
from specserve.models.config import GQAConfig, MLAConfig, ParallelConfig, RopeConfig
from specserve.models.kv_cache import PagedKVCache
from specserve.models.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    WeightShapeError,
    divide,
    linear,
    merge_linears,
)
from specserve.models.rope import RotaryEmbedding, softmax_scale_multiplier


def new_token_mask(attn: AttentionBatch, b: int, device: torch.device) -> torch.Tensor:
    """bool [q, ctx + q]: which keys (cached then new) each new token of sequence b may see."""
    q, ctx = attn.query_lens[b], attn.context_lens[b]
    tree = attn.tree_masks[b]
    own = tree.to(device) if tree is not None else torch.ones(q, q, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(q, ctx, dtype=torch.bool, device=device), own], dim=1)


def zero_pad_rows(out: torch.Tensor, attn: AttentionBatch) -> None:  # out [T + pad_rows, ...], in place
    """A pad row attends to nothing: its output is 0, as in the Triton paged attention (AttentionBatch.pad_rows)."""
    if attn.pad_rows:
        out[attn.num_tokens :] = 0


def sliding_window_mask(
    mask: torch.Tensor,  # [q, S]
    q_pos: torch.Tensor,  # [q]
    k_pos: torch.Tensor,  # [S]
    window: int | None,
) -> torch.Tensor:
    if window is None:
        return mask
    return mask & ((q_pos[:, None] - k_pos[None, :]) < window)


def attend(
    q: torch.Tensor,  # [q, Hq, D]
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,  # [S, Hkv, Dv]
    mask: torch.Tensor,  # [q, S] bool
    scale: float,
) -> torch.Tensor:  # [q, Hq, Dv]
    """Softmax attention; query heads are grouped onto Hq // Hkv consecutive heads per key head."""
    n_q, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(n_q, hkv, hq // hkv, d)
    scores = torch.einsum("qhgd,shd->hgqs", qg, k) * scale  # [Hkv, G, q, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.einsum("hgqs,shd->qhgd", probs, v)  # [q, Hkv, G, Dv]
    return out.reshape(n_q, hq, v.shape[-1])


def key_positions(ctx: int, new_positions: torch.Tensor) -> torch.Tensor:
    """Positions of the keys of one sequence: cached tokens 0..ctx-1, then the new tokens."""
    return torch.cat([torch.arange(ctx, device=new_positions.device), new_positions])


def kv_head_shards(num_kv_heads: int, parallel: ParallelConfig) -> tuple[int, int]:
    """(which part, how many parts) of the kv heads this rank holds.

    kv heads >= tp: split evenly. Fewer kv heads than ranks: each kv head is replicated on tp / kv
    consecutive ranks, which are exactly the ranks whose query heads read it (rank r's Hq/tp query heads
    all fall in group r * kv // tp because Hq/tp <= Hq/kv). The paged cache is sharded the same way.
    """
    tp = parallel.tp_size
    if num_kv_heads >= tp:
        divide(num_kv_heads, tp, "num_kv_heads")
        return parallel.tp_rank, tp
    if tp % num_kv_heads:
        raise WeightShapeError(f"tp_size {tp} must be a multiple of num_kv_heads {num_kv_heads} to replicate kv heads")
    return parallel.tp_rank * num_kv_heads // tp, num_kv_heads


class GQAAttention(nn.Module):
    """Cache entry per token: [2, num_kv_heads, head_dim] = (roped k, v)."""

    def __init__(
        self, cfg: GQAConfig, rope: RopeConfig, hidden: int, eps: float, layer: int, parallel: ParallelConfig
    ) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.num_heads = divide(cfg.num_heads, parallel.tp_size, "num_heads")
        kv_shards = kv_head_shards(cfg.num_kv_heads, parallel)
        self.num_kv_heads = cfg.num_kv_heads // kv_shards[1]
        d = cfg.head_dim
        self.q_proj = ColumnParallelLinear(hidden, cfg.num_heads * d, parallel, cfg.bias)
        self.k_proj = ColumnParallelLinear(hidden, cfg.num_kv_heads * d, parallel, cfg.bias, kv_shards)
        self.v_proj = ColumnParallelLinear(hidden, cfg.num_kv_heads * d, parallel, cfg.bias, kv_shards)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, hidden, parallel, cfg.bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, eps)
            self.k_norm = RMSNorm(d, eps)
        self.rotary = RotaryEmbedding(rope)
        self.scale = d**-0.5
        self.attn_backend = None  # FlashInferBackend when CausalLM.set_attention_backend installed one
        self.fused = None  # FusedRope: one q/k/v GEMM and the fused QK-norm + RoPE + cache-write kernel

    def fuse(self, rope_table: tuple[torch.Tensor, torch.Tensor] | None, skinny: torch.Tensor | None = None) -> None:
        """Fused layers on (the model's shared cos / sin tables [P, D/2], its skinny-GEMM counters) or off (None)."""
        if rope_table is None:
            self.fused = None
            return
        weight, bias = merge_linears([self.q_proj, self.k_proj, self.v_proj])
        self.fused = FusedRope(weight, bias, *rope_table, skinny)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        attn: AttentionBatch,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:  # [T, H]
        t, d = x.shape[0], self.cfg.head_dim
        if self.fused is not None and self.attn_backend is not None and kv_cache.dtype == x.dtype:
            return self._forward_fused(x, positions, attn, kv_cache)
        q = self.q_proj(x).view(t, self.num_heads, d)
        k = self.k_proj(x).view(t, self.num_kv_heads, d)
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q = RotaryEmbedding.apply(q, cos, sin, interleaved=False)
        k = RotaryEmbedding.apply(k, cos, sin, interleaved=False)
        if self.attn_backend is not None:  # fast path: writes the cache and attends (models/attn_backend.py)
            return self.o_proj(self.attn_backend.gqa(self.layer, q, k, v, attn, kv_cache).reshape(t, -1))
        kv_cache.write(self.layer, attn.slot_mapping, torch.stack([k, v], dim=1))

        out = torch.empty(t, self.num_heads, d, dtype=x.dtype, device=x.device)
        for b, (s, e) in enumerate(attn.token_ranges()):
            if s == e:
                continue
            ctx = attn.context_lens[b]
            cached = kv_cache.gather(self.layer, attn.block_tables[b], ctx).to(x.dtype)  # [ctx, 2, Hkv, D]
            keys = torch.cat([cached[:, 0], k[s:e]])
            values = torch.cat([cached[:, 1], v[s:e]])
            mask = new_token_mask(attn, b, x.device)
            mask = sliding_window_mask(
                mask, positions[s:e], key_positions(ctx, positions[s:e]), self.cfg.sliding_window
            )
            out[s:e] = attend(q[s:e], keys, values, mask, self.scale)
        zero_pad_rows(out, attn)
        return self.o_proj(out.view(t, -1))

    def _forward_fused(
        self,
        x: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        attn: AttentionBatch,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:  # [T, H]
        """One q/k/v GEMM, one kernel for QK-norm + RoPE + the cache write, then attention over the cache."""
        from specserve.kernels.rope_cache import rope_cache_gqa

        t, d, f = x.shape[0], self.cfg.head_dim, self.fused
        nq, nkv = self.num_heads * d, self.num_kv_heads * d
        qkv = linear(x, f.weight, f.bias, f.skinny)  # [T, (Hq + 2 Hkv) D]
        q = qkv[:, :nq].view(t, self.num_heads, d)
        k = qkv[:, nq : nq + nkv].view(t, self.num_kv_heads, d)
        v = qkv[:, nq + nkv :].view(t, self.num_kv_heads, d)
        norm = self.cfg.qk_norm
        q = rope_cache_gqa(
            q,
            k,
            v,
            positions,
            f.cos,
            f.sin,
            kv_cache.layers[self.layer],
            attn.slot_mapping,
            q_norm_weight=self.q_norm.weight if norm else None,
            k_norm_weight=self.k_norm.weight if norm else None,
            eps=self.q_norm.eps if norm else 1e-6,
        )  # [T, Hq, D] roped (and normed)
        return self.o_proj(self.attn_backend.gqa_cached(self.layer, q, attn, kv_cache).reshape(t, -1))


class FusedRope:
    """What a fused attention layer holds: the merged input projection and the model's cos / sin tables."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        skinny: torch.Tensor | None = None,
    ) -> None:
        self.weight = weight  # [sum of the merged projections' outputs, H]
        self.bias = bias  # [same] or None
        self.cos = cos  # [max_positions, rope_dim / 2], the io dtype
        self.sin = sin
        self.skinny = skinny  # the model's skinny-GEMM counters (layers.linear), or None: F.linear


class MLAAttention(nn.Module):
    """Cache entry per token: [kv_lora_rank + qk_rope_head_dim] = (normalised latent, roped shared key).

    Keys/values are expanded from the latents with kv_b_proj at attention time (as transformers does);
    an absorbed-weights kernel can replace `_attend_sequence` later without changing the cache layout.
    """

    def __init__(
        self, cfg: MLAConfig, rope: RopeConfig, hidden: int, eps: float, layer: int, parallel: ParallelConfig
    ) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.num_heads = divide(cfg.num_heads, parallel.tp_size, "num_heads")
        qk = cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, cfg.num_heads * qk, parallel)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, cfg.q_lora_rank, cfg.bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, cfg.num_heads * qk, parallel)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = ColumnParallelLinear(
            cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), parallel
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.v_head_dim, hidden, parallel, cfg.bias)
        self.rotary = RotaryEmbedding(rope)
        self.scale = qk**-0.5 * softmax_scale_multiplier(rope)
        self.attn_backend = None  # FlashInferBackend when CausalLM.set_attention_backend installed one
        self.fused = None  # FusedRope: q_a (or q) and kv_a in one GEMM, kv_a norm + RoPE + cache write in one kernel

    def fuse(self, rope_table: tuple[torch.Tensor, torch.Tensor] | None, skinny: torch.Tensor | None = None) -> None:
        """Fused layers on (the model's shared cos / sin tables [P, Dr/2], its skinny-GEMM counters) or off (None)."""
        if rope_table is None:
            self.fused = None
            return
        first = self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj
        weight, bias = merge_linears([first, self.kv_a_proj_with_mqa])
        self.fused = FusedRope(weight, bias, *rope_table, skinny)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        attn: AttentionBatch,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:  # [T, H]
        cfg, t = self.cfg, x.shape[0]
        if self.fused is not None and self.attn_backend is not None and kv_cache.dtype == x.dtype:
            return self._forward_fused(x, positions, attn, kv_cache)
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, cfg.qk_head_dim)
        q_nope, q_rot = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, R]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q_rot = RotaryEmbedding.apply(q_rot, cos, sin, cfg.rope_interleave)
        k_rot = RotaryEmbedding.apply(k_rot[:, None, :], cos, sin, cfg.rope_interleave)[:, 0]  # [T, Dr]
        entries = torch.cat([latent, k_rot], dim=-1)  # [T, R + Dr]
        if self.attn_backend is not None:  # fast path: absorbed MLA over the latent cache
            return self.o_proj(self._attend_absorbed(q_nope, q_rot, entries, attn, kv_cache).reshape(t, -1))
        kv_cache.write(self.layer, attn.slot_mapping, entries)
        q = torch.cat([q_nope, q_rot], dim=-1)  # [T, Hq, Dqk]

        out = torch.empty(t, self.num_heads, cfg.v_head_dim, dtype=x.dtype, device=x.device)
        for b, (s, e) in enumerate(attn.token_ranges()):
            if s == e:
                continue
            cached = kv_cache.gather(self.layer, attn.block_tables[b], attn.context_lens[b]).to(x.dtype)
            out[s:e] = self._attend_sequence(
                q[s:e], torch.cat([cached, entries[s:e]]), new_token_mask(attn, b, x.device)
            )
        zero_pad_rows(out, attn)
        return self.o_proj(out.view(t, -1))

    def _forward_fused(
        self,
        x: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        attn: AttentionBatch,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:  # [T, H]
        """One GEMM for q_a (or q) and kv_a, one kernel for the kv_a norm + RoPE + cache write, absorbed attention."""
        from specserve.kernels.rope_cache import rope_cache_mla

        cfg, t, f = self.cfg, x.shape[0], self.fused
        a = linear(x, f.weight, f.bias, f.skinny)  # [T, Q + R + Dr]
        width = a.shape[1] - cfg.kv_lora_rank - cfg.qk_rope_head_dim
        q = a[:, :width] if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(a[:, :width]))
        q = q.view(t, self.num_heads, cfg.qk_head_dim)
        q_nope, q_rot = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent = a[:, width : width + cfg.kv_lora_rank]  # [T, R] before kv_a_layernorm
        k_rot = a[:, width + cfg.kv_lora_rank :]  # [T, Dr]
        q_pe, q_latent = rope_cache_mla(
            q_rot,
            k_rot,
            latent,
            positions,
            f.cos,
            f.sin,
            kv_cache.layers[self.layer],
            attn.slot_mapping,
            interleaved=cfg.rope_interleave,
            latent_norm_weight=self.kv_a_layernorm.weight,
            eps=self.kv_a_layernorm.eps,
            absorb=(q_nope, self._absorbed_weights()[0]),  # q_nope W_UK in the same launch
            live_rows=attn.live_rows,  # pad rows (no keys, outputs ignored) skip it
        )
        return self.o_proj(
            self._attend_absorbed(q_latent, q_pe, None, attn, kv_cache, latent_query=True).reshape(t, -1)
        )

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:  # (W_UK [Hq, Dn, R], W_UV [Hq, Dv, R]) views
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)

    def _attend_absorbed(
        self,
        q_nope: torch.Tensor,  # [T, Hq, Dn]
        q_rot: torch.Tensor,  # [T, Hq, Dr]
        entries: torch.Tensor | None,  # [T, R + Dr] to write first; None: the cache already holds them
        attn: AttentionBatch,
        kv_cache: PagedKVCache,
        latent_query: bool = False,  # q_nope is already q_latent [T, Hq, R] (rope_cache_mla's absorb)
    ) -> torch.Tensor:  # [T, Hq, Dv]
        """q_nope . (W_UK latent) = (W_UK^T q_nope) . latent; output W_UV (sum p * latent): same function."""
        cfg, backend = self.cfg, self.attn_backend
        w_uk, w_uv = self._absorbed_weights()  # [Hq, Dn, R], [Hq, Dv, R]
        # per-head products as batched GEMMs over strided views (no copy of the weights or of q): [Hq, T, R]
        q_latent = q_nope if latent_query else torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        if entries is None:
            out_latent = backend.mla_cached(self.layer, q_latent, q_rot, attn, kv_cache)  # [T, Hq, R]
        else:
            out_latent = backend.mla(self.layer, q_latent, q_rot, entries, attn, kv_cache)
        out = torch.empty(
            out_latent.shape[0], self.num_heads, cfg.v_head_dim, dtype=out_latent.dtype, device=out_latent.device
        )  # [T, Hq, Dv], written head by head through its transpose
        torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return out

    def _attend_sequence(
        self,
        q: torch.Tensor,  # [q, Hq, Dqk]
        entries: torch.Tensor,  # [S, R + Dr]
        mask: torch.Tensor,  # [q, S]
    ) -> torch.Tensor:  # [q, Hq, Dv]
        cfg, s = self.cfg, entries.shape[0]
        latent, k_rot = entries.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(s, self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None, :].expand(s, self.num_heads, cfg.qk_rope_head_dim)], dim=-1)
        return attend(q, k, v, mask, self.scale)


ATTENTION_CLASSES: dict[type, type[nn.Module]] = {GQAConfig: GQAAttention, MLAConfig: MLAAttention}
