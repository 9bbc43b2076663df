"""The per-step verify length (specserve/loop/verify_length.py, wired into specserve/loop/adaptive.py and the loop's cut):
the rule against brute force over random tables, 0 when nothing is worth verifying, and in the real loop on the
shipped demo (real target engine, real DSpark proposer in process) a drafter confident in nothing runs target-only
steps, with target-only's tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch

from specserve.contract.types import GenerationRequest
from specserve.draft_service.dflash import load_block, read_config_json
from specserve.draft_service.dflash_config import read_config
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.dspark import DSparkConfig, DSparkModel, DSparkProposer
from specserve.loop.adaptive import AdaptiveConfig, AdaptiveSpeculation
from specserve.loop.local import LocalDraft, LocalTarget
from specserve.loop.step_loop import FinalEvent, run_request
from specserve.loop.verify_length import StepCosts, best_length, expected_emitted
from specserve.paths import demo_dir
from specserve.target_service.factory import EngineConfig, build_engine


def _rate(alpha, costs, k, sunk):
    return expected_emitted(alpha)[k] / costs.step_ms(k, sunk)


def test_the_rule_is_the_best_prefix_over_random_tables():
    rnd = random.Random(0)
    for _ in range(500):
        K = rnd.randint(1, 8)
        alpha = [rnd.random() for _ in range(K)]
        per_token, per_expert = rnd.uniform(0, 1), rnd.uniform(0, 2)
        verify = tuple(1.0 + per_token * k + per_expert * (1 - 0.8**k) * 10 for k in range(K + 1))  # experts: concave
        draft = (0.0,) + tuple(rnd.uniform(0, 1) * k + rnd.uniform(0, 1) for k in range(1, K + 1))
        costs = StepCosts(verify, draft, (rnd.uniform(0, 0.3), rnd.uniform(0, 0.3)))
        for sunk in (None, rnd.uniform(0, 2)):
            least = rnd.randint(0, 1)
            k = best_length(alpha, costs, sunk, least)
            best = max(_rate(alpha, costs, j, sunk) for j in range(least, K + 1))
            assert least <= k <= K and _rate(alpha, costs, k, sunk) == pytest.approx(best)


def test_nothing_worth_verifying_is_a_target_only_step_and_a_probe_verifies_one():
    costs = StepCosts((1.0, 1.3, 1.6, 1.9), (0.0, 0.2, 0.3, 0.4))
    assert best_length([0.0, 0.0, 0.0], costs) == 0  # before drafting: do not draft
    assert best_length([0.0, 0.0, 0.0], costs, sunk_ms=0.3) == 0  # drafted: verify none of it
    assert best_length([0.0, 0.0, 0.0], costs, sunk_ms=0.3, least=1) == 1
    assert best_length([1.0, 1.0, 1.0], costs, sunk_ms=0.3) == 3
    assert best_length([0.9, 0.9, 0.05], costs, sunk_ms=0.3) == 2  # the confident prefix only
    with pytest.raises(ValueError, match="K \\+ 1"):
        StepCosts((1.0, 2.0), (0.0,))


def test_cut_positions_teach_the_estimate_that_drafting_does_not_pay():
    """A step whose block was cut to nothing (confidence ~0 everywhere) lowers alpha_1 as a refusal would, so the
    choice before drafting turns to k = 0; without the cut's evidence it would stay at its prior."""
    chooser = AdaptiveSpeculation(AdaptiveConfig(max_k=4))
    for _ in range(40):
        chooser.observe_verify(0, 0, experts=10, ms=1.0, unverified=torch.zeros(4).numpy())
    assert chooser.accept.alpha[0] < 0.1
    fresh = AdaptiveSpeculation(AdaptiveConfig(max_k=4))
    for _ in range(40):
        fresh.observe_verify(0, 0, experts=10, ms=1.0)
    assert fresh.accept.alpha[0] == pytest.approx(0.6)


@pytest.fixture(scope="module")
def demo_world():
    root = demo_dir()
    if not (root / "dflash" / "config.json").is_file():
        pytest.skip("no shipped demo_model/ in this checkout")
    engine = build_engine(EngineConfig(model=root / "target", device="cpu", num_kv_blocks=256, kv_block_size=16))
    target = LocalTarget(engine)
    yield engine, target
    target.close()


def _unconfident_dspark(root):
    """A DSpark around the shipped DFlash block (one pass) whose confidence head says 0 for every token, and rightly:
    its Markov head scrambles the block's tokens (a head that said 0 of tokens the target accepts would be corrected
    by the chooser's calibration, as it should be)."""
    cfg, _ = read_config(read_config_json(root / "dflash", "dflash"))
    cfg = dataclasses.replace(cfg, denoise_steps=1)
    model = DSparkModel(
        DSparkConfig(cfg, 8), load_block(cfg, {}, root / "dflash", "cpu", torch.float32, root / "target")
    )
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.markov.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 50)
        for p in model.confidence.parameters():
            p.zero_()
        model.confidence.w_z.bias.fill_(-60.0)
    config = DrafterConfig(family="dspark", checkpoint=root / "dflash", target_checkpoint=root / "target")
    return DSparkProposer(model.eval(), config, cfg.target_layer_ids, "")


def test_a_drafter_confident_in_nothing_runs_target_only_steps(demo_world):
    """Real loop, real target, real DSpark drafter whose every confidence is 0: the chooser verifies none of its blocks
    but probes (one token each), stops asking it (its cut blocks count as refusals), and the output is target-only's.
    A chooser that always drafts (or always verifies a token, as adaptive did before the cut could reach 0) fails."""
    engine, target = demo_world
    proposer = _unconfident_dspark(demo_dir())
    calls = []
    inner = proposer.propose
    proposer.propose = lambda *a, **k: calls.append(a[4]) or inner(*a, **k)
    draft = LocalDraft(proposer)
    chooser = AdaptiveSpeculation(AdaptiveConfig(max_k=4))
    prompt = tuple(engine.tokenizer.encode("def parse_args(argv):\n    parser = argparse.").ids)
    steps = []

    async def go():
        finals = []
        for _ in range(3):
            request = GenerationRequest(prompt, max_new_tokens=40, num_speculative_tokens=4, adaptive=True)
            async for event in run_request(request, target, draft, adaptive=chooser, on_step=steps.append):
                if isinstance(event, FinalEvent):
                    finals.append(event)
        return finals

    try:
        finals = asyncio.run(go())
    finally:
        draft.close()
    want = engine.generate_greedy(list(prompt), 40)
    assert all(list(f.token_ids) == want for f in finals)
    verified = [s.drafted for s in steps if s.drafted]
    target_only = sum(1 for s in steps if s.drafted == 0)
    assert len(verified) <= chooser.probing.probes and all(k == 1 for k in verified), (verified, chooser.probing.probes)
    assert target_only >= 0.9 * len(steps), f"{target_only} target-only steps of {len(steps)}"
    assert len(calls) <= 0.25 * len(steps), f"the drafter was asked {len(calls)} times in {len(steps)} steps"


def test_a_cut_keeps_each_tokens_own_q_and_confidence():
    """The verified prefix carries the q rows and confidences of its own tokens (the target's rule needs each token's
    q), and a cut to nothing is an empty block (a target-only step)."""
    from specserve.contract.types import DraftBlock
    from specserve.loop.step_loop import truncate_chain

    q = torch.softmax(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)), -1)
    block = DraftBlock(token_ids=(3, 1, 4, 1), probs=q, confidence=(0.9, 0.5, 0.25, 0.1))
    for k in range(5):
        cut = truncate_chain(block, k)
        assert cut.token_ids == block.token_ids[:k] and cut.confidence == block.confidence[:k]
        assert cut.probs is not None and torch.equal(cut.probs, q[:k])
