"""Pad rows routed to NO_EXPERT (the pad rows of the target's invariant steps, models/moe.py): every MoE path gives
them no expert work and exactly 0, and leaves the real rows' bits as they are when the pad rows copy the last row (the
padding before pad rows skipped their work) at the same row count, or when there are no pad rows (the gathering
references). The align step counts the experts a routing touches: pad rows add none.

CPU: the torch references and the torch align. CUDA (bf16), or the CPU under TRITON_INTERPRET=1 (fp16, tiny shapes,
as test_quant_moe.py): the Triton align, the fused MoE, the W4A16 GEMV and dot paths, the FP8 MoE; and the W4A16 GEMV's
token-count invariance (a slot's result at any T is its result alone), with a negative control.
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import HAS_CUDA, poison_cuda_allocator, random_moe_weights, random_routing
from test_quant_moe import GEMV_VARIANTS, _fp8_case, _int4_case

from specserve.kernels.checks import triton_interpreting
from specserve.kernels.fused_moe import HAS_TRITON, align_torch, align_triton, fused_moe, moe_grouped_mm
from specserve.kernels.moe_reference import NO_EXPERT, moe_reference, moe_reference_fixed_rows
from specserve.kernels.quant_moe import fp8_moe, w4a16_moe
from specserve.kernels.quant_reference import fp8_moe_reference, w4a16_moe_reference

ROWS = 17  # the GPU's invariant row count (graph_max_draft 16 + 1)
REAL = 3  # real rows of the padded step; rows REAL.. are pad rows
DEV = "cuda" if HAS_CUDA else "cpu"
ACT = torch.bfloat16 if HAS_CUDA else torch.float16  # the interpreter mishandles bf16 dots
runs_triton = pytest.mark.skipif(
    not (HAS_TRITON and (HAS_CUDA or triton_interpreting())), reason="needs triton on CUDA, or TRITON_INTERPRET=1"
)


def _padded(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, real: int = REAL):
    """(x with rows real.. copying row real - 1, the skipping routing, the copying routing): pad rows as the target
    makes them now (NO_EXPERT; the MoE block gives them weight 0 too, but NO_EXPERT alone must skip, so they keep the
    copied weights here) and as it made them before (the last real row's choices)."""
    x = torch.cat([x[:real], x[real - 1 : real].expand(x.shape[0] - real, -1)])
    copy_ids, copy_w = ids.clone(), weights.clone()
    copy_ids[real:], copy_w[real:] = ids[real - 1], weights[real - 1]
    skip_ids = copy_ids.clone()
    skip_ids[real:] = NO_EXPERT
    return x, (skip_ids, copy_w), (copy_ids, copy_w)


def _routing(e: int, k: int, seed: int, device: str = "cpu"):
    ids, weights = random_routing(ROWS, e, k, torch.Generator().manual_seed(seed), device)
    return ids, weights


@pytest.mark.parametrize("bm", (16, 32))
def test_align_gives_pad_rows_no_row_and_touches_only_the_real_rows_experts(bm):
    e, k = 64, 6
    ids, weights = _routing(e, k, seed=bm)
    _, (skip_ids, _), (copy_ids, _) = _padded(torch.zeros(ROWS, 8), ids, weights)
    for routing, rows in ((skip_ids, REAL), (copy_ids, ROWS)):
        slot, expert, nb = align_torch(routing, e, bm)
        nb = int(nb)
        used = slot[: nb * bm][slot[: nb * bm] < routing.numel()].long()
        assert sorted(used.tolist()) == list(range(rows * k))  # pad slots get no row (copies: every slot one)
        assert set(expert[:nb].tolist()) == set(ids[:REAL].reshape(-1).tolist())  # the experts touched
        counts = torch.bincount(routing[:rows].reshape(-1), minlength=e)
        assert nb == int(((counts + bm - 1) // bm).sum())


def test_align_of_a_routing_with_no_expert_at_all():
    slot, _, nb = align_torch(torch.full((4, 2), NO_EXPERT), 8, 16)
    assert int(nb) == 0 and bool((slot == 8).all())


def test_references_give_pad_rows_zero_and_the_real_rows_their_bits():
    gen = torch.Generator().manual_seed(3)
    e, h, i, k = 12, 64, 32, 4
    w13, w2 = random_moe_weights(e, h, i, torch.float32, gen, "cpu")
    x, (skip_ids, skip_w), (copy_ids, copy_w) = _padded(torch.randn(ROWS, h, generator=gen), *_routing(e, k, 4))
    # fixed rows (the CPU's invariant MoE): at the same row count, pad rows skipping or copying
    skip = moe_reference_fixed_rows(x, w13, w2, skip_ids, skip_w)
    assert torch.equal(skip[:REAL], moe_reference_fixed_rows(x, w13, w2, copy_ids, copy_w)[:REAL])
    assert not skip[REAL:].any()
    # the gathering reference: the same bits as the unpadded rows (the pad rows add no row to any expert's GEMM)
    out = moe_reference(x, w13, w2, skip_ids, skip_w)
    assert torch.equal(out[:REAL], moe_reference(x[:REAL], w13, w2, skip_ids[:REAL], skip_w[:REAL]))
    assert not out[REAL:].any()


def test_grouped_mm_skips_pad_rows():
    """The library path (long prefills): pad rows add no rows to any expert's group. On the CPU, where the real rows
    are bitwise those of the unpadded call (a CUDA grouped GEMM may pick its kernel by the total row count)."""
    gen = torch.Generator().manual_seed(8)
    e, h, i, k = 12, 64, 32, 4
    w13, w2 = random_moe_weights(e, h, i, torch.bfloat16, gen, "cpu")
    x, (skip_ids, skip_w), _ = _padded(torch.randn(ROWS, h, generator=gen).to(torch.bfloat16), *_routing(e, k, 9))
    out = moe_grouped_mm(x, w13, w2, skip_ids, skip_w)
    assert torch.equal(out[:REAL], moe_grouped_mm(x[:REAL], w13, w2, skip_ids[:REAL], skip_w[:REAL]))
    assert not out[REAL:].any()


def test_quantized_references_skip_pad_rows():
    for case, ref, fmt in (
        (_int4_case("tiny", ROWS, seed=5), w4a16_moe_reference, {"group_size": 32}),
        (_fp8_case("tiny", ROWS, seed=6, block=(16, 24)), fp8_moe_reference, {"block": (16, 24)}),
    ):
        x, w13, s13, w2, s2, ids, weights = (a.cpu() for a in case)
        x, (skip_ids, skip_w), _ = _padded(x.float(), ids, weights)
        args = (w13, s13, w2, s2)
        out = ref(x, *args, skip_ids, skip_w, **fmt)
        assert torch.equal(out[:REAL], ref(x[:REAL], *args, skip_ids[:REAL], skip_w[:REAL], **fmt))
        assert not out[REAL:].any()


def _sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


@pytest.mark.gpu
@runs_triton
def test_triton_align_drops_pad_slots_as_the_torch_align_does():
    ids, weights = _routing(40, 8, seed=9, device=DEV)
    _, (skip_ids, _), _ = _padded(torch.zeros(ROWS, 8, device=DEV), ids, weights)
    for bm in (16, 32):
        a_slot, a_exp, a_nb = align_torch(skip_ids, 40, bm)
        b_slot, b_exp, b_nb = align_triton(skip_ids, 40, bm)
        nb = int(a_nb)
        assert (
            nb == int(b_nb)
            and torch.equal(a_slot[: nb * bm], b_slot[: nb * bm])
            and torch.equal(a_exp[:nb], b_exp[:nb])
        )


def _same_real_rows_and_zero_pads(run, x, skip, copy) -> None:
    """run(x, ids, weights) [T, H]: skipping pad rows leave the real rows' bits as copying pad rows give them."""
    poison_cuda_allocator()
    out_skip = run(x, *skip)
    out_copy = run(x, *copy)
    _sync()
    assert torch.equal(out_skip[:REAL], out_copy[:REAL])
    assert not out_skip[REAL:].any()  # 0, not the poison of an unwritten row
    assert out_copy[REAL:].any()  # (the copies did expert work)


@pytest.mark.gpu
@runs_triton
def test_fused_moe_skips_pad_rows():
    e, h, i, k = (64, 2048, 768, 6) if HAS_CUDA else (8, 64, 32, 3)
    gen = torch.Generator().manual_seed(11)
    w13, w2 = random_moe_weights(e, h, i, ACT, gen, DEV)
    ids, weights = _routing(e, k, seed=12, device=DEV)
    x, skip, copy = _padded(torch.randn(ROWS, h, generator=gen).to(DEV, ACT), ids, weights)
    _same_real_rows_and_zero_pads(lambda a, i_, w: fused_moe(a, w13, w2, i_, w, backend="triton"), x, skip, copy)


@pytest.mark.gpu
@runs_triton
@pytest.mark.parametrize("path", ["gemv", "dot", *GEMV_VARIANTS])
def test_w4a16_moe_skips_pad_rows(path):
    shape = "tiny" if not HAS_CUDA else "kimi_k2_width"
    x, w13, s13, w2, s2, ids, weights = _int4_case(shape, ROWS, seed=13)
    x, skip, copy = _padded(x, ids, weights)
    gemv = 0 if path == "dot" else ROWS

    def run(a, i_, w):
        return w4a16_moe(
            a, w13, s13, w2, s2, i_, w, group_size=32, gemv_max_tokens=gemv, gemv_tiles=GEMV_VARIANTS.get(path)
        )

    _same_real_rows_and_zero_pads(run, x, skip, copy)


@pytest.mark.gpu
@runs_triton
def test_fp8_moe_skips_pad_rows():
    shape = "tiny" if not HAS_CUDA else "qwen3_30b_a3b"
    block = (16, 24) if not HAS_CUDA else (128, 128)
    x, w13, s13, w2, s2, ids, weights = _fp8_case(shape, ROWS, seed=14, block=block)
    x, skip, copy = _padded(x, ids, weights)
    _same_real_rows_and_zero_pads(lambda a, i_, w: fp8_moe(a, w13, s13, w2, s2, i_, w, block=block), x, skip, copy)


@pytest.mark.gpu
@runs_triton
@pytest.mark.parametrize("variant", ["default", *GEMV_VARIANTS])
def test_w4a16_gemv_rows_do_not_depend_on_the_row_count(variant):
    """The invariant steps run the W4A16 GEMV at every step of up to ROWS rows (CausalLM.set_invariant_rows): row j
    of a ROWS-row call must be what row j gets alone, under every GEMV choice (split chunks, prefetch, lanes). The
    negative control: the dot path at ROWS rows (what invariant steps ran before) rounds differently from the GEMV
    alone."""
    shape = "tiny" if not HAS_CUDA else "kimi_k2_width"
    x, w13, s13, w2, s2, ids, weights = _int4_case(shape, ROWS, seed=15)
    args = (w13, s13, w2, s2)
    tiles = GEMV_VARIANTS.get(variant)
    full = w4a16_moe(x, *args, ids, weights, group_size=32, gemv_max_tokens=ROWS, gemv_tiles=tiles)
    alone = [
        w4a16_moe(x[j : j + 1], *args, ids[j : j + 1], weights[j : j + 1], group_size=32, gemv_tiles=tiles)
        for j in range(ROWS)
    ]
    _sync()
    assert [j for j in range(ROWS) if not torch.equal(full[j], alone[j][0])] == []
    dot = w4a16_moe(x, *args, ids, weights, group_size=32, gemv_max_tokens=0)
    assert [j for j in range(ROWS) if not torch.equal(dot[j], alone[j][0])] != []


@pytest.mark.gpu
@runs_triton
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_router_routes_rows_past_the_live_count_to_no_expert(scoring):
    """The fused router (models/moe.TopKRouter with the fused layers) reads the live row count from the device: rows
    from it on get NO_EXPERT at weight 0 unscored, the rows before it what they get without a count."""
    from specserve.kernels.router import RouterConfig, route

    sigmoid = scoring == "sigmoid"
    rule = RouterConfig(
        num_experts=64,
        top_k=6,
        scoring=scoring,
        n_group=8 if sigmoid else 1,
        topk_group=4 if sigmoid else 1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    logits = torch.randn(ROWS, 64, generator=torch.Generator().manual_seed(21)).to(DEV)
    ids, weights = route(logits, rule)
    live_ids, live_w = route(logits, rule, live_rows=torch.tensor([REAL], device=DEV))
    _sync()
    assert torch.equal(live_ids[:REAL], ids[:REAL]) and torch.equal(live_w[:REAL], weights[:REAL])
    assert bool((live_ids[REAL:] == NO_EXPERT).all()) and not live_w[REAL:].any()
