"""Merged projections (layers.merge_linears, GatedMLP.fuse): one GEMM computes what the separate linears did, the
old parameters become views (a checkpoint loaded afterwards still lands in the merged weight)."""

from __future__ import annotations

import pytest
import torch

from specserve.models.config import ParallelConfig
from specserve.models.layers import ColumnParallelLinear, GatedMLP, WeightShapeError, merge_linears


def _mlp(bias: bool) -> GatedMLP:
    torch.manual_seed(0)
    m = GatedMLP(16, 24, ParallelConfig(), bias=bias)
    for p in m.parameters():
        p.data.normal_()
    return m


@pytest.mark.parametrize("bias", [False, True])
def test_fused_gate_up_computes_the_two_gemms(bias):
    m = _mlp(bias)
    x = torch.randn(5, 16)
    want = m(x)
    m.fuse(True)
    assert m.gate_proj.weight.data_ptr() == m.gate_up[0].data_ptr()  # a view, no second copy
    torch.testing.assert_close(m(x), want)
    m.up_proj.weight_loader(m.up_proj.weight, torch.randn(24, 16))  # a load after fusing lands in the merged weight
    fused = m(x)
    m.fuse(False)
    torch.testing.assert_close(m(x), fused)
    assert not torch.allclose(fused, want)


def test_merge_needs_a_bias_on_all_or_none():
    a = ColumnParallelLinear(8, 4, ParallelConfig(), bias=True)
    b = ColumnParallelLinear(8, 4, ParallelConfig(), bias=False)
    with pytest.raises(WeightShapeError, match="bias on all of the linears or on none"):
        merge_linears([a, b])
