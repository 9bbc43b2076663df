"""GPU checks of the fused (QK-norm +) RoPE + paged-cache write against rope_cache_reference: q/k/v as strided views
of one projection output, NaN-filled q outputs and NaN-filled target cache slots (every other slot must stay as it
was), both RoPE layouts, bit-equal in bf16/fp16 without a norm; CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    assert_close_ulps,
    check_absorb_live_rows,
    rope_tables,
    run_rope_gqa_case,
    run_rope_mla_case,
    slots_and_positions,
)
from kernel_test_utils import HAS_CUDA

from specserve.kernels.rope_cache import HAS_TRITON, rope_cache_gqa, rope_cache_mla
from specserve.kernels.rope_cache_reference import rope_cache_gqa_reference, rope_cache_mla_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton"),
]
# (Hq, Hkv, D): tiny-qwen3-moe, mini-qwen3-moe, Qwen3-30B-A3B, odd (80), MHA 64, the EAGLE-3 / DFlash heads.
GQA_SHAPES = [(4, 2, 16), (16, 4, 128), (32, 4, 128), (12, 3, 80), (8, 8, 64), (4, 2, 64)]
# (H, R, P): the demo, tiny-kimi-k2, Kimi-K2 per GPU, 128 heads.
MLA_SHAPES = [(4, 64, 16), (4, 16, 8), (16, 512, 64), (128, 512, 64)]


@pytest.mark.parametrize("shape", GQA_SHAPES)
@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_gqa_matches_reference(shape, t, interleaved, qk_norm) -> None:
    run_rope_gqa_case("cuda", shape, t, torch.bfloat16, interleaved, qk_norm, seed=t + shape[2] + int(qk_norm))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_gqa_other_dtypes(dtype, qk_norm) -> None:
    run_rope_gqa_case("cuda", (16, 4, 128), 33, dtype, False, qk_norm, seed=5)


@pytest.mark.parametrize("shape", MLA_SHAPES)
@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("latent_norm", [False, True])
def test_mla_matches_reference(shape, t, interleaved, latent_norm) -> None:
    run_rope_mla_case("cuda", shape, t, torch.bfloat16, interleaved, latent_norm, seed=t + shape[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_mla_other_dtypes(dtype) -> None:
    run_rope_mla_case("cuda", (16, 512, 64), 20, dtype, True, True, seed=6)


def test_in_place_query_and_graph_capture() -> None:
    """q roped in place inside qkv (k, v untouched there); one capture replayed over new positions and slots."""
    hq, hkv, d, t = 8, 2, 64, 6
    gen = torch.Generator().manual_seed(12)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to("cuda", torch.bfloat16)
    q, k, v = (qkv[:, a * d : b * d].view(t, b - a, d) for a, b in ((0, hq), (hq, hq + hkv), (hq + hkv, hq + 2 * hkv)))
    cos, sin = rope_tables(512, d, torch.bfloat16, "cuda")
    cache = torch.randn(4, 16, 2, hkv, d, generator=gen).to("cuda", torch.bfloat16)
    slots, positions = slots_and_positions(t, 64, 512, gen, "cuda")
    q_in = torch.empty_like(q)

    def step() -> None:
        q.copy_(q_in)
        rope_cache_gqa(q, k, v, positions, cos, sin, cache, slots, q_out=q)

    q_in.copy_(q)
    kv_before = qkv[:, hq * d :].clone()
    step()
    torch.cuda.synchronize()
    assert torch.equal(qkv[:, hq * d :], kv_before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        new_slots, new_pos = slots_and_positions(t, 64, 512, gen, "cuda")
        slots.copy_(new_slots)
        positions.copy_(new_pos)
        q_in.copy_(torch.randn(t, hq, d, generator=gen).to("cuda", torch.bfloat16))
        ref_cache = cache.clone()
        ref_q = rope_cache_gqa_reference(q_in, k, v, positions, cos, sin, ref_cache, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(q, ref_q) and torch.equal(cache, ref_cache)


def test_mla_graph_capture() -> None:
    h, r, p, t = 4, 64, 16, 3
    gen = torch.Generator().manual_seed(13)
    q_pe = torch.randn(t, h, p, generator=gen).to("cuda", torch.bfloat16)
    kv_a = torch.randn(t, r + p, generator=gen).to("cuda", torch.bfloat16)
    w = (1 + 0.3 * torch.randn(r, generator=gen)).to("cuda", torch.bfloat16)
    cos, sin = rope_tables(256, p, torch.bfloat16, "cuda")
    cache = torch.randn(2, 16, r + p, generator=gen).to("cuda", torch.bfloat16)
    slots, positions = slots_and_positions(t, 32, 256, gen, "cuda")
    out = torch.empty_like(q_pe)
    rope_cache_mla(
        q_pe, kv_a[:, r:], kv_a[:, :r], positions, cos, sin, cache, slots, latent_norm_weight=w, q_pe_out=out
    )
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_cache_mla(
            q_pe, kv_a[:, r:], kv_a[:, :r], positions, cos, sin, cache, slots, latent_norm_weight=w, q_pe_out=out
        )
    for _ in range(3):
        new_slots, new_pos = slots_and_positions(t, 32, 256, gen, "cuda")
        slots.copy_(new_slots)
        positions.copy_(new_pos)
        kv_a.copy_(torch.randn(t, r + p, generator=gen).to("cuda", torch.bfloat16))
        ref_cache = cache.clone()
        ref_q = rope_cache_mla_reference(
            q_pe, kv_a[:, r:], kv_a[:, :r], positions, cos, sin, ref_cache, slots, latent_norm_weight=w
        )
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref_q)
        assert_close_ulps(cache, ref_cache, row_scale=True)


@pytest.mark.parametrize("t", [1, 4, 17])
def test_mla_absorbs_w_uk(t) -> None:
    """Moonlight's MLA (16 heads, latent 512, rope 64, nope 128): q_latent = q_nope W_UK in the RoPE + cache launch,
    poisoned outputs, against the float32 einsum."""
    run_rope_mla_case("cuda", (16, 512, 64), t, torch.bfloat16, True, True, seed=40 + t, absorb_dn=128)


def test_mla_absorbed_rows_do_not_depend_on_the_other_rows() -> None:
    """Row j of a 17-row call equals the same row computed in a 17-row call of copies of it (invariant steps)."""
    from specserve.kernels.rope_cache import rope_cache_mla

    gen = torch.Generator(device="cuda").manual_seed(5)
    h, r, p, dn, t = 16, 512, 64, 128, 17
    q_nope = torch.randn(t, h, dn, device="cuda", generator=gen).bfloat16()
    w_uk = (torch.randn(h, dn, r, device="cuda", generator=gen) * dn**-0.5).bfloat16()
    cos, sin = rope_tables(4096, p, torch.bfloat16, "cuda")

    def latent_of(qn):
        n = qn.shape[0]
        cache = torch.zeros(4, 16, r + p, device="cuda", dtype=torch.bfloat16)
        slots = torch.full((n,), -1, device="cuda", dtype=torch.int64)
        q_pe = torch.zeros(n, h, p, device="cuda", dtype=torch.bfloat16)
        k_pe = torch.zeros(n, p, device="cuda", dtype=torch.bfloat16)
        lat = torch.zeros(n, r, device="cuda", dtype=torch.bfloat16)
        pos = torch.zeros(n, device="cuda", dtype=torch.int64)
        return rope_cache_mla(q_pe, k_pe, lat, pos, cos, sin, cache, slots, absorb=(qn, w_uk))[1]

    full = latent_of(q_nope)
    for j in (0, 9, 16):
        assert torch.equal(full[j], latent_of(q_nope[j].expand(t, -1, -1).contiguous())[0]), j


def test_mla_absorb_skips_pad_rows() -> None:
    check_absorb_live_rows("cuda", torch.bfloat16, 16, 512, 64, 128, 17)
