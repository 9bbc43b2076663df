"""CPU tests of the RoPE + cache-write references (against the model's own RotaryEmbedding, RMSNorm and
PagedKVCache steps, and a naive loop), argument checks, and (TRITON_INTERPRET=1 with triton installed) the Triton
kernels through the interpreter (bf16 loosely: triton 3.6's interpreter truncates fp32 -> bf16 casts)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import (
    check_absorb_live_rows,
    norm_weight,
    randn,
    rope_tables,
    run_rope_gqa_case,
    run_rope_mla_case,
    slots_and_positions,
)

from specserve.kernels.checks import KernelArgumentError, triton_interpreting
from specserve.kernels.rope_cache import HAS_TRITON, rope_cache_gqa, rope_cache_mla
from specserve.kernels.rope_cache_reference import (
    rope_cache_gqa_reference,
    rope_cache_mla_reference,
    rope_reference,
)
from specserve.models.config import RopeConfig
from specserve.models.kv_cache import PagedKVCache
from specserve.models.layers import RMSNorm
from specserve.models.rope import RotaryEmbedding

interpreted = pytest.mark.skipif(
    not (HAS_TRITON and triton_interpreting()),
    reason="needs triton and TRITON_INTERPRET=1 (runs the kernels on the CPU)",
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gqa_reference_is_the_model_path(dtype, interleaved) -> None:
    """QK-norm, RotaryEmbedding.cos_sin(positions) + apply, PagedKVCache.write, as GQAAttention runs them; the
    cos/sin table rows gathered by position equal cos_sin of those positions bit for bit."""
    t, hq, hkv, d, bs = 6, 4, 2, 16, 4
    gen = torch.Generator().manual_seed(int(interleaved))
    rot = RotaryEmbedding(RopeConfig(rope_type="default", theta=1e6, dim=d))
    cos_t, sin_t = rot.cos_sin(torch.arange(128), dtype)
    q, k, v = (randn((t, h, d), gen, "cpu", dtype) for h in (hq, hkv, hkv))
    q_norm, k_norm = RMSNorm(d, 1e-6).to(dtype), RMSNorm(d, 1e-6).to(dtype)
    q_norm.weight.data.copy_(norm_weight(d, gen, "cpu", dtype))
    k_norm.weight.data.copy_(norm_weight(d, gen, "cpu", dtype))
    slots, positions = slots_and_positions(t, 16, 128, gen, "cpu")
    model_cache = PagedKVCache(1, 4, bs, (2, hkv, d), dtype, "cpu")
    cos, sin = rot.cos_sin(positions, dtype)
    assert torch.equal(cos, cos_t[positions]) and torch.equal(sin, sin_t[positions])
    qm = RotaryEmbedding.apply(q_norm(q), cos, sin, interleaved)
    km = RotaryEmbedding.apply(k_norm(k), cos, sin, interleaved)
    model_cache.write(0, slots, torch.stack([km, v], dim=1))
    cache = torch.zeros(4, bs, 2, hkv, d, dtype=dtype)
    q_ref = rope_cache_gqa_reference(
        q, k, v, positions, cos_t, sin_t, cache, slots, interleaved, q_norm.weight.data, k_norm.weight.data, 1e-6
    )
    assert torch.equal(q_ref, qm)
    assert torch.equal(cache, model_cache.layers[0])


def test_mla_reference_is_the_model_path() -> None:
    """kv_a_layernorm on the latent, interleaved RoPE on q_pe and the shared k_pe, entries = [latent, k_rot]."""
    t, h, r, p, dtype = 5, 4, 16, 8, torch.bfloat16
    gen = torch.Generator().manual_seed(2)
    rot = RotaryEmbedding(RopeConfig(rope_type="default", theta=1e4, dim=p))
    cos_t, sin_t = rot.cos_sin(torch.arange(64), dtype)
    q_pe = randn((t, h, p), gen, "cpu", dtype)
    kv_a = randn((t, r + p), gen, "cpu", dtype)
    norm = RMSNorm(r, 1e-6).to(dtype)
    norm.weight.data.copy_(norm_weight(r, gen, "cpu", dtype))
    slots, positions = slots_and_positions(t, 16, 64, gen, "cpu")
    latent, k_rot = kv_a.split([r, p], dim=-1)
    cos, sin = rot.cos_sin(positions, dtype)
    q_model = RotaryEmbedding.apply(q_pe, cos, sin, True)
    k_model = RotaryEmbedding.apply(k_rot[:, None, :], cos, sin, True)[:, 0]
    model_cache = PagedKVCache(1, 4, 4, (r + p,), dtype, "cpu")
    model_cache.write(0, slots, torch.cat([norm(latent), k_model], dim=-1))
    cache = torch.zeros(4, 4, r + p, dtype=dtype)
    q_ref = rope_cache_mla_reference(
        q_pe, kv_a[:, r:], kv_a[:, :r], positions, cos_t, sin_t, cache, slots, True, norm.weight.data, 1e-6
    )
    assert torch.equal(q_ref, q_model)
    assert torch.equal(cache, model_cache.layers[0])


def test_rope_reference_matches_naive_rotation() -> None:
    """Pair (x[a], x[b]) rotated by angle pos * theta^(-2i/D): neox pairs (i, D/2 + i), interleaved (2i, 2i + 1),
    output laid out [rotated firsts, rotated seconds] in both."""
    t, h, d = 3, 2, 8
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(t, h, d, generator=gen, dtype=torch.float64)
    pos = [0, 5, 17]
    ang = [[p * 10000.0 ** (-2 * i / d) for i in range(d // 2)] for p in pos]
    cos = torch.tensor([[math.cos(a) for a in row] for row in ang], dtype=torch.float64)
    sin = torch.tensor([[math.sin(a) for a in row] for row in ang], dtype=torch.float64)
    for interleaved in (False, True):
        out = rope_reference(x, cos, sin, interleaved)
        for ti in range(t):
            for hi in range(h):
                for i in range(d // 2):
                    a, b = (2 * i, 2 * i + 1) if interleaved else (i, d // 2 + i)
                    xa, xb = float(x[ti, hi, a]), float(x[ti, hi, b])
                    c, s = math.cos(ang[ti][i]), math.sin(ang[ti][i])
                    assert math.isclose(float(out[ti, hi, i]), xa * c - xb * s, abs_tol=1e-12)
                    assert math.isclose(float(out[ti, hi, d // 2 + i]), xb * c + xa * s, abs_tol=1e-12)


def test_wrappers_reject_bad_arguments() -> None:
    t, d = 3, 16
    q, k, v = torch.randn(t, 4, d), torch.randn(t, 2, d), torch.randn(t, 2, d)
    cos, sin = rope_tables(32, d, torch.float32, "cpu")
    pos, slots = torch.arange(t), torch.arange(t)
    cache = torch.zeros(2, 4, 2, 2, d)
    with pytest.raises(KernelArgumentError, match="k.shape\\[2\\]"):
        rope_cache_gqa(q, k[..., :8], v, pos, cos, sin, cache, slots)
    with pytest.raises(KernelArgumentError, match="v.shape\\[1\\]"):
        rope_cache_gqa(q, k, torch.randn(t, 1, d), pos, cos, sin, cache, slots)
    with pytest.raises(KernelArgumentError, match="cos.shape\\[1\\]"):
        rope_cache_gqa(q, k, v, pos, *rope_tables(32, 8, torch.float32, "cpu"), cache, slots)
    with pytest.raises(KernelArgumentError, match="positions has dtype"):
        rope_cache_gqa(q, k, v, pos.float(), cos, sin, cache, slots)
    with pytest.raises(KernelArgumentError, match="kv_cache.shape\\[3\\]"):
        rope_cache_gqa(q, k, v, pos, cos, sin, torch.zeros(2, 4, 2, 4, d), slots)
    with pytest.raises(KernelArgumentError, match="head dim must be even"):
        rope_cache_gqa(torch.randn(t, 4, 5), torch.randn(t, 2, 5), torch.randn(t, 2, 5), pos, cos, sin, cache, slots)
    with pytest.raises(KernelArgumentError, match="q_norm_weight.shape\\[0\\]"):
        rope_cache_gqa(q, k, v, pos, cos, sin, cache, slots, q_norm_weight=torch.ones(8))
    with pytest.raises(KernelArgumentError, match="k has dtype"):
        rope_cache_gqa(q, k.half(), v, pos, cos, sin, cache, slots)
    mla_cache = torch.zeros(2, 4, 24)
    with pytest.raises(KernelArgumentError, match="cache.shape\\[2\\]"):
        rope_cache_mla(
            torch.randn(t, 4, 8),
            torch.randn(t, 8),
            torch.randn(t, 8),
            pos,
            *rope_tables(32, 8, torch.float32, "cpu"),
            mla_cache,
            slots,
        )
    with pytest.raises(KernelArgumentError, match="k_pe.shape\\[1\\]"):
        rope_cache_mla(
            torch.randn(t, 4, 8),
            torch.randn(t, 6),
            torch.randn(t, 16),
            pos,
            *rope_tables(32, 8, torch.float32, "cpu"),
            mla_cache,
            slots,
        )
    if HAS_TRITON and triton_interpreting():
        with pytest.raises(KernelArgumentError, match="positions lie in"):
            rope_cache_gqa(q, k, v, pos + 30, cos, sin, cache, slots, validate=True)
        with pytest.raises(KernelArgumentError, match="slot_mapping lies in"):
            rope_cache_gqa(q, k, v, pos, cos, sin, cache, slots + 20, validate=True)
    else:
        with pytest.raises(KernelArgumentError, match="triton" if not HAS_TRITON else "CUDA tensors"):
            rope_cache_gqa(q, k, v, pos, cos, sin, cache, slots)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 2, 16), (12, 3, 80), (2, 2, 128)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gqa_kernel_under_interpreter(dtype, shape, interleaved) -> None:
    for qk_norm in (False, True):
        run_rope_gqa_case(
            "cpu", shape, 5, dtype, interleaved, qk_norm, seed=shape[2] + int(qk_norm), loose=dtype == torch.bfloat16
        )


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 64, 16), (4, 16, 8), (3, 512, 64)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_mla_kernel_under_interpreter(dtype, shape, interleaved) -> None:
    for latent_norm in (False, True):
        run_rope_mla_case(
            "cpu",
            shape,
            5,
            dtype,
            interleaved,
            latent_norm,
            seed=shape[1] + int(latent_norm),
            loose=dtype == torch.bfloat16,
        )


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_mla_kernel_absorbs_w_uk_under_interpreter(dtype) -> None:
    """The same launch gives q_latent = q_nope W_UK per head (strided views of the query and of kv_b); a row's
    q_latent does not depend on the other rows; negative control: W_UK of the next head does not match."""
    q_latent, (q_nope, w_uk) = run_rope_mla_case("cpu", (3, 80, 16), 5, dtype, True, True, seed=11, absorb_dn=24)
    alone = run_rope_mla_case("cpu", (3, 80, 16), 5, dtype, True, True, seed=11, absorb_dn=24)[0]
    assert torch.equal(alone, q_latent)
    wrong = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk.roll(1, 0).float())
    assert not torch.allclose(q_latent.float(), wrong, rtol=1e-2, atol=1e-2)


@interpreted
def test_mla_absorb_skips_pad_rows_under_interpreter() -> None:
    check_absorb_live_rows("cpu", torch.float16, 3, 80, 16, 24, 6)
