"""Fused (QK-norm +) RoPE + paged KV-cache write, one launch per layer (see rope_cache_reference.py for the rule).

  rope_cache_gqa(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], positions [T], cos [P, D/2], sin [P, D/2],
                 kv_cache [num_blocks, block_size, 2, Hkv, D], slot_mapping [T]) -> roped q [T, Hq, D]
      optional q_norm_weight / k_norm_weight [D]: Qwen3's QK-norm before RoPE (same kernel)
  rope_cache_mla(q_pe [T, H, P], k_pe [T, P], latent [T, R], positions [T], cos [P_max, P/2], sin,
                 cache [num_blocks, block_size, R + P], slot_mapping [T]) -> roped q_pe [T, H, P]
      optional latent_norm_weight [R]: kv_a_layernorm on the latent (same kernel)
q / k / v / q_pe / k_pe / latent may be strided views (e.g. slices of one projection output; last dim contiguous).
cos / sin are per-position tables in the io dtype (e.g. RotaryEmbedding.cos_sin(arange(max_positions), dtype)),
so each token's row is what the eager model computes for its position. Slot -1 skips the cache write. The roped
query goes to `q_out=` / `q_pe_out=` (may be the input itself). No host syncs: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from specserve.kernels.checks import check_dim, check_same_device, check_tensor, require, triton_interpreting
from specserve.kernels.launch import chained

try:
    import triton

    from specserve.kernels import rope_cache_triton as _k

    HAS_TRITON = True
except ImportError:  # CPU-only installs (CI) have no triton; rope_cache_reference.py still works.
    HAS_TRITON = False

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT = (torch.int32, torch.int64)
# NO_FMA: both kernels launch with enable_fp_fusion=False. With fusion on, the sm_90 build turned
# round(x1 * cos) - round(x2 * sin) into fma.rn.bf16(x1, cos, -round(x2 * sin)), dropping the product's rounding
# that the eager model's separate torch ops do (the H200 run failed the bit-exact bf16 test by 1 ulp); with it
# off the PTX is mul.rn.bf16 / sub.rn.bf16 / add.rn.bf16, one rounding per torch op.


def _view3(name: str, x: object, dtype: torch.dtype | None, tokens: int | None, dim: int | None) -> torch.Tensor:
    t = check_tensor(name, x, 3, _DTYPES, contiguous=False)
    require(t.stride(2) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}")
    if dtype is not None:
        require(t.dtype == dtype, f"{name} has dtype {t.dtype}, expected {dtype}")
    if tokens is not None:
        check_dim(name, t, 0, tokens, "the number of tokens T")
    if dim is not None:
        check_dim(name, t, 2, dim, "the head dim")
    return t


def _check_tables(
    positions: object, cos: object, sin: object, slot_mapping: object, t: int, half: int, dtype: torch.dtype
) -> None:
    check_tensor("positions", positions, 1, _INT)
    check_dim("positions", positions, 0, t, "the number of tokens T")
    check_tensor("slot_mapping", slot_mapping, 1, _INT)
    check_dim("slot_mapping", slot_mapping, 0, t, "the number of tokens T")
    for name, tab in (("cos", cos), ("sin", sin)):
        check_tensor(name, tab, 2, (dtype,))
        check_dim(name, tab, 1, half, "rope_dim / 2")
    require(
        cos.shape == sin.shape and cos.shape[0] >= 1,
        f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} "
        "must be equal non-empty [max_positions, rope_dim / 2] tables",
    )


def _check_launch(first: torch.Tensor) -> None:
    require(HAS_TRITON, "the Triton RoPE + cache write needs the triton package, which is not installed")
    require(
        first.is_cuda or triton_interpreting(), f"the Triton RoPE + cache write needs CUDA tensors, got {first.device}"
    )


def _norm_weight(name: str, w: torch.Tensor | None, size: int, dtype: torch.dtype) -> None:
    if w is not None:
        check_tensor(name, w, 1, (dtype,))
        check_dim(name, w, 0, size, "the normalised width")


def _validate(positions: torch.Tensor, slots: torch.Tensor, max_pos: int, num_slots: int) -> None:
    """Host-side value checks (syncs: debug and test paths only)."""
    if positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        require(lo >= 0 and hi < max_pos, f"positions lie in [{lo}, {hi}], the cos/sin tables hold {max_pos}")
        lo, hi = int(slots.min()), int(slots.max())
        require(lo >= -1 and hi < num_slots, f"slot_mapping lies in [{lo}, {hi}], must be in [-1, {num_slots})")


def _q_out(name: str, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    _view3(name, out, like.dtype, like.shape[0], like.shape[2])
    check_dim(name, out, 1, like.shape[1], "the number of heads")
    return out


def rope_cache_gqa(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int32/int64
    cos: torch.Tensor,  # [max_positions, D / 2] io dtype
    sin: torch.Tensor,  # [max_positions, D / 2]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64/int32, -1 = skip
    *,
    interleaved: bool = False,
    q_norm_weight: torch.Tensor | None = None,  # [D]
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps: float = 1e-6,
    q_out: torch.Tensor | None = None,  # [T, Hq, D] (may be q)
    validate: bool = False,
) -> torch.Tensor:  # roped q [T, Hq, D]
    q = _view3("q", q, None, None, None)
    t, hq, d = q.shape
    require(d % 2 == 0, f"head dim must be even for RoPE, got {d}")
    k = _view3("k", k, q.dtype, t, d)
    v = _view3("v", v, q.dtype, t, d)
    hkv = k.shape[1]
    check_dim("v", v, 1, hkv, "the number of kv heads Hkv = k.shape[1]")
    _check_tables(positions, cos, sin, slot_mapping, t, d // 2, q.dtype)
    check_tensor("kv_cache", kv_cache, 5, _DTYPES)
    check_dim("kv_cache", kv_cache, 2, 2, "2 (K then V)")
    check_dim("kv_cache", kv_cache, 3, hkv, "the number of kv heads Hkv = k.shape[1]")
    check_dim("kv_cache", kv_cache, 4, d, "the head dim D")
    _norm_weight("q_norm_weight", q_norm_weight, d, q.dtype)
    _norm_weight("k_norm_weight", k_norm_weight, d, q.dtype)
    named = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("positions", positions),
        ("cos", cos),
        ("sin", sin),
        ("kv_cache", kv_cache),
        ("slot_mapping", slot_mapping),
    ]
    named += [(n, w) for n, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)) if w is not None]
    check_same_device(named)
    _check_launch(q)
    q_out = _q_out("q_out", q_out, q)
    if validate:
        _validate(positions, slot_mapping, cos.shape[0], kv_cache.shape[0] * kv_cache.shape[1])
    if t == 0:
        return q_out
    half = d // 2
    hq_pad, hkv_pad, half_pad = (triton.next_power_of_2(x) for x in (hq, hkv, half))
    _k.rope_cache_gqa_kernel[(t,)](
        q,
        k,
        v,
        positions,
        cos,
        sin,
        kv_cache,
        slot_mapping,
        q_out,
        q_norm_weight if q_norm_weight is not None else q,
        k_norm_weight if k_norm_weight is not None else q,
        cos.shape[0],
        float(eps),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        cos.stride(0),
        HQ=hq,
        HKV=hkv,
        HALF=half,
        HQ_PAD=hq_pad,
        HKV_PAD=hkv_pad,
        HALF_PAD=half_pad,
        INTERLEAVED=interleaved,
        Q_NORM=q_norm_weight is not None,
        K_NORM=k_norm_weight is not None,
        num_warps=1 if hq_pad * half_pad <= 256 else 4 if hq_pad * half_pad <= 4096 else 8,
        enable_fp_fusion=False,  # keep each product rounded (see NO_FMA)
        **chained(q),
    )
    return q_out


ABSORB_COLUMNS = 64  # latent columns a W_UK program computes (a [DN, 64] tile of W_UK: 16 KB at DN 128 in bf16)


def rope_cache_mla(
    q_pe: torch.Tensor,  # [T, H, P]
    k_pe: torch.Tensor,  # [T, P]
    latent: torch.Tensor,  # [T, R]
    positions: torch.Tensor,  # [T] int32/int64
    cos: torch.Tensor,  # [max_positions, P / 2] io dtype
    sin: torch.Tensor,  # [max_positions, P / 2]
    cache: torch.Tensor,  # [num_blocks, block_size, R + P]
    slot_mapping: torch.Tensor,  # [T] int64/int32, -1 = skip
    *,
    interleaved: bool = True,
    latent_norm_weight: torch.Tensor | None = None,  # [R] kv_a_layernorm
    eps: float = 1e-6,
    q_pe_out: torch.Tensor | None = None,  # [T, H, P] (may be q_pe)
    validate: bool = False,
    absorb: tuple[torch.Tensor, torch.Tensor] | None = None,  # (q_nope [T, H, DN], W_UK [H, DN, R]): also q_latent
    live_rows: torch.Tensor | None = None,  # [1] int64 (with absorb): q_latent's rows from it on are left unwritten
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # roped q_pe [T, H, P] (, q_latent [T, H, R] with absorb)
    """RoPE on q_pe and k_pe, the latent's norm and the paged cache write in one launch; with `absorb`, the same
    launch also gives the absorbed MLA's q_latent = q_nope W_UK per head (rope_cache_mla_reference's absorb). With
    live_rows, the pad rows after it (AttentionBatch.pad_rows: no keys, their outputs ignored) skip the W_UK product,
    their q_latent rows unwritten: a padded step's absorb costs its live rows only."""
    q_pe = _view3("q_pe", q_pe, None, None, None)
    t, h, p = q_pe.shape
    require(p % 2 == 0, f"rope dim must be even, got {p}")
    for name, x in (("k_pe", k_pe), ("latent", latent)):
        check_tensor(name, x, 2, (q_pe.dtype,), contiguous=False)
        require(x.stride(1) == 1, f"{name} must be contiguous in its last dim, strides {x.stride()}")
        check_dim(name, x, 0, t, "the number of tokens T")
    check_dim("k_pe", k_pe, 1, p, "the rope dim P = q_pe.shape[2]")
    r = latent.shape[1]
    _check_tables(positions, cos, sin, slot_mapping, t, p // 2, q_pe.dtype)
    check_tensor("cache", cache, 3, _DTYPES)
    check_dim("cache", cache, 2, r + p, "kv_lora_rank + rope_dim (latent.shape[1] + q_pe.shape[2])")
    _norm_weight("latent_norm_weight", latent_norm_weight, r, q_pe.dtype)
    named = [
        ("q_pe", q_pe),
        ("k_pe", k_pe),
        ("latent", latent),
        ("positions", positions),
        ("cos", cos),
        ("sin", sin),
        ("cache", cache),
        ("slot_mapping", slot_mapping),
    ]
    if latent_norm_weight is not None:
        named.append(("latent_norm_weight", latent_norm_weight))
    check_same_device(named)
    _check_launch(q_pe)
    q_pe_out = _q_out("q_pe_out", q_pe_out, q_pe)
    if validate:
        _validate(positions, slot_mapping, cos.shape[0], cache.shape[0] * cache.shape[1])
    q_nope, w_uk, q_latent, dn = latent, latent, None, 1  # unread without absorb
    if absorb is not None:
        q_nope, w_uk = absorb
        check_tensor("q_nope", q_nope, 3, (q_pe.dtype,), contiguous=False)
        check_tensor("w_uk", w_uk, 3, (q_pe.dtype,), contiguous=False)
        require(
            q_nope.stride(2) == 1 and w_uk.stride(2) == 1,
            f"q_nope and w_uk must be contiguous in their last dim, strides {q_nope.stride()}, {w_uk.stride()}",
        )
        dn = q_nope.shape[2]
        require(
            tuple(q_nope.shape[:2]) == (t, h) and tuple(w_uk.shape) == (h, dn, r),
            f"absorb needs q_nope [T, H, DN] = [{t}, {h}, DN] and w_uk [H, DN, R] = [{h}, {dn}, {r}], got "
            f"{tuple(q_nope.shape)} and {tuple(w_uk.shape)}",
        )
        check_same_device([("q_pe", q_pe), ("q_nope", q_nope), ("w_uk", w_uk)])
        q_latent = torch.empty(t, h, r, dtype=q_pe.dtype, device=q_pe.device)
        if live_rows is not None:
            check_tensor("live_rows", live_rows, 1, (torch.int64,))
            check_dim("live_rows", live_rows, 0, 1, "one count")
            check_same_device([("q_pe", q_pe), ("live_rows", live_rows)])
    if t == 0:
        return q_pe_out if absorb is None else (q_pe_out, q_latent)
    half = p // 2
    h_pad, r_pad, half_pad = (triton.next_power_of_2(x) for x in (h, r, half))
    rb = min(r_pad, ABSORB_COLUMNS)
    parts = 1 + (h * triton.cdiv(r, rb) if absorb is not None else 0)
    _k.rope_cache_mla_kernel[(t, parts)](
        q_pe,
        k_pe,
        latent,
        positions,
        cos,
        sin,
        cache,
        slot_mapping,
        q_pe_out,
        latent_norm_weight if latent_norm_weight is not None else latent,
        cos.shape[0],
        float(eps),
        q_pe.stride(0),
        q_pe.stride(1),
        k_pe.stride(0),
        latent.stride(0),
        q_pe_out.stride(0),
        q_pe_out.stride(1),
        cos.stride(0),
        H=h,
        R=r,
        HALF=half,
        H_PAD=h_pad,
        R_PAD=r_pad,
        HALF_PAD=half_pad,
        INTERLEAVED=interleaved,
        L_NORM=latent_norm_weight is not None,
        qn_ptr=q_nope,
        wuk_ptr=w_uk,
        ql_ptr=q_latent if q_latent is not None else q_pe_out,
        stride_qnt=q_nope.stride(0),
        stride_qnh=q_nope.stride(1) if absorb is not None else 0,
        stride_wh=w_uk.stride(0),
        stride_wd=w_uk.stride(1) if absorb is not None else 0,
        DN=dn,
        DN_PAD=triton.next_power_of_2(dn),
        RB=rb,
        ABSORB=absorb is not None,
        live_ptr=live_rows if live_rows is not None and absorb is not None else slot_mapping,
        HAS_LIVE=live_rows is not None and absorb is not None,
        num_warps=4 if absorb is not None or h_pad * half_pad + r_pad > 512 else 1,
        enable_fp_fusion=False,  # keep each product rounded (see NO_FMA)
        **chained(q_pe),
    )
    return q_pe_out if absorb is None else (q_pe_out, q_latent)
