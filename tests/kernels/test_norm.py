"""GPU checks of the RMSNorm kernels (plain, fused residual add, per head) against norm_reference.

Fresh random inputs, NaN-filled output buffers, odd widths, strided views, in-place use and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_close_ulps, nan_like, norm_weight, randn
from kernel_test_utils import HAS_CUDA, poison_cuda_allocator

from specserve.kernels.norm import HAS_TRITON, fused_add_rms_norm, head_rms_norm, rms_norm
from specserve.kernels.norm_reference import fused_add_rms_norm_reference, rms_norm_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton"),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WIDTHS = [64, 200, 256, 1024, 2048, 7168]  # tiny, odd, demo hidden, mini presets, Qwen3-30B-A3B, Kimi-K2
TOKENS = [1, 3, 16, 257]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", WIDTHS)
@pytest.mark.parametrize("t", TOKENS)
def test_rms_norm_matches_reference(dtype, h, t) -> None:
    gen = torch.Generator().manual_seed(h + t)
    x = randn((t, h), gen, "cuda", dtype, scale=3.0)
    w = norm_weight(h, gen, "cuda", dtype)
    ref = rms_norm_reference(x, w, 1e-6)
    out = nan_like((t, h), "cuda", dtype)
    poison_cuda_allocator()
    assert rms_norm(x, w, 1e-6, out=out).data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    assert_close_ulps(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", WIDTHS)
@pytest.mark.parametrize("t", TOKENS)
def test_fused_add_rms_norm_matches_reference(dtype, h, t) -> None:
    gen = torch.Generator().manual_seed(7 * h + t)
    x = randn((t, h), gen, "cuda", dtype)
    res = randn((t, h), gen, "cuda", dtype, scale=4.0)
    w = norm_weight(h, gen, "cuda", dtype)
    ref, ref_res = fused_add_rms_norm_reference(x, res, w, 1e-5)
    out, res_out = nan_like((t, h), "cuda", dtype), nan_like((t, h), "cuda", dtype)
    poison_cuda_allocator()
    fused_add_rms_norm(x, res, w, 1e-5, out=out, residual_out=res_out)
    torch.cuda.synchronize()
    assert torch.equal(res_out, ref_res), "x + residual is one rounding, same as torch"
    assert_close_ulps(out, ref)


def test_fused_add_rms_norm_in_place() -> None:
    gen = torch.Generator().manual_seed(3)
    x = randn((5, 2048), gen, "cuda", torch.bfloat16)
    res = randn((5, 2048), gen, "cuda", torch.bfloat16)
    w = norm_weight(2048, gen, "cuda", torch.bfloat16)
    ref, ref_res = fused_add_rms_norm_reference(x, res, w, 1e-6)
    out, res_out = fused_add_rms_norm(x, res, w, 1e-6, out=x, residual_out=res)
    assert out.data_ptr() == x.data_ptr() and res_out.data_ptr() == res.data_ptr()
    assert torch.equal(res, ref_res)
    assert_close_ulps(x, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,d", [(4, 16), (32, 128), (4, 128), (3, 48), (16, 256)])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_head_rms_norm_on_a_qkv_slice(dtype, heads, d, n) -> None:
    """q and k as strided head views of one qkv projection output, normed into NaN buffers and in place."""
    gen = torch.Generator().manual_seed(heads * d + n)
    kv_heads = max(1, heads // 4)
    qkv = randn((n, (heads + 2 * kv_heads) * d), gen, "cuda", dtype, scale=2.0)
    q = qkv[:, : heads * d].view(n, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
    wq, wk = norm_weight(d, gen, "cuda", dtype), norm_weight(d, gen, "cuda", dtype)
    ref_q, ref_k = rms_norm_reference(q, wq, 1e-6), rms_norm_reference(k, wk, 1e-6)
    out = nan_like((n, heads, d), "cuda", dtype)
    poison_cuda_allocator()
    head_rms_norm(q, wq, 1e-6, out=out)
    torch.cuda.synchronize()
    assert_close_ulps(out, ref_q)
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    head_rms_norm(k, wk, 1e-6, out=k)
    assert_close_ulps(k, ref_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before), "in-place k norm must not touch v"


def test_norms_capture_in_a_graph() -> None:
    gen = torch.Generator().manual_seed(11)
    x = randn((4, 1024), gen, "cuda", torch.bfloat16)
    res = randn((4, 1024), gen, "cuda", torch.bfloat16)
    q = randn((4, 8, 64), gen, "cuda", torch.bfloat16)
    w, wq = norm_weight(1024, gen, "cuda", torch.bfloat16), norm_weight(64, gen, "cuda", torch.bfloat16)
    out, res_out, q_out = torch.empty_like(x), torch.empty_like(x), torch.empty_like(q)

    def step() -> None:
        fused_add_rms_norm(x, res, w, 1e-6, out=out, residual_out=res_out)
        head_rms_norm(q, wq, 1e-6, out=q_out)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        x.copy_(randn((4, 1024), gen, "cuda", torch.bfloat16))
        q.copy_(randn((4, 8, 64), gen, "cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_res = fused_add_rms_norm_reference(x, res, w, 1e-6)
        assert torch.equal(res_out, ref_res)
        assert_close_ulps(out, ref)
        assert_close_ulps(q_out, rms_norm_reference(q, wq, 1e-6))
