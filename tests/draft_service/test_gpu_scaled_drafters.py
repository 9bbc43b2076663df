"""The shipped demo drafters scaled to the demo at real size (draft_service/scaled_drafters.py), on the GPU in float32
(skipped without CUDA): at full size each scaled drafter proposes the demo-size drafter's blocks (chains and trees)
at every step, its function is the demo-size one's padded, and greedy speculation through it gives target-only's
tokens; Moonlight's shape, and K2.6's width (there the reference is the int4-quantized demo, as the target is)."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from draft_helpers import lockstep

from specserve.contract.types import TreeSpec
from specserve.draft_service.proposer import DrafterConfig
from specserve.draft_service.registry import build_proposer
from specserve.paths import demo_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCALED_FAMILIES = ("eagle3",)
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


@pytest.mark.parametrize("family", SCALED_FAMILIES)
@pytest.mark.parametrize("tree", [None, TreeSpec(num_nodes=16, top_k=2, depth=5)], ids=["chain", "tree"])
def test_full_size_scaled_drafter_proposes_the_demo_size_blocks_and_is_lossless(engines, family, tree):
    spec, pair = engines
    drafters = _drafters(family, spec)
    if tree is not None and not drafters[0].info.supports_tree:
        pytest.skip(f"{family} drafts no trees")
    for prompt in _prompts():
        emitted = lockstep(pair, drafters, prompt, 4, NEW_TOKENS, tree)
        assert emitted == pair[1].generate_greedy(prompt, NEW_TOKENS)
