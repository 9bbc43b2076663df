"""CPU tests of the router reference (against the model's TopKRouter and a naive loop), its config and argument
checks, and (TRITON_INTERPRET=1 with triton installed) the Triton router through the interpreter."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import ROUTERS, router_case

from specserve.kernels.checks import KernelArgumentError, triton_interpreting
from specserve.kernels.router import HAS_TRITON, route
from specserve.kernels.router_reference import RouterConfig, router_reference
from specserve.models.config import MoEConfig
from specserve.models.moe import TopKRouter

interpreted = pytest.mark.skipif(
    not (HAS_TRITON and triton_interpreting()),
    reason="needs triton and TRITON_INTERPRET=1 (runs the kernels on the CPU)",
)


def _by_id(ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), w.gather(1, order)


@pytest.mark.parametrize(
    "name", ["qwen3_30b_a3b", "qwen3_moe_no_renorm", "mixtral", "deepseek_v3", "kimi_k2", "demo", "odd_groups"]
)
def test_reference_is_the_model_router(name) -> None:
    """The model's TopKRouter with an identity gate (its logits are its input): same ids and weights."""
    cfg, with_bias = ROUTERS[name]
    gen = torch.Generator().manual_seed(len(name))
    logits, bias = router_case(33, cfg, with_bias, torch.float32, gen, "cpu")
    moe = MoEConfig(
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        intermediate_size=8,
        layers=(0,),
        scoring=cfg.scoring,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        correction_bias=with_bias,
    )
    router = TopKRouter(moe, cfg.num_experts)
    router.weight.data.copy_(torch.eye(cfg.num_experts))
    if with_bias:
        router.e_score_correction_bias.data.copy_(bias)
    model_ids, model_w = router(logits)
    ids, w = router_reference(logits, cfg, bias)
    if cfg.scoring == "softmax":  # the model's softmax rule returns sorted ids; the sigmoid rule does not
        assert torch.equal(ids, model_ids)
        torch.testing.assert_close(w, model_w, rtol=1e-6, atol=1e-7)
    else:
        a, b = _by_id(ids, w), _by_id(model_ids, model_w)
        assert torch.equal(a[0], b[0])
        torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-7)


def naive_route(logits: torch.Tensor, cfg: RouterConfig, bias: torch.Tensor | None):
    """Per token in Python floats: the rule written out (sorted lists instead of topk)."""
    e = cfg.num_experts
    per = e // cfg.n_group
    all_ids, all_w = [], []
    for row in logits.double().tolist():
        if cfg.scoring == "sigmoid":
            s = [1 / (1 + math.exp(-v)) for v in row]
        else:
            top = max(row)
            ex = [math.exp(v - top) for v in row]
            s = [v / sum(ex) for v in ex]
        c = [v + (float(bias[i]) if bias is not None else 0.0) for i, v in enumerate(s)]
        allowed = set(range(e))
        if cfg.n_group > 1:
            gscore = [sum(sorted(c[g * per : (g + 1) * per], reverse=True)[:2]) for g in range(cfg.n_group)]
            groups = sorted(range(cfg.n_group), key=lambda g: -gscore[g])[: cfg.topk_group]
            allowed = {g * per + p for g in groups for p in range(per)}
        ids = sorted(allowed, key=lambda i: -c[i])[: cfg.top_k]
        w = [s[i] for i in ids]
        if cfg.norm_topk_prob:
            total = sum(w) + cfg.renorm_eps
            w = [v / total for v in w]
        all_ids.append(ids)
        all_w.append([v * cfg.routed_scaling_factor for v in w])
    return torch.tensor(all_ids), torch.tensor(all_w, dtype=torch.float64)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_reference_matches_naive_loop(name) -> None:
    cfg, with_bias = ROUTERS[name]
    gen = torch.Generator().manual_seed(100 + len(name))
    logits, bias = router_case(17, cfg, with_bias, torch.float32, gen, "cpu")
    ids, w = router_reference(logits, cfg, bias)
    n_ids, n_w = naive_route(logits, cfg, bias)
    assert torch.equal(ids, n_ids)
    torch.testing.assert_close(w.double(), n_w, rtol=1e-5, atol=1e-7)


def test_router_config_validation() -> None:
    with pytest.raises(KernelArgumentError, match="scoring"):
        RouterConfig(8, 2, "relu")
    with pytest.raises(KernelArgumentError, match="num_experts % n_group"):
        RouterConfig(10, 2, "sigmoid", n_group=4)
    with pytest.raises(KernelArgumentError, match="exceeds the experts"):
        RouterConfig(16, 9, "sigmoid", n_group=4, topk_group=2)
    with pytest.raises(KernelArgumentError, match=">= 1"):
        RouterConfig(16, 0)
    with pytest.raises(KernelArgumentError, match="routed_scaling_factor"):
        RouterConfig(16, 2, routed_scaling_factor=0.0)


def test_route_rejects_bad_arguments() -> None:
    cfg = RouterConfig(16, 4, "sigmoid", 4, 2)
    logits = torch.randn(3, 16)
    with pytest.raises(KernelArgumentError, match="RouterConfig"):
        route(logits, "sigmoid")
    with pytest.raises(KernelArgumentError, match="cfg.num_experts"):
        route(torch.randn(3, 8), cfg)
    with pytest.raises(KernelArgumentError, match="logits has dtype"):
        route(logits.long(), cfg)
    with pytest.raises(KernelArgumentError, match="last dim"):
        route(torch.randn(16, 3).t(), cfg)
    with pytest.raises(KernelArgumentError, match="correction_bias.shape\\[0\\]"):
        route(logits, cfg, torch.zeros(8))
    if HAS_TRITON and triton_interpreting():
        with pytest.raises(KernelArgumentError, match="topk_ids has dtype"):
            route(logits, cfg, topk_ids=torch.empty(3, 4, dtype=torch.int64))
        with pytest.raises(KernelArgumentError, match="topk_weights has shape"):
            route(logits, cfg, topk_weights=torch.empty(3, 5))
    else:
        with pytest.raises(KernelArgumentError, match="triton" if not HAS_TRITON else "CUDA tensors"):
            route(logits, cfg)


@interpreted
@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_kernel_under_interpreter(name, dtype) -> None:
    cfg, with_bias = ROUTERS[name]
    gen = torch.Generator().manual_seed(7 + len(name))
    logits, bias = router_case(6, cfg, with_bias, dtype, gen, "cpu")
    ref_ids, ref_w = router_reference(logits, cfg, bias)
    ids = torch.full((6, cfg.top_k), -7, dtype=torch.int32)
    w = torch.full((6, cfg.top_k), float("nan"))
    route(logits, cfg, bias, topk_ids=ids, topk_weights=w)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-7)
