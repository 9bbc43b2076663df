"""Shared experts as always-routed experts (kernels/moe_reference.SharedExperts): the shared MLP's intermediate cut
into chunks of the routed experts' I, chunk j routed as expert E + j at weight 1, gives the same function as the
routed experts plus the shared MLP computed apart, in every MoE path (the references, grouped_mm, the Triton kernels
under TRITON_INTERPRET=1 and on CUDA), and the router appends those columns. Negative controls: a shared weight laid
out the other way (up rows first) and the Triton kernel reading the routed stack for the shared chunks both fail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import HAS_CUDA, poison_cuda_allocator, random_moe_weights, random_routing, rel_err

from specserve.kernels.checks import KernelArgumentError, triton_interpreting
from specserve.kernels.fused_moe import HAS_TRITON, fused_moe, moe_grouped_mm
from specserve.kernels.moe_reference import NO_EXPERT, SharedExperts, moe_reference, moe_reference_fixed_rows

TOL = 1e-2
runs_triton = pytest.mark.skipif(
    not (HAS_TRITON and (HAS_CUDA or triton_interpreting())), reason="needs triton on CUDA, or TRITON_INTERPRET=1"
)


def _case(e, h, i, k, s, t, seed, device, dtype=torch.bfloat16):
    """Routed experts, a shared MLP of s*i, x [t, h], routing [t, k] with the shared columns [t, k + s] after it."""
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = random_moe_weights(e, h, i, dtype, gen, device)
    shared_w13 = (torch.randn(2 * s * i, h, generator=gen) / h**0.5).to(device, dtype)
    shared_w2 = (torch.randn(h, s * i, generator=gen) / i**0.5).to(device, dtype)
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    ids, weights = random_routing(t, e, k, gen, device)
    all_ids = torch.cat([ids, torch.arange(e, e + s, device=device).expand(t, s)], 1)
    all_w = torch.cat([weights, torch.ones(t, s, device=device)], 1)
    return x, w13, w2, ids, weights, SharedExperts(shared_w13, shared_w2, s), all_ids, all_w


def _apart(x, w13, w2, ids, weights, shared):  # the routed experts, then the shared MLP as one dense MLP
    inter = shared.w2.shape[1]
    gu = x.float() @ shared.w13.float().t()  # [T, 2 S I]
    dense = (F.silu(gu[:, :inter]) * gu[:, inter:]) @ shared.w2.float().t()
    return moe_reference(x, w13, w2, ids, weights).float() + dense


@pytest.mark.parametrize("fn", [moe_reference, moe_reference_fixed_rows, moe_grouped_mm])
def test_torch_paths_match_the_shared_mlp_computed_apart(fn):
    x, w13, w2, ids, weights, shared, all_ids, all_w = _case(6, 64, 32, 2, 2, 5, seed=1, device="cpu")
    ref = _apart(x, w13, w2, ids, weights, shared)
    assert rel_err(fn(x, w13, w2, all_ids, all_w, shared=shared), ref) < TOL


def test_a_shared_weight_laid_out_up_first_is_caught():
    """Negative control: chunk j must take gate rows j*I.. and up rows S*I + j*I..; swapping gate and up fails."""
    x, w13, w2, ids, weights, shared, all_ids, all_w = _case(6, 64, 32, 2, 2, 5, seed=2, device="cpu")
    rows = shared.w13.shape[0] // 2
    swapped = SharedExperts(torch.cat([shared.w13[rows:], shared.w13[:rows]]), shared.w2, shared.count)
    ref = _apart(x, w13, w2, ids, weights, shared)
    assert rel_err(moe_reference(x, w13, w2, all_ids, all_w, shared=swapped), ref) > 0.1


def test_pad_rows_route_nowhere_and_shape_errors_are_named():
    x, w13, w2, ids, weights, shared, all_ids, all_w = _case(6, 64, 32, 2, 2, 5, seed=3, device="cpu")
    all_ids[3:], all_w[3:] = NO_EXPERT, 0.0
    out = moe_grouped_mm(x, w13, w2, all_ids, all_w, shared=shared)
    assert not out[3:].any()
    assert torch.equal(out[:3], moe_grouped_mm(x[:3], w13, w2, all_ids[:3], all_w[:3], shared=shared))
    bad = SharedExperts(shared.w13[:-1], shared.w2, shared.count)
    with pytest.raises(KernelArgumentError, match="shared weights must be"):
        fused_moe(x, w13, w2, all_ids, all_w, shared=bad)


@runs_triton
@pytest.mark.parametrize("t", [1, 4, 17])
def test_triton_kernels_run_the_shared_chunks(t):
    """Moonlight's layout (two shared experts of the routed I) at a small width; on CUDA in bf16 with the allocator
    poisoned, under the interpreter in fp16 (it multiplies bf16 dots as raw bits)."""
    device, dtype = ("cuda", torch.bfloat16) if HAS_CUDA else ("cpu", torch.float16)
    e, h, i, k, s = (64, 2048, 1408, 6, 2) if HAS_CUDA else (8, 64, 32, 2, 2)
    x, w13, w2, ids, weights, shared, all_ids, all_w = _case(e, h, i, k, s, t, seed=10 + t, device=device, dtype=dtype)
    ref = moe_reference(x, w13, w2, all_ids, all_w, shared=shared)
    poison_cuda_allocator()
    out = fused_moe(x, w13, w2, all_ids, all_w, backend="triton", shared=shared)
    assert out.shape == x.shape and rel_err(out, ref) < TOL
    # negative control: the shared chunks read as if they were routed experts E.. of a larger stack fail
    stack13 = torch.cat([w13, w13[:s]])
    stack2 = torch.cat([w2, w2[:s]])
    wrong = fused_moe(x, stack13, stack2, all_ids, all_w, backend="triton")
    assert rel_err(wrong, ref) > 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
def test_triton_rows_with_shared_chunks_do_not_depend_on_the_other_rows():
    """Row j of a 17-row call equals row 0 of a 17-row call whose rows are all row j (the invariant step's form)."""
    x, w13, w2, _, _, shared, all_ids, all_w = _case(64, 2048, 1408, 6, 2, 17, seed=7, device="cuda")
    full = fused_moe(x, w13, w2, all_ids, all_w, backend="triton", shared=shared)
    for j in (0, 5, 16):
        alone = fused_moe(
            x[j].expand(17, -1).contiguous(),
            w13,
            w2,
            all_ids[j].expand(17, -1).contiguous(),
            all_w[j].expand(17, -1).contiguous(),
            backend="triton",
            shared=shared,
        )
        assert torch.equal(full[j], alone[0]), j


@runs_triton
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_router_appends_the_shared_columns(scoring):
    from specserve.kernels.router import RouterConfig, route

    device = "cuda" if HAS_CUDA else "cpu"
    e, k, s, t = 16, 4, 2, 5
    rule = RouterConfig(
        num_experts=e,
        top_k=k,
        scoring=scoring,
        n_group=4 if scoring == "sigmoid" else 1,
        topk_group=2 if scoring == "sigmoid" else 1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(4)).to(device)
    live = torch.tensor([3], device=device)
    ids, w = route(logits, rule, live_rows=live)
    ids_s, w_s = route(logits, rule, live_rows=live, shared=s)
    assert ids_s.shape == (t, k + s) and torch.equal(ids_s[:, :k], ids) and torch.equal(w_s[:, :k], w)
    assert ids_s[:3, k:].tolist() == [[e, e + 1]] * 3 and w_s[:3, k:].tolist() == [[1.0, 1.0]] * 3
    assert (ids_s[3:] == NO_EXPERT).all() and not w_s[3:].any()
