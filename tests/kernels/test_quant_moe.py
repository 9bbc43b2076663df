"""GPU checks of the W4A16 and FP8 kernels against their dequantizing torch references (fresh random inputs,
poisoned allocator first). Also runs on CPU under TRITON_INTERPRET=1 (tiny shapes only, float16: the
interpreter mishandles bf16 dots, the bf16 fused MoE included; Triton 3.6's interpreter needs numpy < 2.4).
T <= 8 runs the W4A16 MoE's per-slot GEMV path, larger T and explicit tiles its dot path."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import HAS_CUDA, poison_cuda_allocator, random_routing, rel_err

from specserve.kernels.checks import triton_interpreting
from specserve.kernels.fused_moe import HAS_TRITON, MoETileConfig
from specserve.kernels.quant_gemv import W4A16_GEMV_MAX_TOKENS, GemvTile, GemvTiles
from specserve.kernels.quant_moe import fp8_linear, fp8_moe, w4a16_moe
from specserve.kernels.quant_reference import (
    fp8_linear_reference,
    fp8_moe_reference,
    pack_int4,
    w4a16_moe_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_TRITON and (HAS_CUDA or triton_interpreting())), reason="needs a CUDA GPU and triton"),
]
DEV = "cuda" if HAS_CUDA else "cpu"
ACT = torch.bfloat16 if HAS_CUDA else torch.float16
TOL = 1e-2
TINY_ONLY = not HAS_CUDA  # the interpreter runs the tiny shapes

# (E, H, I, K): Kimi-K2 widths with few experts; Qwen3-30B-A3B; a tiny shape (odd expert count, partial blocks)
MOE_SHAPES = {"kimi_k2_width": (12, 7168, 2048, 8), "qwen3_30b_a3b": (128, 2048, 768, 8), "tiny": (5, 96, 64, 3)}
TOKENS = (1, 2, 4, 8, 16, 64, 257)
# (out, in): DeepSeek-V3 kv_a (576 x 7168: a 5 x 56 scale with partial edge blocks), q_b, o_proj; tiny
LINEAR_SHAPES = {"kv_a": (576, 7168), "q_b": (24576, 1536), "o_proj": (7168, 16384), "tiny": (40, 72)}


def _shapes(table: dict) -> list[str]:
    return ["tiny"] if TINY_ONLY else list(table)


def _tokens() -> tuple[int, ...]:
    return (1, 3, 7, 17) if TINY_ONLY else TOKENS


def _int4_case(shape: str, t: int, seed: int, group: int = 32):
    e, h, i, k = MOE_SHAPES[shape]
    gen = torch.Generator(device=DEV).manual_seed(seed)  # made on the device: Kimi-width experts are large
    q13 = torch.randint(-8, 8, (e, 2 * i, h), generator=gen, dtype=torch.int8, device=DEV)
    q2 = torch.randint(-8, 8, (e, h, i), generator=gen, dtype=torch.int8, device=DEV)
    w13 = torch.stack([pack_int4(q) for q in q13])
    w2 = torch.stack([pack_int4(q) for q in q2])
    s13 = (torch.rand(e, 2 * i, h // group, generator=gen, device=DEV) / (4 * h**0.5)).to(torch.bfloat16)
    s2 = (torch.rand(e, h, i // group, generator=gen, device=DEV) / (4 * i**0.5)).to(torch.bfloat16)
    x = torch.randn(t, h, generator=gen, device=DEV).to(ACT)
    ids, weights = random_routing(t, e, k, torch.Generator().manual_seed(seed), DEV)
    return x, w13, s13, w2, s2, ids, weights


def _fp8_case(shape: str, t: int, seed: int, block: tuple[int, int], scale_dtype=torch.float32):
    e, h, i, k = MOE_SHAPES[shape]
    bo, bi = block
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=gen, device=DEV).clamp(-4, 4).to(torch.float8_e4m3fn)
    w2 = torch.randn(e, h, i, generator=gen, device=DEV).clamp(-4, 4).to(torch.float8_e4m3fn)
    s13 = (torch.rand(e, -(-2 * i // bo), -(-h // bi), generator=gen, device=DEV) / h**0.5).to(scale_dtype)
    s2 = (torch.rand(e, -(-h // bo), -(-i // bi), generator=gen, device=DEV) / i**0.5).to(scale_dtype)
    x = torch.randn(t, h, generator=gen, device=DEV).to(ACT)
    ids, weights = random_routing(t, e, k, torch.Generator().manual_seed(seed), DEV)
    return x, w13, s13, w2, s2, ids, weights


def _sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("shape", _shapes(MOE_SHAPES))
@pytest.mark.parametrize("t", _tokens())
def test_w4a16_moe_matches_reference(shape: str, t: int) -> None:
    args = _int4_case(shape, t, seed=100 + t)
    ref = w4a16_moe_reference(*args, group_size=32)
    poison_cuda_allocator()
    out = w4a16_moe(*args, group_size=32)
    _sync()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("t", (2, 6, 12))
@pytest.mark.parametrize("zero_weights", [False, True], ids=["weighted", "ep-weight-0"])
def test_w4a16_gemv_takes_an_expert_run_longer_than_its_rows(t: int, zero_weights: bool) -> None:
    """Expert parallelism sends other ranks' choices to local expert 0 at weight 0, so one expert can hold more
    slots than there are tokens: the GEMV (T <= 8) and dot paths still match, with those slots weighted (the sum
    must count each slot) or at weight 0, as EP sends them (the GEMV skips their weights)."""
    shape = "tiny" if TINY_ONLY else "kimi_k2_width"
    x, w13, s13, w2, s2, ids, weights = _int4_case(shape, t, seed=31 + t)
    ids, weights = ids.clone(), weights.clone()
    ids[:, 1:] = 0  # every token's later choices on expert 0
    if zero_weights:
        weights[:, 1:] = 0
    ref = w4a16_moe_reference(x, w13, s13, w2, s2, ids, weights, group_size=32)
    poison_cuda_allocator()
    out = w4a16_moe(x, w13, s13, w2, s2, ids, weights, group_size=32)
    _sync()
    assert rel_err(out, ref) < TOL


def test_w4a16_group_128_and_explicit_tiles() -> None:
    cfg = (
        MoETileConfig(16, 16, 16, 4, 1, 16, 16, 4, 1) if TINY_ONLY else MoETileConfig(32, 32, 128, 4, 4, 128, 64, 8, 3)
    )
    shape = "tiny" if TINY_ONLY else "qwen3_30b_a3b"
    for group, config in ((32, cfg), (32 if TINY_ONLY else 128, None)):
        args = _int4_case(shape, 5, seed=7, group=group)
        assert (
            rel_err(w4a16_moe(*args, group_size=group, config=config), w4a16_moe_reference(*args, group_size=group))
            < TOL
        )


# The GEMV kernels' choices (GemvTile): input chunks (split), prefetch, program rows per k (lanes). At the tiny shape
# (gate/up 12 words a row, down 8) they cover whole steps, a partial last step (bkw 8 of 12) and empty chunks (split 4);
# at Kimi width (896 and 256 words) tiles of the sweep's grid, with uneven chunks (split 4 of 14 steps)
GEMV_VARIANTS = (
    {
        "split2": GemvTiles(GemvTile(16, 4, 1, 1, split=2), GemvTile(16, 4, 2, 1, split=2)),
        "split4-prefetch": GemvTiles(
            GemvTile(16, 8, 2, 1, split=4, prefetch=True), GemvTile(32, 4, 1, 1, split=4, prefetch=True)
        ),
        "prefetch-lanes": GemvTiles(
            GemvTile(16, 4, 1, 1, prefetch=True, lanes=1), GemvTile(16, 8, 4, 1, prefetch=True, lanes=8)
        ),
    }
    if TINY_ONLY
    else {
        "split2": GemvTiles(GemvTile(64, 32, 4, 1, split=2), GemvTile(32, 32, 2, 1, split=2)),
        "split4-prefetch": GemvTiles(
            GemvTile(32, 64, 4, 1, split=4, prefetch=True), GemvTile(64, 16, 2, 1, split=4, prefetch=True)
        ),
        "prefetch-lanes": GemvTiles(
            GemvTile(64, 32, 4, 1, prefetch=True, lanes=1), GemvTile(32, 32, 4, 1, prefetch=True, lanes=8)
        ),
    }
)


@pytest.mark.parametrize(
    "tiles",
    [
        GemvTiles(GemvTile(16, 64, 2, 1), GemvTile(64, 16, 8, 1)),
        GemvTiles(GemvTile(64, 32, 4, 2), GemvTile(16, 32, 4, 3)),
        GemvTiles(GemvTile(16, 8, 1, 1), GemvTile(32, 64, 4, 2)),
        *GEMV_VARIANTS.values(),
    ],
    ids=["narrow-wide", "stages", "small", *GEMV_VARIANTS],
)
def test_w4a16_gemv_with_other_tiles_matches_reference(tiles) -> None:
    """The GEMV's tiles are parameters (the sweep, bench/gemv_sweep.py, tries others): any tile gives the reference's
    function, one slot a program row (T = 3) and past W4A16_GEMV_MAX_TOKENS (program rows in turn)."""
    shape = "tiny" if TINY_ONLY else "kimi_k2_width"
    for t in (3, W4A16_GEMV_MAX_TOKENS + 1):
        args = _int4_case(shape, t, seed=40 + t)
        ref = w4a16_moe_reference(*args, group_size=32)
        poison_cuda_allocator()
        out = w4a16_moe(*args, group_size=32, gemv_max_tokens=t, gemv_tiles=tiles)
        _sync()
        assert rel_err(out, ref) < TOL, (t, tiles)


@pytest.mark.parametrize("variant", list(GEMV_VARIANTS))
def test_w4a16_gemv_variants_give_weight_0_slots_nothing(variant: str) -> None:
    """Expert parallelism's weight-0 slots on expert 0 (as above) under each GEMV choice: split chunks of a skipped
    slot are 0, not unwritten, so its act row is 0 and its down rows add 0."""
    shape = "tiny" if TINY_ONLY else "kimi_k2_width"
    x, w13, s13, w2, s2, ids, weights = _int4_case(shape, 6, seed=60)
    ids, weights = ids.clone(), weights.clone()
    ids[:, 1:], weights[:, 1:] = 0, 0
    ref = w4a16_moe_reference(x, w13, s13, w2, s2, ids, weights, group_size=32)
    poison_cuda_allocator()
    out = w4a16_moe(x, w13, s13, w2, s2, ids, weights, group_size=32, gemv_tiles=GEMV_VARIANTS[variant])
    _sync()
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("shape", _shapes(MOE_SHAPES))
@pytest.mark.parametrize("t", _tokens())
def test_fp8_moe_matches_reference(shape: str, t: int) -> None:
    block = (16, 24) if shape == "tiny" else (128, 128)
    args = _fp8_case(shape, t, seed=200 + t, block=block)
    ref = fp8_moe_reference(*args, block=block)
    poison_cuda_allocator()
    out = fp8_moe(*args, block=block)
    _sync()
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_fp8_moe_scale_dtypes(scale_dtype) -> None:
    block = (16, 24) if TINY_ONLY else (128, 128)
    args = _fp8_case("tiny", 6, seed=3, block=block, scale_dtype=scale_dtype)
    assert rel_err(fp8_moe(*args, block=block), fp8_moe_reference(*args, block=block)) < TOL


@pytest.mark.parametrize("shape", _shapes(LINEAR_SHAPES))
@pytest.mark.parametrize("t", _tokens())
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fp8_linear_matches_reference(shape: str, t: int, scale_dtype) -> None:
    n, k = LINEAR_SHAPES[shape]
    block = (16, 24) if shape == "tiny" else (128, 128)
    gen = torch.Generator().manual_seed(300 + t)
    w = torch.randn(n, k, generator=gen).clamp(-4, 4).to(DEV, torch.float8_e4m3fn)
    s = (torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) / k**0.5).to(DEV, scale_dtype)
    x = torch.randn(t, k, generator=gen).to(DEV, ACT)
    ref = fp8_linear_reference(x, w, s, block)
    poison_cuda_allocator()
    out = fp8_linear(x, w, s, block)
    _sync()
    assert out.shape == (t, n) and rel_err(out, ref) < TOL
