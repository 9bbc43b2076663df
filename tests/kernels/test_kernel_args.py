"""CPU tests (run in CI): wrapper argument checking, and the pure-torch paths agreeing with each other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import (
    random_block_tables,
    random_moe_weights,
    random_routing,
    random_tree_mask,
    rel_err,
)

from specserve.kernels import attention
from specserve.kernels.attention_reference import (
    mla_attention_reference,
    paged_attention_reference,
)
from specserve.kernels.checks import KernelArgumentError, triton_interpreting
from specserve.kernels.fused_moe import (
    GROUPED_MM_ABOVE_TOKENS,
    HAS_TRITON,
    MoETileConfig,
    align_torch,
    check_routing_ids,
    fused_moe,
    moe_grouped_mm,
    pick_backend,
)
from specserve.kernels.moe_reference import moe_reference
from specserve.kernels.paged_batch import PagedBatch


def _moe_args(t=3, e=6, h=32, i=16, k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = random_moe_weights(e, h, i, torch.bfloat16, gen, "cpu")
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids, w = random_routing(t, e, k, gen, "cpu")
    return x, w13, w2, ids, w


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: (a[0][:, :-1].contiguous(), *a[1:]), "w13.shape\\[2\\]"),
        (lambda a: (a[0][0], *a[1:]), "hidden must have 2 dims"),
        (lambda a: (a[0].float(), *a[1:]), "hidden has dtype"),
        (lambda a: (a[0], a[1].half(), *a[2:]), "must share a dtype"),
        (lambda a: (a[0], a[1][:, :-2].contiguous(), *a[2:]), "w2.shape\\[2\\]"),
        (lambda a: (a[0], a[1][:, :-1].contiguous(), *a[2:]), "2\\*I"),
        (lambda a: (a[0], a[1], a[2][:-1], *a[3:]), "w2.shape\\[0\\]"),
        (lambda a: (a[0], a[1], a[2], a[3][:-1], a[4]), "topk_ids.shape\\[0\\]"),
        (lambda a: (a[0], a[1], a[2], a[3], a[4][:, :1].contiguous()), "topk_weights shape"),
        (lambda a: (a[0], a[1], a[2], a[3].float(), a[4]), "topk_ids has dtype"),
        (lambda a: (a[0].t().contiguous().t(), *a[1:]), "contiguous"),
        (lambda a: (a[0], a[1].transpose(1, 2), *a[2:]), "w13"),
        (lambda a: (a[0][:0], *a[1:3], a[3][:0], a[4][:0]), "at least one token"),
        (lambda a: ("not a tensor", *a[1:]), "torch.Tensor"),
    ],
)
def test_fused_moe_rejects_bad_arguments(mutate, match) -> None:
    with pytest.raises(KernelArgumentError, match=match):
        fused_moe(*mutate(_moe_args()))


@pytest.fixture
def compiled_triton(monkeypatch):
    """The wrappers as they dispatch without Triton's interpreter (the normal run), also in a run under
    TRITON_INTERPRET=1: they read the variable at each call, and these tests launch no kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_fused_moe_rejects_bad_backend_and_cpu_triton(compiled_triton) -> None:
    args = _moe_args()
    with pytest.raises(KernelArgumentError, match="backend must be one of"):
        fused_moe(*args, backend="cuda-magic")
    with pytest.raises(KernelArgumentError, match="triton" if not HAS_TRITON else "CUDA tensors"):
        fused_moe(*args, backend="triton")
    ids = args[3].clone()
    ids[0, 0] = 6
    with pytest.raises(KernelArgumentError, match="topk_ids must lie in"):
        check_routing_ids(ids, 6)


@pytest.mark.skipif(not (HAS_TRITON and triton_interpreting()), reason="needs triton and TRITON_INTERPRET=1")
def test_under_the_interpreter_cpu_tensors_go_to_triton() -> None:
    """The interpreter runs Triton kernels on CPU tensors, so there the wrapper takes them (no refusal) and
    auto picks Triton up to GROUPED_MM_ABOVE_TOKENS tokens, as it does on CUDA."""
    x = _moe_args()[0]
    assert pick_backend(x) == "triton"
    assert pick_backend(x.new_zeros(GROUPED_MM_ABOVE_TOKENS + 1, x.shape[1])) == "grouped_mm"


def test_tile_config_validation() -> None:
    with pytest.raises(KernelArgumentError, match="power of two"):
        MoETileConfig(24, 32, 64, 4, 3, 32, 64, 4, 3)
    with pytest.raises(KernelArgumentError, match=">= 16"):
        MoETileConfig(16, 8, 64, 4, 3, 32, 64, 4, 3)


@pytest.mark.parametrize("t", [1, 4, 17])
def test_grouped_mm_path_matches_reference_on_cpu(t: int, compiled_triton) -> None:
    x, w13, w2, ids, w = _moe_args(t=t, e=8, h=48, i=32, k=3, seed=t)
    ref = moe_reference(x, w13, w2, ids, w)
    assert rel_err(moe_grouped_mm(x, w13, w2, ids, w), ref) < 1e-2
    assert rel_err(fused_moe(x, w13, w2, ids, w, backend="grouped_mm"), ref) < 1e-2
    assert rel_err(fused_moe(x, w13, w2, ids, w), ref) < 1e-2  # auto on CPU -> grouped_mm


def test_moe_reference_matches_dense_per_token_loop() -> None:
    x, w13, w2, ids, w = _moe_args(t=5, e=7, h=24, i=16, k=3, seed=9)
    xf, w13f, w2f = x.double(), w13.double(), w2.double()
    dense = torch.zeros(5, 24, dtype=torch.float64)
    for t in range(5):
        for j in range(3):
            e = int(ids[t, j])
            gu = w13f[e] @ xf[t]
            dense[t] += float(w[t, j]) * (w2f[e] @ (F.silu(gu[:16]) * gu[16:]))
    assert rel_err(moe_reference(x, w13, w2, ids, w), dense) < 1e-2


@pytest.mark.parametrize("bm", [16, 64])
def test_align_torch_layout(bm: int) -> None:
    gen = torch.Generator().manual_seed(bm)
    ids, _ = random_routing(37, 12, 4, gen, "cpu")
    slot, expert, nb = align_torch(ids, 12, bm)
    n, used = ids.numel(), int(nb) * bm
    real = slot[:used][slot[:used] < n].long()
    assert torch.equal(real.sort().values, torch.arange(n))  # every (token, k) slot exactly once
    rows = torch.arange(used)[slot[:used] < n]
    assert torch.equal(ids.reshape(-1)[real], expert[rows // bm].long())  # one expert per block
    assert bool((expert[: int(nb)].diff() >= 0).all())  # blocks in expert order
    assert int(nb) == int(((torch.bincount(ids.reshape(-1), minlength=12) + bm - 1) // bm).sum())


# ---- attention: metadata, references, wrappers without flashinfer -------------------------------------


def test_paged_batch_rejects_bad_input() -> None:
    with pytest.raises(KernelArgumentError, match="needs 2 blocks"):
        PagedBatch.build([1], [16], [[3]], 16)
    with pytest.raises(KernelArgumentError, match=">= 1 new token"):
        PagedBatch.build([0], [3], [[0]], 16)
    with pytest.raises(KernelArgumentError, match="attend to itself"):
        PagedBatch.build([2], [3], [[0]], 16, [torch.zeros(2, 2, dtype=torch.bool)])
    with pytest.raises(KernelArgumentError, match="bool \\[3, 3\\]"):
        PagedBatch.build([3], [3], [[0]], 16, [torch.ones(2, 2, dtype=torch.bool)])
    with pytest.raises(KernelArgumentError, match="block tables"):
        PagedBatch.build([1, 1], [3, 3], [[0]], 16)
    with pytest.raises(KernelArgumentError, match="out of range"):
        PagedBatch.build([1], [3], [[9]], 16).check_blocks_fit(4, "kv_cache")


def test_paged_batch_csr_fields() -> None:
    b = PagedBatch.build([1, 3], [16, 30], [[5, 6, 99], [1, 2, 3]], 16)
    assert b.kv_indptr.tolist() == [0, 2, 5] and b.kv_indices.tolist() == [5, 6, 1, 2, 3]
    assert b.kv_lens.tolist() == [17, 33] and b.last_page_lens().tolist() == [1, 1]
    assert b.qo_indptr.tolist() == [0, 1, 4] and b.num_tokens == 4 and not b.is_decode
    assert b.token_slots(0).tolist() == list(range(80, 96)) + [96]


def _contiguous_kv_into_pages(k, v, tables, block):  # k, v [S, Hkv, D] per request -> paged cache
    nb = max(max(t) for t in tables) + 1
    cache = torch.randn(nb, block, 2, k[0].shape[1], k[0].shape[2])  # garbage everywhere else
    for kk, vv, table in zip(k, v, tables):
        for p in range(kk.shape[0]):
            cache[table[p // block], p % block, 0] = kk[p]
            cache[table[p // block], p % block, 1] = vv[p]
    return cache


@pytest.mark.parametrize("tree", [False, True])
def test_paged_reference_matches_contiguous_sdpa(tree: bool) -> None:
    gen = torch.Generator().manual_seed(11 + tree)
    hq, hkv, d, block = 8, 2, 16, 4
    q_lens, ctx = [1, 3, 5], [6, 0, 9]
    kv = [q + c for q, c in zip(q_lens, ctx)]
    tables = random_block_tables(kv, block, 20, gen)
    masks = [random_tree_mask(q, gen) for q in q_lens] if tree else None
    batch = PagedBatch.build(q_lens, ctx, tables, block, masks)
    ks = [torch.randn(n, hkv, d, generator=gen) for n in kv]
    vs = [torch.randn(n, hkv, d, generator=gen) for n in kv]
    cache = _contiguous_kv_into_pages(ks, vs, tables, block)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    out = paged_attention_reference(q, cache, batch, sm_scale=0.3)
    for b in range(3):
        s, e = int(batch.qo_indptr[b]), int(batch.qo_indptr[b + 1])
        own = masks[b] if tree else torch.ones(q_lens[b], q_lens[b], dtype=torch.bool).tril()
        mask = torch.cat([torch.ones(q_lens[b], ctx[b], dtype=torch.bool), own], dim=1)
        ref = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1),
            ks[b].transpose(0, 1),
            vs[b].transpose(0, 1),
            attn_mask=mask,
            scale=0.3,
            enable_gqa=True,
        ).transpose(0, 1)
        assert rel_err(out[s:e], ref) < 1e-5


def test_mla_reference_matches_expanded_sdpa() -> None:
    gen = torch.Generator().manual_seed(5)
    h, r, p, block = 4, 32, 8, 4
    q_lens, ctx = [2, 1], [5, 10]
    kv = [q + c for q, c in zip(q_lens, ctx)]
    tables = random_block_tables(kv, block, 12, gen)
    masks = [random_tree_mask(2, gen), None]
    batch = PagedBatch.build(q_lens, ctx, tables, block, masks)
    cache = torch.randn(12, block, r + p, generator=gen)
    q_nope = torch.randn(3, h, r, generator=gen)
    q_pe = torch.randn(3, h, p, generator=gen)
    out = mla_attention_reference(q_nope, q_pe, cache, batch, sm_scale=0.2)
    flat = cache.reshape(-1, r + p)
    for b in range(2):
        s, e = int(batch.qo_indptr[b]), int(batch.qo_indptr[b + 1])
        ent = flat[batch.token_slots(b)]  # [S, R+P]
        k = ent[None].expand(h, -1, -1)
        v = ent[None, :, :r].expand(h, -1, -1)
        qq = torch.cat([q_nope[s:e], q_pe[s:e]], -1).transpose(0, 1)
        ref = F.scaled_dot_product_attention(qq, k, v, attn_mask=batch.request_mask(b), scale=0.2)
        assert rel_err(out[s:e], ref.transpose(0, 1)) < 1e-5


@pytest.mark.skipif(attention.HAS_FLASHINFER, reason="checks the no-flashinfer path")
def test_wrappers_say_flashinfer_is_missing() -> None:
    with pytest.raises(KernelArgumentError, match="flashinfer is not importable"):
        attention.StepAttention(attention.AttnDims(False, 8, 2, 64, 0, 0.125, torch.bfloat16), 16, "cpu")
    with pytest.raises(KernelArgumentError, match="flashinfer is not importable"):
        attention.StepAttention(attention.AttnDims(True, 8, 1, 64, 16, 0.125, torch.bfloat16), 16, "cpu")
