"""kernels/router.route_gate: the gate GEMM and the routing rule in one launch (several programs a row, the last to
arrive routes it), against the gate GEMM then route(), on fresh random inputs with the allocator poisoned; on CUDA,
and under TRITON_INTERPRET=1 on the CPU. A row's result does not depend on the other rows; the arrival counters are
left at zero (negative control: counters left non-zero by a broken call leave rows unrouted)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import HAS_CUDA, poison_cuda_allocator

from specserve.kernels.checks import KernelArgumentError, triton_interpreting
from specserve.kernels.fused_moe import align_torch, default_tile_config
from specserve.kernels.router import HAS_TRITON, GateTile, RouterConfig, new_gate_counters, route, route_gate_with_runs
from specserve.kernels.router import route_gate as _route_gate

pytestmark = pytest.mark.skipif(
    not (HAS_TRITON and (HAS_CUDA or triton_interpreting())), reason="needs triton on CUDA, or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if HAS_CUDA else "cpu"
# (E, H, top_k, scoring, n_group, topk_group): Moonlight / DeepSeek-V3 style, Qwen3-MoE style, K2 width (few experts)
RULES = {
    "sigmoid_grouped": (64, 2048, 6, "sigmoid", 8, 4),
    "softmax": (128, 2048, 8, "softmax", 1, 1),
    "wide": (48, 7168, 8, "sigmoid", 1, 1),
}


def _case(name: str, t: int, seed: int):
    e, h, k, scoring, n_group, topk_group = RULES[name]
    if not HAS_CUDA:  # the interpreter is slow: the same rule at a small width
        h = 96
    gen = torch.Generator().manual_seed(seed)
    rule = RouterConfig(
        num_experts=e,
        top_k=k,
        scoring=scoring,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=True,
        routed_scaling_factor=2.5 if scoring == "sigmoid" else 1.0,
    )
    x = torch.randn(t, h, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(e, h, generator=gen) / h**0.5).to(DEVICE, torch.bfloat16)
    bias = (torch.randn(e, generator=gen) * 0.1).to(DEVICE) if scoring == "sigmoid" else None
    return x, w, rule, bias


def route_gate(*args, **kw):
    """The default tile on CUDA; under the interpreter 16 experts a program (one a program is 16x the programs)."""
    return _route_gate(*args, **kw, tile=None if HAS_CUDA else GateTile(16, 128, 2))


def _with_runs(*args, **kw):
    return route_gate_with_runs(*args, **kw, tile=None if HAS_CUDA else GateTile(16, 128, 2))


def _two_launches(x, w, rule, bias, **kw):
    """The float32 GEMM (exact products, float32 sums), rounded to x's dtype for the softmax rule, then route()."""
    logits = F.linear(x.float(), w.float())
    return route(logits if rule.scoring == "sigmoid" else logits.to(x.dtype), rule, bias, **kw)


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("t", [1, 4, 17])
def test_route_gate_matches_the_gemm_then_route(name, t):
    x, w, rule, bias = _case(name, t, seed=t)
    counters = new_gate_counters(DEVICE)
    ref_ids, ref_w = _two_launches(x, w, rule, bias, shared=2)
    poison_cuda_allocator()
    ids, weights = route_gate(x, w, rule, counters, bias, shared=2)
    if rule.scoring == "sigmoid":  # float32 logits: the same ids in the same order
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
    else:
        # bf16 logits: a float32 sum that rounds to the neighbouring bf16 value (summation order) can untie or tie
        # two experts (their order swaps) and moves the weights by up to ~1% (one bf16 ulp of a logit, through exp)
        ids_sorted, order = ids.sort(1)
        ref_sorted, ref_order = ref_ids.sort(1)
        assert torch.equal(ids_sorted, ref_sorted)
        torch.testing.assert_close(weights.gather(1, order), ref_w.gather(1, ref_order), rtol=2e-2, atol=1e-6)
    assert not counters.any()  # left at zero for the next call
    again = route_gate(x, w, rule, counters, bias, shared=2)
    assert torch.equal(again[0], ids) and torch.equal(again[1], weights)


@pytest.mark.parametrize("name", ["sigmoid_grouped", "softmax"])
def test_rows_do_not_depend_on_the_other_rows_and_pad_rows_route_nowhere(name):
    x, w, rule, bias = _case(name, 17, seed=99)
    counters = new_gate_counters(DEVICE)
    live = torch.tensor([12], device=DEVICE)
    ids, weights = route_gate(x, w, rule, counters, bias, live_rows=live)
    for j in (0, 7, 11):
        one_ids, one_w = route_gate(x[j : j + 1], w, rule, counters, bias)
        assert torch.equal(ids[j], one_ids[0]) and torch.equal(weights[j], one_w[0]), j
    assert (ids[12:] == -1).all() and not weights[12:].any()


def test_counters_left_non_zero_leave_rows_unrouted():
    """Negative control: the last-arriver test is what routes a row; counters a broken call left high make no program
    the last, so the outputs stay unwritten (the check the routing tests rely on can fail)."""
    x, w, rule, bias = _case("sigmoid_grouped", 2, seed=5)
    good = route_gate(x, w, rule, new_gate_counters(DEVICE), bias)[0]
    broken = new_gate_counters(DEVICE) + 10_000
    poison_cuda_allocator()
    ids = route_gate(x, w, rule, broken, bias)[0]
    assert not torch.equal(ids, good)


def test_bad_arguments_are_named():
    x, w, rule, bias = _case("softmax", 2, seed=6)
    with pytest.raises(KernelArgumentError, match="weight"):
        route_gate(x, w[:, :-1], rule, new_gate_counters(DEVICE))
    with pytest.raises(KernelArgumentError, match="route_gate needs"):
        route_gate(x.float(), w, rule, new_gate_counters(DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_route_gate_in_a_cuda_graph():
    x, w, rule, bias = _case("sigmoid_grouped", 4, seed=8)
    counters = new_gate_counters(DEVICE)
    static_x = x.clone()
    route_gate(static_x, w, rule, counters, bias, shared=2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route_gate(static_x, w, rule, counters, bias, shared=2)
    for seed in (1, 2):
        static_x.copy_(_case("sigmoid_grouped", 4, seed=seed)[0])
        graph.replay()
        ref = route_gate(static_x, w, rule, counters, bias, shared=2)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.gpu
@pytest.mark.parametrize("t,live", [(1, None), (4, None), (17, 12)])
def test_route_gate_with_runs_aligns_the_slots_as_fused_moe_would(t, live):
    """The program that routes the step's last row (pad rows included) sorts every slot by expert: the layout
    fused_moe's own align step makes of the same ids (align_torch). Two calls in turn: the routed-rows counter is left
    at zero (a counter left high would leave the second call's layout unwritten)."""
    live_rows = None if live is None else torch.tensor([live], device=DEVICE)
    counters = new_gate_counters(DEVICE)
    for seed in (40 + t, 80 + t):
        x, w, rule, bias = _case("sigmoid_grouped", t, seed=seed)
        bm = default_tile_config(t, x.shape[1], 1408).bm
        poison_cuda_allocator()
        ids, weights, runs = _with_runs(x, w, rule, counters, bm, bias, live_rows=live_rows, shared=2)
        ref_ids, ref_w = route_gate(x, w, rule, new_gate_counters(DEVICE), bias, live_rows=live_rows, shared=2)
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
        slot, block_expert, num_blocks = align_torch(ids, rule.num_experts + 2, bm)
        assert (runs.bm, runs.num_experts) == (bm, rule.num_experts + 2)
        assert torch.equal(runs.num_blocks, num_blocks)
        assert torch.equal(runs.sorted_slot, slot)
        used = int(num_blocks)
        assert torch.equal(runs.block_expert[:used], block_expert[:used])
        assert not counters.any()
