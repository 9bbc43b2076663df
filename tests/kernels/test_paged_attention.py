"""GPU checks of the Triton row-metadata paged attention (GQA and MLA) against the torch references.

Fresh random inputs (never zeros), NaN-filled `out` and workspace buffers, odd head sizes, block sizes, padding
rows and requests, tree masks, split-kv, strided q, and a CUDA-graph capture replayed over new metadata.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_cases import nan_like, paged_case, randn, run_gqa_case, run_mla_case
from kernel_test_utils import HAS_CUDA, rel_err

from specserve.kernels.paged_attention import HAS_TRITON, paged_gqa_attention, paged_mla_attention
from specserve.kernels.paged_attention_reference import gqa_rows_reference, mla_rows_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton"),
]
TOL = 1e-2
# (Hq, Hkv, D): tiny-qwen3-moe, mini presets' narrow heads, Qwen3-30B-A3B, odd dims (80, 96), MHA, MQA 256.
GQA_SHAPES = [(4, 2, 16), (8, 8, 32), (16, 4, 64), (32, 4, 128), (12, 3, 80), (6, 2, 96), (8, 1, 256)]
# (H, R, P): the demo (kv_lora 64, rope 16), tiny-kimi-k2 (16, 8), Kimi-K2 per GPU (512, 64), 128 heads.
MLA_SHAPES = [(4, 64, 16), (4, 16, 8), (16, 512, 64), (128, 512, 64)]
CASES = [  # (q_lens, ctx_lens): decode, chain/tree verify, a long context
    ([1], [0]),
    ([1, 1, 1, 1], [3, 16, 100, 1000]),
    ([4, 1, 7], [0, 33, 250]),
    ([16], [2047]),
]


@pytest.mark.parametrize("shape", GQA_SHAPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gqa_matches_reference(shape, case) -> None:
    q_lens, ctx = CASES[case]
    run_gqa_case("cuda", shape, q_lens, ctx, 16, False, torch.bfloat16, 1, seed=100 * case + shape[2])


@pytest.mark.parametrize("block_size", [1, 5, 16, 64])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("tree", [False, True])
def test_gqa_blocks_splits_trees(block_size, num_splits, tree) -> None:
    run_gqa_case(
        "cuda",
        (12, 3, 80),
        [5, 1, 9],
        [40, 0, 300],
        block_size,
        tree,
        torch.bfloat16,
        num_splits,
        seed=block_size * 10 + num_splits + int(tree),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gqa_other_dtypes(dtype) -> None:
    run_gqa_case("cuda", (16, 4, 64), [3, 2], [17, 64], 16, True, dtype, 2, seed=5)


def test_gqa_strided_query_and_tree_changes_output() -> None:
    """q as a head view of a wider qkv buffer; a star tree gives another output than the causal chain."""
    gen = torch.Generator().manual_seed(9)
    hq, hkv, d = 8, 2, 32
    batch, rows, nb = paged_case([6], [40], 16, False, gen, "cuda")
    cache = randn((nb, 16, 2, hkv, d), gen, "cuda", torch.bfloat16)
    qkv = randn((6, (hq + 2 * hkv) * d), gen, "cuda", torch.bfloat16)
    q = qkv[:, : hq * d].view(6, hq, d)
    causal = paged_gqa_attention(q, cache, rows, out=nan_like((6, hq, d), "cuda", torch.bfloat16))
    assert rel_err(causal, gqa_rows_reference(q, cache, rows)) < TOL
    star = torch.zeros(6, 6, dtype=torch.bool)
    star[:, 0] = True
    star[torch.arange(6), torch.arange(6)] = True
    tree_rows = dataclasses.replace(rows, tree_mask=star.cuda())
    tree_out = paged_gqa_attention(q, cache, tree_rows)
    assert rel_err(tree_out, gqa_rows_reference(q, cache, tree_rows)) < TOL
    assert rel_err(tree_out, causal) > 1e-2


@pytest.mark.parametrize("shape", MLA_SHAPES)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("tree", [False, True])
def test_mla_matches_reference(shape, case, tree) -> None:
    q_lens, ctx = CASES[case]
    run_mla_case("cuda", shape, q_lens, ctx, 16, tree, torch.bfloat16, 1, seed=10 * case + shape[0] + int(tree))


@pytest.mark.parametrize("block_size", [1, 5, 64])
@pytest.mark.parametrize("num_splits", [2, 7])
def test_mla_blocks_and_splits(block_size, num_splits) -> None:
    run_mla_case(
        "cuda",
        (4, 64, 16),
        [1, 4, 1],
        [700, 30, 0],
        block_size,
        True,
        torch.bfloat16,
        num_splits,
        seed=block_size + num_splits,
    )


def test_mla_fp16() -> None:
    run_mla_case("cuda", (16, 512, 64), [2, 3], [90, 5], 16, True, torch.float16, 1, seed=3)


def test_graph_replay_follows_new_metadata() -> None:
    """Captured once over static buffers; each replay with new lengths, blocks, rows and trees matches the reference."""
    hq, hkv, d, bs = 8, 2, 48, 16
    gen = torch.Generator().manual_seed(21)
    _, rows, _ = paged_case(
        [3, 2], [10, 50], bs, True, gen, "cuda", pad_rows=3, pad_requests=1, max_blocks=12, max_new=8
    )
    cache = randn((64, bs, 2, hkv, d), gen, "cuda", torch.bfloat16)
    q = randn((rows.num_rows, hq, d), gen, "cuda", torch.bfloat16)
    out = torch.empty(rows.num_rows, hq, d, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(rows.num_rows * hq * 4 * (d + 2), dtype=torch.float32, device="cuda")
    paged_gqa_attention(q, cache, rows, out=out, num_splits=4, workspace=ws)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_gqa_attention(q, cache, rows, out=out, num_splits=4, workspace=ws)
    for step, (q_lens, ctx) in enumerate([([1, 4], [70, 3]), ([5], [120]), ([2, 2], [0, 1])]):
        _, new, _ = paged_case(
            q_lens,
            ctx,
            bs,
            True,
            gen,
            "cuda",
            pad_rows=8 - sum(q_lens),
            pad_requests=3 - len(q_lens),
            max_blocks=12,
            max_new=8,
        )
        for field in ("block_tables", "kv_lens", "new_starts", "row_request", "row_index", "tree_mask"):
            getattr(rows, field).copy_(getattr(new, field))
        q.copy_(randn(tuple(q.shape), gen, "cuda", torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = gqa_rows_reference(q, cache, rows)
        assert rel_err(out, ref) < TOL, f"replay {step}"


def test_mla_graph_replay_decode() -> None:
    """The demo's MLA sizes captured for 3 decode rows; replays over new lengths and blocks match the reference."""
    h, r, p, bs = 4, 64, 16, 16
    gen = torch.Generator().manual_seed(22)
    _, rows, _ = paged_case([1, 1], [5, 60], bs, False, gen, "cuda", pad_rows=1, pad_requests=1, max_blocks=10)
    cache = randn((48, bs, r + p), gen, "cuda", torch.bfloat16)
    qn = randn((3, h, r), gen, "cuda", torch.bfloat16)
    qp = randn((3, h, p), gen, "cuda", torch.bfloat16)
    out = torch.empty(3, h, r, dtype=torch.bfloat16, device="cuda")
    paged_mla_attention(qn, qp, cache, rows, 0.125, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_mla_attention(qn, qp, cache, rows, 0.125, out=out)
    for step, ctx in enumerate([[100, 0, 7], [3], [140, 141]]):
        _, new, _ = paged_case(
            [1] * len(ctx), ctx, bs, False, gen, "cuda", pad_rows=3 - len(ctx), pad_requests=3 - len(ctx), max_blocks=10
        )
        for field in ("block_tables", "kv_lens", "new_starts", "row_request", "row_index"):
            getattr(rows, field).copy_(getattr(new, field))
        qn.copy_(randn((3, h, r), gen, "cuda", torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, mla_rows_reference(qn, qp, cache, rows, 0.125)) < TOL, f"replay {step}"
