"""GPU checks of the fused MoE against moe_reference on fresh random inputs (poisoned allocator first)."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import (
    HAS_CUDA,
    poison_cuda_allocator,
    random_moe_weights,
    random_routing,
    rel_err,
)

from specserve.kernels.fused_moe import (
    HAS_TRITON,
    MoETileConfig,
    align_torch,
    align_triton,
    fused_moe,
    moe_grouped_mm,
)
from specserve.kernels.moe_reference import moe_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton"),
]

# (E, H, I, K): Qwen3-30B-A3B layer; a tiny odd shape; Kimi-K2 widths with few experts (big H and I).
SHAPES = {"qwen3_30b_a3b": (128, 2048, 768, 8), "tiny_odd": (5, 200, 56, 3), "kimi_k2_width": (12, 7168, 2048, 8)}
TOKENS = (1, 3, 4, 8, 16, 64, 257)
TOL = 1e-2


def _case(shape: str, t: int, seed: int):
    e, h, i, k = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = random_moe_weights(e, h, i, torch.bfloat16, gen, "cuda")
    x = torch.randn(t, h, generator=gen).to("cuda", torch.bfloat16)
    ids, weights = random_routing(t, e, k, gen, "cuda")
    return x, w13, w2, ids, weights


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("t", TOKENS)
def test_triton_matches_reference(shape: str, t: int) -> None:
    x, w13, w2, ids, weights = _case(shape, t, seed=1000 + t)
    ref = moe_reference(x, w13, w2, ids, weights)
    poison_cuda_allocator()
    out = fused_moe(x, w13, w2, ids, weights, backend="triton")
    torch.cuda.synchronize()
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("shape", ["qwen3_30b_a3b", "tiny_odd"])
@pytest.mark.parametrize("t", (1, 16, 257))
def test_grouped_mm_and_auto_match_reference(shape: str, t: int) -> None:
    x, w13, w2, ids, weights = _case(shape, t, seed=2000 + t)
    ref = moe_reference(x, w13, w2, ids, weights)
    poison_cuda_allocator()
    assert rel_err(moe_grouped_mm(x, w13, w2, ids, weights), ref) < TOL
    poison_cuda_allocator()
    assert rel_err(fused_moe(x, w13, w2, ids, weights), ref) < TOL


def test_int32_ids_fp16_and_bf16_weights() -> None:
    e, h, i, k = SHAPES["tiny_odd"]
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.float16, torch.bfloat16):
        w13, w2 = random_moe_weights(e, h, i, dtype, gen, "cuda")
        x = torch.randn(9, h, generator=gen).to("cuda", dtype)
        ids, weights = random_routing(9, e, k, gen, "cuda")
        ref = moe_reference(x, w13, w2, ids, weights)
        out = fused_moe(x, w13, w2, ids.int(), weights.to(dtype), backend="triton")
        assert rel_err(out, ref) < TOL


@pytest.mark.parametrize(
    "cfg",
    [
        MoETileConfig(16, 64, 64, 4, 3, 32, 64, 4, 3),
        MoETileConfig(32, 32, 128, 4, 4, 128, 64, 8, 3),
        MoETileConfig(64, 128, 64, 8, 3, 128, 64, 8, 3),
    ],
)
def test_explicit_tile_configs(cfg: MoETileConfig) -> None:
    x, w13, w2, ids, weights = _case("qwen3_30b_a3b", 24, seed=31)
    ref = moe_reference(x, w13, w2, ids, weights)
    poison_cuda_allocator()
    assert rel_err(fused_moe(x, w13, w2, ids, weights, backend="triton", config=cfg), ref) < TOL


@pytest.mark.parametrize("t", (1, 5, 64, 300))
def test_align_kernel_matches_torch_align(t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    ids, _ = random_routing(t, 128, 8, gen, "cuda")
    for bm in (16, 64):
        a_slot, a_exp, a_nb = align_torch(ids, 128, bm)
        b_slot, b_exp, b_nb = align_triton(ids, 128, bm)
        nb = int(a_nb)
        assert nb == int(b_nb)
        assert torch.equal(a_slot[: nb * bm], b_slot[: nb * bm])
        assert torch.equal(a_exp[:nb], b_exp[:nb])
        # each slot exactly once; each block holds one expert's slots
        real = a_slot[: nb * bm][a_slot[: nb * bm] < ids.numel()].long()
        assert torch.equal(real.sort().values, torch.arange(ids.numel(), device="cuda"))
        blk_of_row = torch.arange(nb * bm, device="cuda") // bm
        valid = a_slot[: nb * bm] < ids.numel()
        assert torch.equal(ids.reshape(-1)[a_slot[: nb * bm][valid].long()], a_exp[blk_of_row[valid]].long())


def test_deterministic_and_graph_capturable() -> None:
    x, w13, w2, ids, weights = _case("qwen3_30b_a3b", 4, seed=5)
    first = fused_moe(x, w13, w2, ids, weights, backend="triton")
    assert torch.equal(first, fused_moe(x, w13, w2, ids, weights, backend="triton"))
    s_x, s_ids, s_w = x.clone(), ids.clone(), weights.clone()
    fused_moe(s_x, w13, w2, s_ids, s_w, backend="triton")  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s_out = fused_moe(s_x, w13, w2, s_ids, s_w, backend="triton")
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        new_ids, new_w = random_routing(4, 128, 8, gen, "cuda")
        s_x.copy_(torch.randn(x.shape, generator=gen).to("cuda", x.dtype))
        s_ids.copy_(new_ids)
        s_w.copy_(new_w)
        graph.replay()
        assert rel_err(s_out, moe_reference(s_x, w13, w2, s_ids, s_w)) < TOL
