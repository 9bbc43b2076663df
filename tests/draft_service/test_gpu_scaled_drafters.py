"""The shipped demo drafters scaled to the demo at real size (models/scaled_drafters.py), on the GPU in float32
(skipped without CUDA): at full size each scaled drafter proposes the demo-size drafter's blocks (chains and trees)
at every step, its function is the demo-size one's padded, and greedy speculation through it gives target-only's
tokens (the MTP layer too: models/scaled_mtp.py); Moonlight's shape, and K2.6's width (there the reference is
the int4-quantized demo, as the target is). Sampled speculation through each (Moonlight) emits the demo's exact law,
with a negative control."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from demo_helpers import chisquare_pvalue, demo_prompts, exact_demo_laws
from draft_helpers import first_draft_q, lockstep

from specserve.contract.types import SamplingParams, TreeSpec
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.registry import build_proposer
from specserve.paths import demo_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NEW_TOKENS = 32


def _engines(spec: str):
    """(the demo target, or the int4-quantized demo for an int4 shape; the demo@ target), float32 on the GPU."""
    from specserve.models.scaled_demo import load_demo
    from specserve.models.scaled_int4 import quantized_demo
    from specserve.target_service.engine.engine import TargetEngine
    from specserve.target_service.factory import EngineConfig, build_engine

    wide = build_engine(EngineConfig(model=spec, device="cuda", dtype="float32", num_kv_blocks=256, cuda_graphs=False))
    model, config = load_demo(demo_checkpoint("target"), "cuda")
    if wide.model.config.quantization is not None:
        quantized_demo(model, wide.model.config)
    demo = TargetEngine(model, config, None, num_blocks=256, block_size=16, device="cuda")
    return demo, wide


@pytest.fixture(
    scope="module", params=["demo@moonlight-16b-a3b", "demo@kimi-k2.6:6"]
)  # 6 layers: float32 room for both heads
def engines(request):
    pair = _engines(request.param)
    yield request.param, pair
    del pair
    gc.collect()
    torch.cuda.empty_cache()


def _drafters(family: str, spec: str):
    return tuple(
        build_proposer(
            DrafterConfig(
                family=family,
                checkpoint=demo_checkpoint(family),
                target_checkpoint=t,
                device="cuda",
                dtype="float32",
                max_block_size=9,
            )
        )
        for t in (demo_checkpoint("target"), spec)
    )


TREE = TreeSpec(num_nodes=16, top_k=2, depth=5)


@pytest.mark.parametrize(
    "family, tree",
    [
        ("eagle3", None),
        ("eagle3", TREE),
        ("model", None),
        ("model", TREE),
        ("dflash", None),  # DFlash drafts chains
        ("dspark", None),
    ],
    ids=["eagle3-chain", "eagle3-tree", "model-chain", "model-tree", "dflash-chain", "dspark-chain"],
)
def test_full_size_scaled_drafter_proposes_the_demo_size_blocks_and_is_lossless(engines, family, tree):
    spec, pair = engines
    drafters = _drafters(family, spec)
    try:
        for prompt in demo_prompts():
            if tree is None:  # the law of a sampled drafted token: the demo-size one's, nothing past the demo's ids
                demo_q, wide_q = (first_draft_q(e, p, prompt) for e, p in zip(pair, drafters))
                torch.testing.assert_close(wide_q[: demo_q.shape[0]], demo_q, rtol=0, atol=1e-4)
                assert (wide_q[demo_q.shape[0] :] == 0).all()
            emitted = lockstep(pair, drafters, prompt, 4, NEW_TOKENS, tree)
            assert emitted == pair[1].generate_greedy(prompt, NEW_TOKENS)
    finally:
        del drafters
        gc.collect()
        torch.cuda.empty_cache()


def test_full_size_scaled_mtp_proposes_the_demo_size_chains_and_is_lossless(engines):
    """The demo's MTP layer at the target's size (models/scaled_mtp.py): its first drafted token's law the
    demo-size layer's, every chain equal and greedy speculation target-only's (K2.6 width: against the int4-quantized
    demo-size layer, as the target is against the int4-quantized demo)."""
    from specserve.models.scaled_int4 import quantize_layer_experts_

    spec, pair = engines
    drafters = _drafters("mtp", spec)
    demo = drafters[0]
    if pair[1].model.config.quantization is not None:
        quantize_layer_experts_(demo.layer.block, demo.spec.block, drafters[1].spec.block)
    try:
        for prompt in demo_prompts():
            demo_q, wide_q = (first_draft_q(e, p, prompt) for e, p in zip(pair, drafters))
            torch.testing.assert_close(wide_q[: demo_q.shape[0]], demo_q, rtol=0, atol=1e-4)
            assert (wide_q[demo_q.shape[0] :] == 0).all()
            emitted = lockstep(pair, drafters, prompt, 4, NEW_TOKENS)
            assert emitted == pair[1].generate_greedy(prompt, NEW_TOKENS)
    finally:
        del drafters, demo
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("family", ["eagle3", "model", "dflash", "dspark", "mtp"])
def test_full_size_scaled_drafter_sampled_first_verified_token_follows_the_demo(engines, family):
    """The first token a verify of the scaled drafter's sampled block emits, over many seeds, against the demo's
    exact law of that token (the scaled drafters report their q: verified with it); negative control: the law of
    the token before it is rejected."""
    spec, (_, engine) = engines
    if engine.model.config.quantization is not None:
        pytest.skip("the exact law is the float64 demo's; the int4 shape computes the int4-quantized demo")
    drafter = _drafters(family, spec)[1]
    prompt, sampling = demo_prompts(1)[0], SamplingParams(temperature=1.0, top_k=8)
    p1, p2 = exact_demo_laws(prompt, sampling)
    layers = drafter.info.hidden_layers if drafter.info.needs_hidden_states else ()
    vocab, runs = engine.model.config.vocab_size, 240
    counts = np.zeros(vocab)
    try:
        for start in range(0, runs, 40):  # 40 sessions at a time
            items = []
            for i in range(start, start + 40):
                sid, s = f"c{i}", SamplingParams(seed=7000 + i, temperature=1.0, top_k=8)
                pre = engine.prefill(sid, prompt, s, layers)
                drafter.start(sid, prompt + [pre.next_token], pre.hidden, s)
                items.append((sid, drafter.propose(sid, len(prompt) + 1, [], None, 3)))
            for (sid, block), res in zip(items, engine.verify_batch(items)):
                assert block.probs is not None
                counts[res.emitted[0]] += 1
                engine.release(sid), drafter.release(sid)
    finally:
        del drafter
        gc.collect()
        torch.cuda.empty_cache()
    expected, wrong = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
    expected[: p2.shape[0]], wrong[: p1.shape[0]] = p2, p1
    assert counts[(expected == 0).numpy()].sum() == 0, "emitted a token the target cannot sample"
    assert chisquare_pvalue(counts, expected) > 1e-3
    assert chisquare_pvalue(counts, wrong + 1e-9) < 1e-3  # negative control: another law is rejected
