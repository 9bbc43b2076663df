"""The MoE's top-k sum inside the fused add + RMSNorm after it (kernels/norm.fused_add_rms_norm on a SlotRows):
the same bits as summing the slots first (sum_topk_kernel, or SlotRows.total in torch), then the add + norm.

Slots routed to NO_EXPERT hold NaN here (the MoE never writes them): the sum must not read them. Outputs start as
NaN. Runs on CUDA (bf16 included) and under TRITON_INTERPRET=1 on the CPU (fp16 and fp32: the interpreter's bf16
casts truncate, so torch's rounding of SlotRows.total would differ there)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import nan_like, norm_weight

from specserve.kernels.checks import KernelArgumentError, triton_interpreting
from specserve.kernels.fused_moe import HAS_TRITON, fused_moe, sum_slots_of
from specserve.kernels.moe_reference import NO_EXPERT, SlotRows
from specserve.kernels.norm import fused_add_rms_norm

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if ON_CUDA else [torch.float16, torch.float32]
runs_kernels = pytest.mark.skipif(
    not (HAS_TRITON and (ON_CUDA or triton_interpreting())), reason="needs triton on CUDA, or TRITON_INTERPRET=1"
)


def _slots(t: int, k: int, h: int, dtype: torch.dtype, seed: int) -> SlotRows:
    """Random fp32 slot rows; about a quarter of the slots routed to NO_EXPERT, their rows NaN."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(t * k, h, generator=gen) * 2
    ids = torch.randint(0, 16, (t * k,), generator=gen, dtype=torch.int32)
    dead = torch.rand(t * k, generator=gen) < 0.25
    ids[dead] = NO_EXPERT
    rows[dead] = float("nan")
    return SlotRows(rows.to(DEVICE), ids.to(DEVICE), k, dtype)


@pytest.mark.gpu
@runs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,h", [(1, 8, 2048), (4, 8, 2048), (17, 3, 96), (5, 1, 40)])
def test_norm_sums_the_slots_as_summing_first_would(dtype, t, k, h) -> None:
    slots = _slots(t, k, h, dtype, seed=t * 100 + k + h)
    gen = torch.Generator().manual_seed(h)
    residual = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    weight = norm_weight(h, gen, DEVICE, dtype)
    summed = slots.total()  # torch, in the kernels' order
    assert not summed.isnan().any()
    assert torch.equal(sum_slots_of(slots), summed)
    expect, expect_res = fused_add_rms_norm(summed, residual.clone(), weight, 1e-6)
    out, res_out = nan_like((t, h), DEVICE, dtype), nan_like((t, h), DEVICE, dtype)
    fused_add_rms_norm(slots, residual, weight, 1e-6, out=out, residual_out=res_out)
    assert torch.equal(res_out, expect_res)
    assert torch.equal(out, expect)


@pytest.mark.gpu
@runs_kernels
def test_fused_moe_slots_sum_to_its_output() -> None:
    """fused_moe(sum_slots=False) hands back the rows its own sum adds: the norm over them equals the norm after it."""
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(3)
    t, h, inter, e, k = 4, 64, 32, 8, 3
    x = (torch.randn(t, h, generator=gen) * 0.5).to(DEVICE, dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5).to(DEVICE, dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) * inter**-0.5).to(DEVICE, dtype)
    ids = torch.randint(0, e, (t, k), generator=gen, dtype=torch.int32)
    ids[-1] = NO_EXPERT  # a pad row
    weights = torch.rand(t, k, generator=gen)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE)
    summed = fused_moe(x, w13, w2, ids, weights, backend="triton")
    slots = fused_moe(x, w13, w2, ids, weights, backend="triton", sum_slots=False)
    assert isinstance(slots, SlotRows) and slots.k == k
    assert torch.equal(sum_slots_of(slots), summed)
    residual = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    weight = norm_weight(h, gen, DEVICE, dtype)
    expect = fused_add_rms_norm(summed, residual.clone(), weight, 1e-6)
    got = fused_add_rms_norm(slots, residual.clone(), weight, 1e-6)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])


def test_slots_that_do_not_fit_the_residual_are_refused() -> None:
    slots = SlotRows(torch.zeros(8, 16), torch.zeros(8, dtype=torch.int32), 4, torch.float32)
    w = torch.ones(16)
    with pytest.raises(KernelArgumentError, match="do not sum to residual"):
        fused_add_rms_norm(slots, torch.zeros(3, 16), w, 1e-6)
    with pytest.raises(KernelArgumentError, match="sum to torch.float32 but residual has torch.float16"):
        fused_add_rms_norm(slots, torch.zeros(2, 16, dtype=torch.float16), w.half(), 1e-6)
    bad_ids = SlotRows(torch.zeros(8, 16), torch.zeros(7, dtype=torch.int32), 4, torch.float32)
    with pytest.raises(KernelArgumentError, match="slot ids"):
        fused_add_rms_norm(bad_ids, torch.zeros(2, 16), w, 1e-6)
    half_rows = SlotRows(torch.zeros(8, 16, dtype=torch.float16), torch.zeros(8, dtype=torch.int32), 4, torch.float16)
    with pytest.raises(KernelArgumentError, match="slot rows"):
        fused_add_rms_norm(half_rows, torch.zeros(2, 16, dtype=torch.float16), w.half(), 1e-6)
