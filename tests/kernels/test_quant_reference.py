"""CPU checks of the quantized-weight references (the kernels' oracles) and of the kernel wrappers' argument checks."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from kernel_test_utils import random_routing
from quant_checkpoints import fp8_quantize  # tests/ helper: an independent block dequantization

from specserve.kernels.checks import KernelArgumentError
from specserve.kernels.moe_reference import moe_reference
from specserve.kernels.quant_moe import fp8_linear, fp8_moe, w4a16_moe
from specserve.kernels.quant_reference import (
    dequant_fp8_block,
    dequant_int4,
    fp8_linear_reference,
    fp8_moe_reference,
    pack_int4,
    unpack_int4,
    w4a16_moe_reference,
)


@pytest.mark.parametrize("cols", [8, 44, 64, 100])
def test_int4_packing_is_compressed_tensors_layout(cols):
    q = torch.randint(-8, 8, (6, cols), generator=torch.Generator().manual_seed(cols), dtype=torch.int8)
    packed = pack_to_int32(q, 4)
    assert torch.equal(pack_int4(q), packed)
    assert torch.equal(unpack_int4(packed)[:, :cols], unpack_from_int32(packed, 4, torch.Size(q.shape)))


def test_int4_dequant_uses_each_groups_scale():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (4, 96), generator=gen, dtype=torch.int8)
    scale = torch.rand(4, 3, generator=gen).to(torch.bfloat16)
    w = dequant_int4(pack_int4(q), scale, 32, 96)
    assert torch.equal(w[:, 33], q[:, 33].float() * scale[:, 1].float())
    assert torch.equal(w, q.float() * scale.float().repeat_interleave(32, dim=1))


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_block_dequant_partial_edges_and_views(scale_dtype):
    w = torch.randn(45, 70, generator=torch.Generator().manual_seed(1))
    w8, scale, deq = fp8_quantize(w, (16, 24), scale_dtype)
    assert scale.shape == (3, 3)  # 45 = 16 + 16 + 13 rows, 70 = 24 + 24 + 22 columns
    assert torch.equal(dequant_fp8_block(w8, scale, (16, 24)), deq)
    view = dequant_fp8_block(w8[20:41, 30:61], scale[1:3, 1:3], (16, 24), origin=(4, 6))  # starts mid-block
    assert torch.equal(view, deq[20:41, 30:61])
    assert (deq - w).abs().max() <= w.abs().max() / 8  # e4m3 keeps 3 mantissa bits


def test_quantized_moe_references_equal_moe_reference_on_dequantized_weights():
    gen = torch.Generator().manual_seed(2)
    e, h, i, k, t = 4, 64, 32, 2, 5
    x = torch.randn(t, h, generator=gen)
    ids, weights = random_routing(t, e, k, gen, "cpu")
    q13 = torch.randint(-8, 8, (e, 2 * i, h), generator=gen, dtype=torch.int8)
    q2 = torch.randint(-8, 8, (e, h, i), generator=gen, dtype=torch.int8)
    s13, s2 = torch.rand(e, 2 * i, h // 32, generator=gen) / 50, torch.rand(e, h, i // 32, generator=gen) / 50
    w13 = torch.stack([dequant_int4(pack_int4(q13[j]), s13[j], 32, h) for j in range(e)])
    w2 = torch.stack([dequant_int4(pack_int4(q2[j]), s2[j], 32, i) for j in range(e)])
    packed = (torch.stack([pack_int4(q) for q in q13]), s13, torch.stack([pack_int4(q) for q in q2]), s2)
    torch.testing.assert_close(
        w4a16_moe_reference(x, *packed, ids, weights, 32), moe_reference(x, w13, w2, ids, weights)
    )
    f13, f2 = (torch.randn(e, 2 * i, h, generator=gen) / 8), (torch.randn(e, h, i, generator=gen) / 8)
    quant = ([fp8_quantize(f[j], (16, 24), torch.float32) for j in range(e)] for f in (f13, f2))
    (a8, a_s, a_deq), (b8, b_s, b_deq) = ([torch.stack(p) for p in zip(*q, strict=True)] for q in quant)
    torch.testing.assert_close(
        fp8_moe_reference(x, a8, a_s, b8, b_s, ids, weights, (16, 24)), moe_reference(x, a_deq, b_deq, ids, weights)
    )
    torch.testing.assert_close(fp8_linear_reference(x, a8[0], a_s[0], (16, 24)), x @ a_deq[0].t())


def test_kernel_wrappers_name_bad_arguments():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    ids, weights = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    w13, w2 = torch.zeros(3, 64, 8, dtype=torch.int32), torch.zeros(3, 64, 4, dtype=torch.int32)
    s13, s2 = torch.zeros(3, 64, 4, dtype=torch.bfloat16), torch.zeros(3, 64, 1, dtype=torch.bfloat16)
    with pytest.raises(KernelArgumentError, match=r"w2_scale shape \(3, 64, 1\) must be \(3, 64, 2\)"):
        w4a16_moe(x, w13, s13, w2, s2, ids, weights, group_size=16)
    with pytest.raises(KernelArgumentError, match="must be multiples of group_size 64"):
        w4a16_moe(x, w13, s13, w2, s2, ids, weights, group_size=64)
    f13, f2 = torch.zeros(3, 64, 64, dtype=torch.float8_e4m3fn), torch.zeros(3, 64, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(KernelArgumentError, match=r"w2_scale_inv shape \(3, 1, 1\) must be \(3, 1, 2\)"):
        fp8_moe(x, f13, torch.ones(3, 1, 4), f2, torch.ones(3, 1, 1), ids, weights, block=(128, 16))
    with pytest.raises(KernelArgumentError, match="weight has dtype torch.bfloat16"):
        fp8_linear(x, torch.zeros(8, 64, dtype=torch.bfloat16), torch.ones(1, 1))
