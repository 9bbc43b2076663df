"""EAGLE-3's propose cost on a GPU (skipped without CUDA), the shipped demo in bfloat16 through its captured graphs,
counted the way `specserve bench draft` counts (specserve/bench/draft_profile.py: the torch profiler's kernels that
start inside a propose, torch's sync debug mode for host syncs): one host sync a propose (the block's read; before:
also the rows' finiteness check) and at most 40 kernels a drafted token at k = 4 (before: 63.5 on Moonlight's shape);
rows on the GPU with a NaN are refused by the device-side check read back with the block, and the session ends."""

from __future__ import annotations

import argparse

import pytest
import torch

from specserve.contract.types import SamplingParams
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_errors import ProposerError
from specserve.draft_service.registry import build_proposer
from specserve.paths import demo_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def demo():
    from specserve.target_service.factory import EngineConfig, build_engine

    target = demo_checkpoint("target")
    engine = build_engine(EngineConfig(model=target, device="cuda", dtype="bfloat16", num_kv_blocks=256))
    proposer = build_proposer(
        DrafterConfig(
            "eagle3",
            checkpoint=demo_checkpoint("eagle3"),
            target_checkpoint=target,
            device="cuda",
            dtype="bfloat16",
            max_block_size=4,
        )
    )
    engine.add_graph_layers(sorted(proposer.info.hidden_layers))
    assert proposer.chain_graphs is not None and not proposer.chain_graphs.capture_errors
    return engine, proposer


def test_a_propose_syncs_once_and_launches_few_kernels(demo):
    from specserve.bench.draft_profile import _counted_run, _run

    engine, proposer = demo
    prompt = engine.tokenizer.encode("def parse_args(argv):\n").ids
    args = argparse.Namespace(device="cuda", k=4, max_new_tokens=48, tree=None)
    _run(engine, proposer, "warm-up", prompt, 4, 16)
    counts = _counted_run(engine, proposer, prompt, args)
    assert counts["host_syncs_per_propose"] <= 1.1, counts  # the H200 counted 2.06 before (18 proposes)
    assert counts["kernels_per_drafted_token"] <= 40, counts


def test_non_finite_gpu_rows_are_refused_with_the_block(demo):
    engine, proposer = demo
    prompt = engine.tokenizer.encode("import os\n").ids
    pre = engine.prefill("nan", prompt, SamplingParams(), proposer.info.hidden_layers)
    try:
        seq = list(prompt) + [pre.next_token]
        proposer.start("nan", seq, pre.hidden, SamplingParams())
        assert len(proposer.propose("nan", len(seq), [], None, 4)) == 4
        rows = torch.full((1, pre.hidden.shape[1]), float("nan"), device="cuda")
        with pytest.raises(ProposerError, match="NaN or inf"):
            proposer.propose("nan", len(seq), [7], rows, 4)
        with pytest.raises(ProposerError, match="unknown session"):
            proposer.session("nan")
    finally:
        engine.release("nan")
