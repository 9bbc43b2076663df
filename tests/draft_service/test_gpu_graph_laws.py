"""The captured graph drafters' sampled draws follow the q they report (GPU only, float32, the shipped demo): token 1
follows q_1, token 2 on the most common token 1 follows q_2 given it, and the q_2 of another token 1 is rejected (the
negative control: the check can fail). The captured graphs draw with Exp(1) noise (graph_sampling.py), not the eager
chains' multinomial, so this is their law checked where they run."""

from __future__ import annotations

import pytest
import torch
from draft_helpers import check_two_draws_follow_q

from specserve.contract.types import SamplingParams
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.registry import build_proposer
from specserve.paths import demo_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def engine():
    from specserve.target_service.factory import EngineConfig, build_engine

    return build_engine(EngineConfig(model=demo_checkpoint("target"), device="cuda", dtype="float32"))


@pytest.mark.parametrize("family", ["eagle3", "model", "dflash"])
def test_captured_sampled_draws_follow_their_q(engine, family):
    proposer = build_proposer(
        DrafterConfig(
            family,
            checkpoint=demo_checkpoint(family),
            target_checkpoint=demo_checkpoint("target"),
            device="cuda",
            dtype="float32",
            max_block_size=4,
        )
    )
    graphs = proposer.chain_graphs if family != "dflash" else proposer.block_graphs
    assert graphs is not None and graphs.captured > 0 and graphs.capture_errors == {}
    prompt = engine.tokenizer.encode("def parse_args(argv):\n").ids
    layers = proposer.info.hidden_layers if proposer.info.needs_hidden_states else ()
    pre = engine.prefill("law", prompt, SamplingParams(), layers)
    engine.release("law")
    rows = pre.hidden if proposer.info.needs_hidden_states else None
    check_two_draws_follow_q(proposer, list(prompt) + [pre.next_token], rows, runs=1200)
