"""GPU checks of the one-kernel MoE router against router_reference: ids equal (same order) on tie-free random
logits, weights within fp32 rounding; poisoned output buffers; the routers of Qwen3-MoE, Mixtral, DeepSeek-V3,
Kimi-K2, the demo and odd sizes; CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import ROUTERS, router_case
from kernel_test_utils import HAS_CUDA, poison_cuda_allocator

from specserve.kernels.router import HAS_TRITON, route
from specserve.kernels.router_reference import RouterConfig, router_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton"),
]


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("t", [1, 5, 64, 257])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_matches_reference(name, t, dtype) -> None:
    cfg, with_bias = ROUTERS[name]
    gen = torch.Generator().manual_seed(t + len(name))
    logits, bias = router_case(t, cfg, with_bias, dtype, gen, "cuda")
    ref_ids, ref_w = router_reference(logits, cfg, bias)
    ids = torch.full((t, cfg.top_k), -7, dtype=torch.int32, device="cuda")
    weights = torch.full((t, cfg.top_k), float("nan"), device="cuda")
    poison_cuda_allocator()
    out_ids, out_w = route(logits, cfg, bias, topk_ids=ids, topk_weights=weights)
    torch.cuda.synchronize()
    assert out_ids.data_ptr() == ids.data_ptr() and out_w.data_ptr() == weights.data_ptr()
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=2e-6, atol=1e-7)


def test_router_strided_logits_and_bf16_bias() -> None:
    """Logits as a column slice of a wider GEMM output; a bf16 correction bias."""
    cfg = RouterConfig(256, 8, "sigmoid", 8, 4, True, 2.5)
    gen = torch.Generator().manual_seed(4)
    logits, bias = router_case(9, cfg, True, torch.float32, gen, "cpu")
    bias = bias.to(torch.bfloat16)
    wide = torch.randn(9, 300, generator=gen)
    wide[:, 20:276] = logits
    view = wide.cuda()[:, 20:276]
    ref_ids, ref_w = router_reference(view, cfg, bias.cuda())
    ids, w = route(view, cfg, bias.cuda())
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-7)


def test_router_in_a_cuda_graph() -> None:
    cfg, _ = ROUTERS["deepseek_v3"]
    gen = torch.Generator().manual_seed(8)
    logits, bias = router_case(4, cfg, True, torch.bfloat16, gen, "cuda")
    ids = torch.empty(4, 8, dtype=torch.int32, device="cuda")
    w = torch.empty(4, 8, device="cuda")
    route(logits, cfg, bias, topk_ids=ids, topk_weights=w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        route(logits, cfg, bias, topk_ids=ids, topk_weights=w)
    for _ in range(3):
        new, _ = router_case(4, cfg, True, torch.bfloat16, gen, "cuda", bias=bias)
        logits.copy_(new)
        ids.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        ref_ids, ref_w = router_reference(logits, cfg, bias)
        assert torch.equal(ids.long(), ref_ids)
        torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-7)
