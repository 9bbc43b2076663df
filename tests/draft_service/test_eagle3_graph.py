"""EAGLE-3 greedy chains as CUDA graphs (draft_service/eagle3_graph.py) against the eager chain (GPU only).

In float32 both paths compute the same function, so on the shipped demo (target + EAGLE-3 head) every drafted block
must be the same: the speculative outputs equal target-only greedy, and the per-step acceptance of the graph path
equals the eager path's step for step.
"""

from __future__ import annotations

import pytest
import torch

from specserve.draft_service.proposer import DrafterConfig
from specserve.draft_service.registry import build_proposer
from specserve.gateway.stats import SpecStats
from specserve.paths import demo_checkpoint
from specserve.target_service.factory import EngineConfig, build_engine
from specserve.train.acceptance import speculative_greedy


def _acceptance(stats: SpecStats) -> dict:
    """What a drafter decides (steps, drafted and accepted per position), without the timings."""
    return {k: v for k, v in stats.as_dict().items() if not k.endswith("_s")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eagle3_chain_graphs_draft_what_the_eager_chain_drafts():
    target = demo_checkpoint("target")
    engine = build_engine(EngineConfig(model=target, device="cuda", dtype="float32", cuda_graphs=False))
    proposers = {
        window: build_proposer(DrafterConfig("eagle3", checkpoint=demo_checkpoint("eagle3"), target_checkpoint=target,
                                             device="cuda", dtype="float32", max_block_size=4, graph_window=window))
        for window in (0, 1024)
    }
    assert proposers[0].chain_graphs is None and proposers[1024].chain_graphs is not None
    tok = engine.tokenizer
    prompts = [tok.encode(t).ids for t in ("def parse_args(argv):\n", "class Stack:\n    def push(self, x):", "import os\n")]
    for i, prompt in enumerate(prompts):
        want = engine.generate_greedy(prompt, 40)
        per_step = {}
        for window, proposer in proposers.items():
            stats = SpecStats()
            got = speculative_greedy(engine, proposer, f"p{i}-{window}", prompt, 4, 40, stats)
            assert got[:40] == want, f"window {window}: speculative output differs from target-only"
            per_step[window] = _acceptance(stats)
        assert per_step[1024] == per_step[0]
        assert per_step[0]["mean_accepted_length"] > 1.0  # the head drafts something the target keeps


def test_static_window_passes_match_the_eager_chain_on_cpu():
    """The graph's passes (fixed window, masks from device scalars, keys written in place) run eagerly here: the
    same drafted blocks as the eager chain, step for step (runs in CI)."""
    from specserve.draft_service.eagle3_graph import Eagle3ChainGraphs

    target = demo_checkpoint("target")
    engine = build_engine(EngineConfig(model=target))
    eager = build_proposer(DrafterConfig("eagle3", checkpoint=demo_checkpoint("eagle3"), target_checkpoint=target,
                                         max_block_size=4))
    windowed = build_proposer(DrafterConfig("eagle3", checkpoint=demo_checkpoint("eagle3"), target_checkpoint=target,
                                            max_block_size=4))
    assert eager.chain_graphs is None  # CPU: no graphs unless given
    windowed.chain_graphs = Eagle3ChainGraphs(windowed.head, windowed.d2t_ids, window=256, k_max=4)
    prompt = engine.tokenizer.encode("def parse_args(argv):\n").ids
    per_step = {}
    for name, proposer in (("eager", eager), ("windowed", windowed)):
        stats = SpecStats()
        speculative_greedy(engine, proposer, name, prompt, 4, 32, stats)
        per_step[name] = _acceptance(stats)
    assert per_step["windowed"] == per_step["eager"]
    assert per_step["eager"]["mean_accepted_length"] > 1.0
