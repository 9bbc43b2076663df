"""CPU tests of the RMSNorm references (naive loop; the model's RMSNorm layer bit for bit), argument checks, and
(TRITON_INTERPRET=1 with triton installed) the Triton kernels through the interpreter, bf16 included. Triton 3.6's
interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even), so there bf16 results are checked to
within ulps only; the bit-equality checks run for fp16/fp32 here and for every dtype in the GPU tests."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import assert_close_ulps, nan_like, norm_weight, randn

from specserve.kernels.checks import KernelArgumentError, triton_interpreting
from specserve.kernels.norm import HAS_TRITON, fused_add_rms_norm, head_rms_norm, rms_norm
from specserve.kernels.norm_reference import fused_add_rms_norm_reference, rms_norm_reference
from specserve.models.layers import RMSNorm


def _same(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-equal, except bf16 under the interpreter (truncating casts): within one ulp there."""
    if out.dtype == torch.bfloat16:
        assert_close_ulps(out, ref, ulps=1.0, exact_share=0.0)
    else:
        assert torch.equal(out, ref)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.bfloat16:  # two truncating casts (normed, then weight * normed)
        assert_close_ulps(out, ref, ulps=4.0, exact_share=0.0)
    else:
        assert_close_ulps(out, ref)


interpreted = pytest.mark.skipif(
    not (HAS_TRITON and triton_interpreting()),
    reason="needs triton and TRITON_INTERPRET=1 (runs the kernels on the CPU)",
)


def naive_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # fp64 [T, H]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        row = [float(v) for v in x[t]]
        scale = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
        for i, v in enumerate(row):
            out[t, i] = float(w[i]) * v * scale
    return out


def test_reference_matches_naive_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 37, generator=gen) * 3
    w = torch.randn(37, generator=gen)
    tol = dict(rtol=1e-5, atol=1e-6)
    assert torch.allclose(rms_norm_reference(x, w, 1e-5).double(), naive_rms_norm(x, w, 1e-5), **tol)
    r = torch.randn(5, 37, generator=gen)
    normed, new_res = fused_add_rms_norm_reference(x, r, w, 1e-5)
    assert torch.equal(new_res, x + r)
    assert torch.allclose(normed.double(), naive_rms_norm(x + r, w, 1e-5), **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_is_the_model_layer(dtype) -> None:
    """Bit-equal to the RMSNorm the models use (layers.RMSNorm), on [T, H] and on [N, heads, D]."""
    gen = torch.Generator().manual_seed(1)
    for shape in ((6, 96), (3, 4, 16)):
        layer = RMSNorm(shape[-1], 1e-6).to(dtype)
        layer.weight.data.copy_(norm_weight(shape[-1], gen, "cpu", dtype))
        x = randn(shape, gen, "cpu", dtype, scale=2.0)
        assert torch.equal(rms_norm_reference(x, layer.weight.data, 1e-6), layer(x))


def test_wrappers_reject_bad_arguments() -> None:
    x, w = torch.randn(3, 16), torch.randn(16)
    with pytest.raises(KernelArgumentError, match="weight.shape\\[0\\]"):
        rms_norm(x, torch.randn(8), 1e-6)
    with pytest.raises(KernelArgumentError, match="weight has dtype"):
        rms_norm(x, w.half(), 1e-6)
    with pytest.raises(KernelArgumentError, match="x must have 2 dims"):
        rms_norm(x[0], w, 1e-6)
    with pytest.raises(KernelArgumentError, match="last dim"):
        rms_norm(torch.randn(16, 3).t(), w, 1e-6)
    with pytest.raises(KernelArgumentError, match="eps"):
        rms_norm(x, w, -1.0)
    with pytest.raises(KernelArgumentError, match="residual has shape"):
        fused_add_rms_norm(x, torch.randn(2, 16), w, 1e-6)
    with pytest.raises(KernelArgumentError, match="residual has dtype"):
        fused_add_rms_norm(x, torch.randn(3, 16).half(), w, 1e-6)
    with pytest.raises(KernelArgumentError, match="x must have 3 dims"):
        head_rms_norm(x, w, 1e-6)
    with pytest.raises(KernelArgumentError, match="weight.shape\\[0\\]"):
        head_rms_norm(torch.randn(2, 3, 8), w, 1e-6)
    if HAS_TRITON and triton_interpreting():
        with pytest.raises(KernelArgumentError, match="out has shape"):
            rms_norm(x, w, 1e-6, out=torch.empty(3, 8))
        with pytest.raises(KernelArgumentError, match="different buffers"):
            buf = torch.empty(3, 16)
            fused_add_rms_norm(x, torch.randn(3, 16), w, 1e-6, out=buf, residual_out=buf)
    else:
        with pytest.raises(KernelArgumentError, match="triton" if not HAS_TRITON else "CUDA tensors"):
            rms_norm(x, w, 1e-6)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h", [16, 200, 2048])
def test_norm_kernels_under_interpreter(dtype, h) -> None:
    gen = torch.Generator().manual_seed(h)
    t = 5
    x = randn((t, h), gen, "cpu", dtype, scale=3.0)
    res = randn((t, h), gen, "cpu", dtype)
    w = norm_weight(h, gen, "cpu", dtype)
    out = nan_like((t, h), "cpu", dtype)
    rms_norm(x, w, 1e-6, out=out)
    _close(out, rms_norm_reference(x, w, 1e-6))
    ref, ref_res = fused_add_rms_norm_reference(x, res, w, 1e-6)
    out, res_out = fused_add_rms_norm(
        x, res, w, 1e-6, out=nan_like((t, h), "cpu", dtype), residual_out=nan_like((t, h), "cpu", dtype)
    )
    _same(res_out, ref_res)
    _close(out, ref)
    out, res_out = fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    _same(res_out, ref_res)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,d", [(4, 16), (3, 48), (2, 128)])
def test_head_norm_under_interpreter(dtype, heads, d) -> None:
    gen = torch.Generator().manual_seed(heads * d)
    n = 3
    qkv = randn((n, (heads + 2) * d), gen, "cpu", dtype, scale=2.0)
    q = qkv[:, : heads * d].view(n, heads, d)
    w = norm_weight(d, gen, "cpu", dtype)
    ref = rms_norm_reference(q, w, 1e-6)
    out = head_rms_norm(q, w, 1e-6, out=nan_like((n, heads, d), "cpu", dtype))
    _close(out, ref)
    tail = qkv[:, heads * d :].clone()
    head_rms_norm(q, w, 1e-6, out=q)
    _close(q, ref)
    assert torch.equal(qkv[:, heads * d :], tail)
