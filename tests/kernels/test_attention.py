"""GPU checks of the FlashInfer paged attention (kernels/attention.py StepAttention, the one integration serving
uses) against the pure-torch references."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import (
    HAS_CUDA,
    poison_cuda_allocator,
    random_block_tables,
    random_tree_mask,
    rel_err,
)

from specserve.kernels.attention import HAS_FLASHINFER, AttnDims, StepAttention
from specserve.kernels.attention_reference import (
    mla_attention_reference,
    paged_attention_reference,
)
from specserve.kernels.checks import KernelArgumentError
from specserve.kernels.paged_batch import PagedBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_CUDA and HAS_FLASHINFER), reason="needs a CUDA GPU and flashinfer"),
]
TOL = 1e-2
BLOCK = 16
HQ, HKV, D = 32, 4, 128  # Qwen3-30B-A3B attention
MLA_H, MLA_R, MLA_P = 16, 512, 64  # DeepSeek-V3 / Kimi-K2 latent sizes, 16 heads per GPU


def _gqa(sm_scale: float = D**-0.5) -> StepAttention:
    return StepAttention(AttnDims(False, HQ, HKV, D, 0, sm_scale, torch.bfloat16), BLOCK, "cuda")


def _batch(q_lens, ctx_lens, tree: bool, gen, num_blocks: int) -> PagedBatch:
    kv = [q + c for q, c in zip(q_lens, ctx_lens)]
    tables = random_block_tables(kv, BLOCK, num_blocks, gen)
    masks = [random_tree_mask(q, gen) for q in q_lens] if tree else None
    return PagedBatch.build(q_lens, ctx_lens, tables, BLOCK, masks)


def _gqa_cache(num_blocks: int, gen) -> torch.Tensor:
    return torch.randn(num_blocks, BLOCK, 2, HKV, D, generator=gen).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("ctx", [[0, 16, 300], [4095], [1, 2, 3, 64, 129, 1000, 31, 17]])
def test_decode_matches_reference(ctx) -> None:
    gen = torch.Generator().manual_seed(len(ctx))
    nb = sum(-(-(c + 1) // BLOCK) + 1 for c in ctx) + 3
    batch = _batch([1] * len(ctx), ctx, False, gen, nb)
    cache = _gqa_cache(nb, gen)
    q = torch.randn(len(ctx), HQ, D, generator=gen).to("cuda", torch.bfloat16)
    att = _gqa()
    att.plan(batch)
    poison_cuda_allocator()
    out = att.run_gqa(q, cache)
    torch.cuda.synchronize()
    assert rel_err(out, paged_attention_reference(q, cache, batch)) < TOL


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("q_lens,ctx", [([4], [0]), ([1, 5, 8], [7, 40, 500]), ([16, 3], [2000, 1])])
def test_verify_matches_reference(tree: bool, q_lens, ctx) -> None:
    gen = torch.Generator().manual_seed(sum(q_lens) + int(tree))
    nb = sum(-(-(c + q) // BLOCK) + 1 for c, q in zip(ctx, q_lens)) + 3
    batch = _batch(q_lens, ctx, tree, gen, nb)
    cache = _gqa_cache(nb, gen)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen).to("cuda", torch.bfloat16)
    att = _gqa(sm_scale=0.1)
    att.plan(batch)
    poison_cuda_allocator()
    out = att.run_gqa(q, cache)
    torch.cuda.synchronize()
    assert rel_err(out, paged_attention_reference(q, cache, batch, sm_scale=0.1)) < TOL


def test_tree_mask_changes_verify_output() -> None:
    """The custom mask is honoured: a chain and a star over the same tokens give different outputs."""
    gen = torch.Generator().manual_seed(3)
    q_len, ctx = 6, 40
    tables = random_block_tables([q_len + ctx], BLOCK, 8, gen)
    cache = _gqa_cache(8, gen)
    q = torch.randn(q_len, HQ, D, generator=gen).to("cuda", torch.bfloat16)
    star = torch.eye(q_len, dtype=torch.bool)
    star[:, 0] = True
    outs = []
    for mask in (None, star):
        batch = PagedBatch.build([q_len], [ctx], tables, BLOCK, [mask])
        att = _gqa()
        att.plan(batch)
        outs.append(att.run_gqa(q, cache))
        assert rel_err(outs[-1], paged_attention_reference(q, cache, batch)) < TOL
    assert rel_err(outs[0], outs[1]) > 1e-2


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("q_lens,ctx", [([1, 1, 1], [0, 33, 700]), ([4, 7], [100, 9]), ([1, 6], [2047, 64])])
def test_mla_matches_reference(tree: bool, q_lens, ctx) -> None:
    gen = torch.Generator().manual_seed(sum(ctx) + int(tree))
    nb = sum(-(-(c + q) // BLOCK) + 1 for c, q in zip(ctx, q_lens)) + 3
    batch = _batch(q_lens, ctx, tree, gen, nb)
    cache = torch.randn(nb, BLOCK, MLA_R + MLA_P, generator=gen).to("cuda", torch.bfloat16)
    n = sum(q_lens)
    q_nope = torch.randn(n, MLA_H, MLA_R, generator=gen).to("cuda", torch.bfloat16)
    q_pe = torch.randn(n, MLA_H, MLA_P, generator=gen).to("cuda", torch.bfloat16)
    scale = (128 + 64) ** -0.5
    att = StepAttention(AttnDims(True, MLA_H, 1, MLA_R, MLA_P, scale, torch.bfloat16), BLOCK, "cuda")
    att.plan(batch)
    poison_cuda_allocator()
    out = att.run_mla(q_nope, q_pe, cache)
    torch.cuda.synchronize()
    assert rel_err(out, mla_attention_reference(q_nope, q_pe, cache, batch, scale)) < TOL


def test_wrappers_reject_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(0)
    batch = _batch([1, 1], [5, 9], False, gen, 8)
    cache = _gqa_cache(8, gen)
    att = _gqa()
    q = torch.randn(2, HQ, D, generator=gen).to("cuda", torch.bfloat16)
    with pytest.raises(KernelArgumentError, match="before plan"):
        att.run_gqa(q, cache)
    att.plan(batch)
    with pytest.raises(KernelArgumentError, match="q.shape"):
        att.run_gqa(q[:1], cache)
    with pytest.raises(KernelArgumentError, match="kv_cache"):
        att.run_gqa(q, cache[:, :8].contiguous())
    att.plan(PagedBatch.build([1, 1], [5, 9], [[7], [6]], BLOCK))
    with pytest.raises(KernelArgumentError, match="out of range"):
        att.run_gqa(q, cache[:2].contiguous())
    with pytest.raises(KernelArgumentError, match="block_size"):
        att.plan(PagedBatch.build([1], [5], [[0]], 8))
    with pytest.raises(KernelArgumentError, match="dtype"):
        att.run_gqa(q.half(), cache)
