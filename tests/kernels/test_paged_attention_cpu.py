"""CPU tests of the row-metadata paged attention: references against a naive loop and against the PagedBatch
references, metadata and argument checks, and (TRITON_INTERPRET=1 with triton installed) the Triton kernels
themselves through the interpreter (fp32 and fp16: triton 3.6's interpreter multiplies bf16 dots as raw bits)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from kernel_cases import paged_case, randn, run_gqa_case, run_mla_case
from kernel_test_utils import rel_err

from specserve.kernels.attention_reference import mla_attention_reference, paged_attention_reference
from specserve.kernels.checks import KernelArgumentError, triton_interpreting
from specserve.kernels.paged_attention import HAS_TRITON, num_splits_for, paged_gqa_attention, paged_mla_attention
from specserve.kernels.paged_attention_reference import gqa_rows_reference, mla_rows_reference
from specserve.kernels.paged_rows import PagedRows, allocate_rows, write_rows_

interpreted = pytest.mark.skipif(
    not (HAS_TRITON and triton_interpreting()),
    reason="needs triton and TRITON_INTERPRET=1 (runs the kernels on the CPU)",
)


def _naive_scores_rows(rows: PagedRows, block_size: int):
    """Per row: [(kv index, flat slot)] it sees, from the raw tensors (independent of PagedRows' helpers)."""
    out = []
    for i in range(rows.num_rows):
        b = int(rows.row_request[i])
        seen = []
        if b >= 0:
            start, j = int(rows.new_starts[b]), int(rows.row_index[i])
            for s in range(int(rows.kv_lens[b])):
                t = s - start
                ok = t < 0 or (bool(rows.tree_mask[i, t]) if rows.tree_mask is not None else t <= j)
                if ok:
                    seen.append(int(rows.block_tables[b, s // block_size]) * block_size + s % block_size)
        out.append(seen)
    return out


def _naive_softmax(scores: list[float], values: list[torch.Tensor], dim: int) -> torch.Tensor:
    if not scores:
        return torch.zeros(dim, dtype=torch.float64)
    top = max(scores)
    w = [math.exp(s - top) for s in scores]
    return sum(wi * v for wi, v in zip(w, values)) / sum(w)


def naive_gqa(q, cache, rows, scale):  # q [N, Hq, D], cache [nb, bs, 2, Hkv, D] -> [N, Hq, D] fp64
    n, hq, d = q.shape
    bs, hkv = cache.shape[1], cache.shape[3]
    flat = cache.double().reshape(-1, 2, hkv, d)
    out = torch.zeros(n, hq, d, dtype=torch.float64)
    for i, seen in enumerate(_naive_scores_rows(rows, bs)):
        for h in range(hq):
            kvh = h // (hq // hkv)
            scores = [float(q[i, h].double() @ flat[s, 0, kvh]) * scale for s in seen]
            out[i, h] = _naive_softmax(scores, [flat[s, 1, kvh] for s in seen], d)
    return out


def naive_mla(qn, qp, cache, rows, scale):  # -> [N, H, R] fp64
    n, h, r = qn.shape
    flat = cache.double().reshape(-1, cache.shape[-1])
    out = torch.zeros(n, h, r, dtype=torch.float64)
    for i, seen in enumerate(_naive_scores_rows(rows, cache.shape[1])):
        for hh in range(h):
            scores = [float(qn[i, hh].double() @ flat[s, :r] + qp[i, hh].double() @ flat[s, r:]) * scale for s in seen]
            out[i, hh] = _naive_softmax(scores, [flat[s, :r] for s in seen], r)
    return out


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_gqa_reference_matches_naive_loop_and_batch_reference(tree, block_size) -> None:
    gen = torch.Generator().manual_seed(block_size + int(tree))
    batch, rows, nb = paged_case([3, 1, 4], [5, 0, 9], block_size, tree, gen, "cpu", pad_rows=2, pad_requests=1)
    cache = randn((nb, block_size, 2, 2, 8), gen, "cpu", torch.float32)
    q = randn((rows.num_rows, 6, 8), gen, "cpu", torch.float32)
    ref = gqa_rows_reference(q, cache, rows, sm_scale=0.7)
    assert rel_err(ref, naive_gqa(q, cache, rows, 0.7)) < 1e-6
    n = batch.num_tokens
    assert rel_err(ref[:n], paged_attention_reference(q[:n], cache, batch, sm_scale=0.7)) < 1e-6
    assert torch.equal(ref[n:], torch.zeros_like(ref[n:]))


@pytest.mark.parametrize("tree", [False, True])
def test_mla_reference_matches_naive_loop_and_batch_reference(tree) -> None:
    gen = torch.Generator().manual_seed(40 + int(tree))
    batch, rows, nb = paged_case([1, 5], [12, 3], 4, tree, gen, "cpu", pad_rows=1)
    cache = randn((nb, 4, 16 + 8), gen, "cpu", torch.float32)
    qn = randn((rows.num_rows, 3, 16), gen, "cpu", torch.float32)
    qp = randn((rows.num_rows, 3, 8), gen, "cpu", torch.float32)
    ref = mla_rows_reference(qn, qp, cache, rows, 0.2)
    assert rel_err(ref, naive_mla(qn, qp, cache, rows, 0.2)) < 1e-6
    n = batch.num_tokens
    assert rel_err(ref[:n], mla_attention_reference(qn[:n], qp[:n], cache, batch, 0.2)) < 1e-6


def test_tree_mask_columns_past_the_new_tokens_are_ignored() -> None:
    """A True in a spare mask column (t >= new tokens of the request) must not reach past kv_len."""
    gen = torch.Generator().manual_seed(3)
    _, rows, nb = paged_case([2], [6], 4, True, gen, "cpu")
    mask = rows.tree_mask.clone()
    mask[:, 2:] = True
    wide = dataclasses.replace(rows, tree_mask=mask)
    cache = randn((nb, 4, 2, 1, 8), gen, "cpu", torch.float32)
    q = randn((2, 2, 8), gen, "cpu", torch.float32)
    assert torch.equal(gqa_rows_reference(q, cache, wide), gqa_rows_reference(q, cache, rows))


def _rows(**over) -> dict:
    base = dict(
        block_tables=torch.zeros(2, 3, dtype=torch.int32),
        kv_lens=torch.tensor([4, 1], dtype=torch.int32),
        new_starts=torch.tensor([3, 0], dtype=torch.int32),
        row_request=torch.tensor([0, 1, -1], dtype=torch.int32),
        row_index=torch.zeros(3, dtype=torch.int32),
    )
    base.update(over)
    return base


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(kv_lens=torch.tensor([4, 1])), "kv_lens has dtype"),
        (dict(kv_lens=torch.tensor([4, 1, 1], dtype=torch.int32)), "kv_lens.shape\\[0\\]"),
        (dict(row_index=torch.zeros(2, dtype=torch.int32)), "row_index.shape\\[0\\]"),
        (dict(block_tables=torch.zeros(2, 3, dtype=torch.int32).t()), "contiguous"),
        (dict(tree_mask=torch.ones(3, 2, dtype=torch.int32)), "tree_mask has dtype"),
        (dict(tree_mask=torch.ones(2, 2, dtype=torch.bool)), "tree_mask.shape\\[0\\]"),
        (dict(row_request=torch.zeros(0, dtype=torch.int32), row_index=torch.zeros(0, dtype=torch.int32)), "one row"),
    ],
)
def test_rows_reject_bad_metadata(over, match) -> None:
    with pytest.raises(KernelArgumentError, match=match):
        PagedRows(**_rows(**over))


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(kv_lens=torch.tensor([13, 1], dtype=torch.int32)), "kv_lens\\[0\\] = 13"),
        (dict(new_starts=torch.tensor([5, 0], dtype=torch.int32)), "new_starts\\[0\\] = 5"),
        (
            dict(
                block_tables=torch.tensor([[0, 9, 0], [1, 0, 0]], dtype=torch.int32),
                kv_lens=torch.tensor([5, 1], dtype=torch.int32),
            ),
            "block ids in \\[0, 9\\]",
        ),
        (dict(row_request=torch.tensor([0, 2, -1], dtype=torch.int32)), "row_request\\[1\\] = 2"),
        (dict(row_index=torch.tensor([1, 0, 0], dtype=torch.int32)), "row 0: new token 1"),
    ],
)
def test_rows_validate_catches_bad_values(over, match) -> None:
    rows = PagedRows(**_rows(**over))
    with pytest.raises(KernelArgumentError, match=match):
        rows.validate(num_blocks=8, block_size=4)
    PagedRows(**_rows()).validate(num_blocks=8, block_size=4)


def test_wrappers_reject_bad_arguments() -> None:
    rows = PagedRows(**_rows())
    cache = torch.randn(8, 4, 2, 2, 16)
    q = torch.randn(3, 4, 16)
    with pytest.raises(KernelArgumentError, match="kv_cache.shape\\[2\\]"):
        paged_gqa_attention(q, torch.randn(8, 4, 3, 2, 16), rows)
    with pytest.raises(KernelArgumentError, match="q.shape\\[2\\]"):
        paged_gqa_attention(q[..., :8], cache, rows)
    with pytest.raises(KernelArgumentError, match="q.shape\\[0\\]"):
        paged_gqa_attention(q[:2], cache, rows)
    with pytest.raises(KernelArgumentError, match="multiple of kv heads"):
        paged_gqa_attention(torch.randn(3, 3, 16), cache, rows)
    with pytest.raises(KernelArgumentError, match="dtype"):
        paged_gqa_attention(q.half(), cache, rows)
    with pytest.raises(KernelArgumentError, match="last dim"):
        paged_gqa_attention(torch.randn(3, 16, 4).transpose(1, 2), cache, rows)
    mla = torch.randn(8, 4, 24)
    with pytest.raises(KernelArgumentError, match="cache.shape\\[2\\]"):
        paged_mla_attention(torch.randn(3, 2, 16), torch.randn(3, 2, 4), mla, rows, 0.1)
    with pytest.raises(KernelArgumentError, match="q_pe.shape\\[1\\]"):
        paged_mla_attention(torch.randn(3, 2, 16), torch.randn(3, 1, 8), mla, rows, 0.1)
    if HAS_TRITON and triton_interpreting():
        with pytest.raises(KernelArgumentError, match="out has shape"):
            paged_gqa_attention(q, cache, rows, out=torch.empty(3, 4, 8))
        with pytest.raises(KernelArgumentError, match="num_splits"):
            paged_gqa_attention(q, cache, rows, num_splits=0)
        with pytest.raises(KernelArgumentError, match="workspace holds"):
            paged_gqa_attention(q, cache, rows, num_splits=2, workspace=torch.empty(5))
    else:
        with pytest.raises(KernelArgumentError, match="triton" if not HAS_TRITON else "CUDA tensors"):
            paged_gqa_attention(q, cache, rows)


def test_static_buffers_take_successive_batches() -> None:
    """write_rows_ refills buffers from allocate_rows in place; the rows then describe exactly the new batch."""
    gen = torch.Generator().manual_seed(8)
    rows = allocate_rows(num_requests=3, num_rows=9, max_blocks=6, max_new=5, device="cpu")
    ptrs = [t.data_ptr() for t in (rows.block_tables, rows.row_request, rows.tree_mask)]
    cache = randn((40, 4, 2, 2, 8), gen, "cpu", torch.float32)
    for q_lens, ctx, tree in (([2, 5], [3, 10], True), ([1, 1, 1], [0, 7, 19], False), ([4], [16], True)):
        batch, _, _ = paged_case(q_lens, ctx, 4, tree, gen, "cpu")
        write_rows_(rows, batch)
        assert [t.data_ptr() for t in (rows.block_tables, rows.row_request, rows.tree_mask)] == ptrs
        n = batch.num_tokens
        assert rows.row_request[n:].eq(-1).all()
        q = randn((9, 4, 8), gen, "cpu", torch.float32)
        assert rel_err(gqa_rows_reference(q, cache, rows)[:n], paged_attention_reference(q[:n], cache, batch)) < 1e-6
    causal = allocate_rows(2, 4, 4, None, "cpu")
    with pytest.raises(KernelArgumentError, match="buffers are causal"):
        write_rows_(causal, paged_case([2], [3], 4, True, gen, "cpu")[0])
    with pytest.raises(KernelArgumentError, match="below the batch"):
        write_rows_(causal, paged_case([5], [3], 4, False, gen, "cpu")[0])


def test_num_splits_for_static_grids() -> None:
    assert num_splits_for(100, programs=4) == 1  # short context: one pass
    assert num_splits_for(4096, programs=4) == 16  # chunks of 256
    assert num_splits_for(16384, programs=4) == 33  # fills ~132 SMs
    assert num_splits_for(16384, programs=256) == 1  # the grid is already full


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(4, 2, 16), (6, 3, 24), (2, 1, 40)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gqa_kernel_under_interpreter(dtype, shape, num_splits) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    # block_n 16 so that short contexts span several tiles and several splits
    run_gqa_case("cpu", shape, [1, 3, 2], [0, 70, 7], 5, False, dtype, num_splits, seed=shape[2], tol=tol, block_n=16)
    run_gqa_case("cpu", shape, [4, 1], [9, 50], 16, True, dtype, num_splits, seed=shape[2] + 1, tol=tol, block_n=16)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(4, 64, 16), (4, 16, 8), (17, 32, 16)])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_mla_kernel_under_interpreter(dtype, shape, num_splits) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    run_mla_case("cpu", shape, [1, 1, 1], [0, 60, 6], 16, False, dtype, num_splits, seed=shape[1], tol=tol, block_n=16)
    run_mla_case("cpu", shape, [3, 5], [40, 1], 3, True, dtype, num_splits, seed=shape[1] + 1, tol=tol, block_n=16)
