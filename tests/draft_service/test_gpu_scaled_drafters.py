"""The shipped demo drafters scaled to the demo at real size (draft_service/scaled_drafters.py), on the GPU in float32
(skipped without CUDA): at full size each scaled drafter proposes the demo-size drafter's blocks (chains and trees)
at every step, its function is the demo-size one's padded, and greedy speculation through it gives target-only's
tokens; Moonlight's shape, and K2.6's width (there the reference is the int4-quantized demo, as the target is)."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from draft_helpers import first_draft_q, lockstep

from specserve.contract.types import TreeSpec
from specserve.draft_service.proposer import DrafterConfig
from specserve.draft_service.registry import build_proposer
from specserve.paths import demo_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NEW_TOKENS = 32


def _prompts(n: int = 2, length: int = 40) -> list[list[int]]:
    from specserve.models.loader import load_tokenizer

    target = demo_checkpoint("target")
    tok = load_tokenizer(target)
    return [tok.encode(t).ids[:length] for t in json.loads((target / "heldout_prompts.json").read_text())[:n]]


def _engines(spec: str):
    """(the demo target, or the int4-quantized demo for an int4 shape; the demo@ target), float32 on the GPU."""
    from specserve.models.scaled_demo import load_demo, quantized_demo
    from specserve.target_service.engine.engine import TargetEngine
    from specserve.target_service.factory import EngineConfig, build_engine

    wide = build_engine(EngineConfig(model=spec, device="cuda", dtype="float32", num_kv_blocks=256, cuda_graphs=False))
    model, config = load_demo(demo_checkpoint("target"), "cuda")
    if wide.model.config.quantization is not None:
        quantized_demo(model, wide.model.config)
    demo = TargetEngine(model, config, None, num_blocks=256, block_size=16, device="cuda")
    return demo, wide


@pytest.fixture(scope="module", params=["demo@moonlight-16b-a3b", "demo@kimi-k2.6:8"])
def engines(request):
    pair = _engines(request.param)
    yield request.param, pair
    del pair
    gc.collect()
    torch.cuda.empty_cache()


def _drafters(family: str, spec: str):
    return tuple(build_proposer(DrafterConfig(family=family, checkpoint=demo_checkpoint(family), target_checkpoint=t,
                                              device="cuda", dtype="float32", max_block_size=9))
                 for t in (demo_checkpoint("target"), spec))


TREE = TreeSpec(num_nodes=16, top_k=2, depth=5)


@pytest.mark.parametrize("family, tree", [
    ("eagle3", None), ("eagle3", TREE), ("model", None), ("model", TREE), ("dflash", None),  # DFlash drafts chains
], ids=["eagle3-chain", "eagle3-tree", "model-chain", "model-tree", "dflash-chain"])
def test_full_size_scaled_drafter_proposes_the_demo_size_blocks_and_is_lossless(engines, family, tree):
    spec, pair = engines
    drafters = _drafters(family, spec)
    try:
        for prompt in _prompts():
            if tree is None:  # the law of a sampled drafted token: the demo-size one's, nothing past the demo's ids
                demo_q, wide_q = (first_draft_q(e, p, prompt) for e, p in zip(pair, drafters))
                torch.testing.assert_close(wide_q[: demo_q.shape[0]], demo_q, rtol=0, atol=1e-4)
                assert (wide_q[demo_q.shape[0]:] == 0).all()
            emitted = lockstep(pair, drafters, prompt, 4, NEW_TOKENS, tree)
            assert emitted == pair[1].generate_greedy(prompt, NEW_TOKENS)
    finally:
        del drafters
        gc.collect()
        torch.cuda.empty_cache()
