"""Programmatic dependent launch (kernels/launch.py): which launches chain, and on an sm90+ GPU that a long chain of
dependent launches (each reading what the one before wrote and overwriting what it read, cuBLAS GEMMs between them)
inside a CUDA graph gives the same bits with PDL on as with it off. The negative control: a dependent launched with
PDL that does NOT wait (its PDL constexpr off) reads its input before the kernel before it wrote it."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import nan_like, norm_weight, randn
from kernel_test_utils import HAS_CUDA

from specserve.kernels.launch import PDL_ENV, chained
from specserve.kernels.norm import HAS_TRITON, fused_add_rms_norm, rms_norm

SM90 = HAS_CUDA and torch.cuda.get_device_capability()[0] >= 9
NEEDS_SM90 = pytest.mark.skipif(not (SM90 and HAS_TRITON), reason="needs an sm90+ CUDA GPU and triton")


def test_launches_chain_only_on_a_cuda_device_and_not_when_turned_off(monkeypatch):
    monkeypatch.delenv(PDL_ENV, raising=False)
    assert chained(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}
    if SM90:
        assert chained(torch.zeros(1, device="cuda")) == {"PDL": True, "launch_pdl": True}
        monkeypatch.setenv(PDL_ENV, "0")
        assert chained(torch.zeros(1, device="cuda")) == {"PDL": False, "launch_pdl": False}


def _chain(x, res, w, m, steps):  # x, res [T, H]; w [H]; m [H, H]: every launch reads the one before
    for i in range(steps):
        x, res = fused_add_rms_norm(x, res, w, 1e-6, out=x, residual_out=res)
        if i % 4 == 3:
            x = torch.matmul(x, m)  # a launch without PDL in the chain (cuBLAS)
        x = rms_norm(x, w, 1e-6, out=x)
    return x, res


@pytest.mark.gpu
@NEEDS_SM90
@pytest.mark.parametrize("t", [1, 4, 17, 300])
@pytest.mark.parametrize("h", [2048, 7168])
def test_a_chain_of_dependent_launches_gives_the_same_bits_with_pdl(t, h, monkeypatch):
    gen = torch.Generator().manual_seed(t * h)
    x0, r0 = randn((t, h), gen, "cuda", torch.bfloat16), randn((t, h), gen, "cuda", torch.bfloat16)
    w, m = norm_weight(h, gen, "cuda", torch.bfloat16), randn((h, h), gen, "cuda", torch.bfloat16, scale=h**-0.5)
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv(PDL_ENV, on)
        x, res = x0.clone(), r0.clone()
        _chain(x, res, w, m, 4)  # compile both ways, and make cuBLAS its handle, outside the capture
        x.copy_(x0), res.copy_(r0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y, res_out = _chain(x, res, w, m, 64)
        for _ in range(3):
            x.copy_(x0), res.copy_(r0)
            graph.replay()
        torch.cuda.synchronize()
        outs[on] = (y.clone(), res_out.clone())
    assert torch.equal(outs["0"][0], outs["1"][0]) and torch.equal(outs["0"][1], outs["1"][1])
    assert torch.isfinite(outs["1"][0]).all()


@pytest.mark.gpu
@NEEDS_SM90
def test_a_dependent_that_does_not_wait_reads_stale_rows(monkeypatch):
    """The control: the same two launches, the second with launch_pdl but no griddepcontrol.wait, read the first's
    output before it is written (NaN from the poisoned buffer) in some of 20 tries; with the wait, never."""
    import triton

    from specserve.kernels import norm_triton

    monkeypatch.delenv(PDL_ENV, raising=False)
    t, h = 16384, 7168  # a first launch of ~0.2 GB: long enough for an early second one to see it unwritten
    gen = torch.Generator().manual_seed(1)
    x, w = randn((t, h), gen, "cuda", torch.bfloat16), norm_weight(h, gen, "cuda", torch.bfloat16)

    def two(wait: bool) -> bool:  # whether the second launch saw an unwritten row
        mid, out = nan_like((t, h), "cuda", torch.bfloat16), nan_like((16, h), "cuda", torch.bfloat16)
        rms_norm(x, w, 1e-6, out=mid)  # PDL on: lets the next launch start at once
        norm_triton.rms_norm_kernel[(16,)](
            mid[t - 16 :],  # the last rows the first launch writes
            w,
            out,
            16,
            1e-6,
            h,
            0,
            h,
            0,
            H=h,
            HEADS=1,
            BLOCK=triton.next_power_of_2(h),
            ROWS=1,
            num_warps=8,
            PDL=wait,
            launch_pdl=True,
        )
        torch.cuda.synchronize()
        return bool(torch.isnan(out).any())

    assert not any(two(wait=True) for _ in range(20))
    assert any(two(wait=False) for _ in range(20))
