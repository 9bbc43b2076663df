"""Random cases shared by the new kernels' GPU, interpreter and CPU tests (paged attention rows, norms, routers)."""

from __future__ import annotations

import dataclasses

import torch
from kernel_test_utils import poison_cuda_allocator, random_block_tables, random_tree_mask, rel_err

from specserve.kernels.attention_reference import mla_attention_reference, paged_attention_reference
from specserve.kernels.paged_attention import paged_gqa_attention, paged_mla_attention
from specserve.kernels.paged_attention_reference import gqa_rows_reference, mla_rows_reference
from specserve.kernels.paged_batch import PagedBatch
from specserve.kernels.paged_rows import PagedRows


def paged_case(
    q_lens: list[int],
    ctx_lens: list[int],
    block_size: int,
    tree: bool,
    gen: torch.Generator,
    device: str,
    pad_rows: int = 0,
    pad_requests: int = 0,
    max_blocks: int | None = None,
    max_new: int | None = None,
) -> tuple[PagedBatch, PagedRows, int]:
    """(host PagedBatch, padded device PagedRows, num_blocks). Padding rows/requests come after the real ones;
    max_blocks defaults to two spare table entries, max_new to one spare tree-mask column."""
    kv = [q + c for q, c in zip(q_lens, ctx_lens)]
    num_blocks = sum(-(-n // block_size) + 1 for n in kv) + 3
    tables = random_block_tables(kv, block_size, num_blocks, gen)
    masks = [random_tree_mask(q, gen) for q in q_lens] if tree else None
    batch = PagedBatch.build(q_lens, ctx_lens, tables, block_size, masks)
    rows = PagedRows.from_batch(batch, device, num_rows=batch.num_tokens + pad_rows,
                                num_requests=batch.num_requests + pad_requests,
                                max_blocks=max_blocks or max(len(t) for t in tables) + 2,
                                max_new=max_new or max(q_lens) + 1)
    return batch, rows, num_blocks


def randn(shape: tuple[int, ...], gen: torch.Generator, device: str, dtype: torch.dtype,
          scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def nan_like(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> torch.Tensor:
    """A NaN-filled output buffer: any element a kernel forgets to write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def padded_rows(rows, pad_request: int):
    """Point the first padding row at an unused request (kv_len 0): the other padding form."""
    req = rows.row_request.clone()
    pads = (req < 0).nonzero()
    if len(pads):
        req[int(pads[0])] = pad_request
    return dataclasses.replace(rows, row_request=req)


def run_gqa_case(device, shape, q_lens, ctx, block_size, tree, dtype, num_splits, seed, tol=1e-2, block_n=None):
    """One GQA kernel call on NaN-filled out/workspace buffers against both references."""
    hq, hkv, d = shape
    gen = torch.Generator().manual_seed(seed)
    batch, rows, nb = paged_case(q_lens, ctx, block_size, tree, gen, device, pad_rows=2, pad_requests=1)
    rows = padded_rows(rows, batch.num_requests)
    cache = randn((nb, block_size, 2, hkv, d), gen, device, dtype)
    q = randn((rows.num_rows, hq, d), gen, device, dtype)
    ref = gqa_rows_reference(q, cache, rows, sm_scale=0.3)
    n = batch.num_tokens
    assert rel_err(ref[:n], paged_attention_reference(q[:n], cache, batch, sm_scale=0.3)) < 1e-2
    out = nan_like((rows.num_rows, hq, d), device, dtype)
    ws = nan_like((rows.num_rows * hq * num_splits * (d + 2),), device, torch.float32)
    poison_cuda_allocator()
    got = paged_gqa_attention(q, cache, rows, 0.3, out=out, num_splits=num_splits, workspace=ws, validate=True,
                              block_n=block_n)
    sync(device)
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(out[:n], ref[:n]) < tol
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be zeros"


def run_mla_case(device, shape, q_lens, ctx, block_size, tree, dtype, num_splits, seed, tol=1e-2, block_n=None):
    """One MLA kernel call on NaN-filled out/workspace buffers against both references."""
    h, r, p = shape
    gen = torch.Generator().manual_seed(seed)
    batch, rows, nb = paged_case(q_lens, ctx, block_size, tree, gen, device, pad_rows=1, pad_requests=1)
    rows = padded_rows(rows, batch.num_requests)
    cache = randn((nb, block_size, r + p), gen, device, dtype)
    qn = randn((rows.num_rows, h, r), gen, device, dtype)
    qp = randn((rows.num_rows, h, p), gen, device, dtype)
    scale = (r // 4 + p) ** -0.5
    ref = mla_rows_reference(qn, qp, cache, rows, scale)
    n = batch.num_tokens
    assert rel_err(ref[:n], mla_attention_reference(qn[:n], qp[:n], cache, batch, scale)) < 1e-2
    out = nan_like((rows.num_rows, h, r), device, dtype)
    ws = nan_like((rows.num_rows * h * num_splits * (r + 2),), device, torch.float32)
    poison_cuda_allocator()
    paged_mla_attention(qn, qp, cache, rows, scale, out=out, num_splits=num_splits, workspace=ws, validate=True,
                        block_n=block_n)
    sync(device)
    assert rel_err(out[:n], ref[:n]) < tol
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be zeros"




ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}


def assert_close_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: float = 2.0, exact_share: float = 0.98) -> None:
    """Within `ulps` units in the last place of the io dtype everywhere, and bit-equal in most elements
    (bf16/fp16: the kernels round the same fp32 values as torch; only rsqrt and sum order differ). NaN fails."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    o, r = out.double(), ref.double()
    bound = ulps * ULP[ref.dtype] * (r.abs() + 1e-3)
    assert bool(((o - r).abs() <= bound).all()), f"max diff {float((o - r).abs().max())}"
    if ref.dtype != torch.float32:
        share = float((o == r).double().mean())
        assert share >= exact_share, f"only {share:.4f} of elements bit-equal"


def norm_weight(h: int, gen: torch.Generator, device: str, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + 0.3 * torch.randn(h, generator=gen)).to(device=device, dtype=dtype)
