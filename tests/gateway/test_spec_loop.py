"""The per-request loop with the real engine and real drafters in one process.

Greedy: every policy (fixed, adaptive, draft-ahead) and every drafter failure mode gives the
target-only tokens. Sampled: the chi-square test of the emitted tokens with adaptive speculation.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.draft_service.proposer import DrafterConfig
from specserve.draft_service.registry import build_proposer
from specserve.gateway.adaptive import AdaptiveConfig, AdaptiveSpeculation
from specserve.gateway.local import LocalDraft, LocalTarget
from specserve.gateway.spec_loop import FinalEvent, GenerationRequest, run_request
from specserve.target_service.engine.types import DraftBlock, SamplingParams
from specserve.target_service.factory import EngineConfig, build_engine

PROMPT = (5, 17, 99, 5, 17, 3, 42, 7, 5, 17, 99, 5)


@pytest.fixture(scope="module")
def engine(tiny_target_dir):
    return build_engine(EngineConfig(model=tiny_target_dir, num_kv_blocks=512, kv_block_size=4))


async def _final(target, draft, request, adaptive=None, steps=None) -> FinalEvent:
    final = None
    on_step = steps.append if steps is not None else None
    async for event in run_request(request, target, draft, adaptive=adaptive, on_step=on_step):
        if isinstance(event, FinalEvent):
            final = event
    return final


def _generate(engine, proposer, request, adaptive=None, steps=None):
    async def go():
        target, draft = LocalTarget(engine), (LocalDraft(proposer) if proposer is not None else None)
        try:
            return await _final(target, draft, request, adaptive, steps)
        finally:
            target.close()
            if draft is not None:
                draft.close()

    return asyncio.run(go())


def _ngram():
    return build_proposer(DrafterConfig(family="ngram", max_block_size=8))


@pytest.mark.parametrize("adaptive,draft_ahead", [(False, False), (True, False), (False, True), (True, True)])
def test_greedy_output_is_target_only_output_under_every_policy(engine, adaptive, draft_ahead):
    base = _generate(engine, None, GenerationRequest(PROMPT, max_new_tokens=24))
    request = GenerationRequest(PROMPT, max_new_tokens=24, num_speculative_tokens=4, adaptive=adaptive, draft_ahead=draft_ahead)
    steps = []
    spec = _generate(engine, _ngram(), request, AdaptiveSpeculation(AdaptiveConfig(max_k=4)), steps)
    assert spec.token_ids == base.token_ids and len(base.token_ids) == 24
    assert spec.stats.steps == len(steps) and sum(s.drafted for s in steps) > 0
    assert engine.kv_usage().used_blocks == 0


class _Garbage:
    """A real proposer whose blocks are corrupted in the ways a broken drafter can corrupt them."""

    def __init__(self, inner, mode: str) -> None:
        self.inner, self.mode, self.info = inner, mode, inner.info

    def start(self, *a):
        return self.inner.start(*a)

    def release(self, sid):
        return self.inner.release(sid)

    def propose(self, sid, prefix_len, ids, hidden, k, tree=None):
        block = self.inner.propose(sid, prefix_len, ids, hidden, k, tree)
        if self.mode == "raise":
            raise RuntimeError("drafter crashed")
        if self.mode == "out_of_vocab":
            return DraftBlock(token_ids=(10**6,) * max(1, len(block)))
        if self.mode == "too_long":
            return DraftBlock(token_ids=(1,) * (k + 3))
        return DraftBlock(token_ids=(1,), probs=torch.full((1, 256), float("nan")))  # "nan"


@pytest.mark.parametrize("mode", ["raise", "out_of_vocab", "too_long", "nan"])
def test_broken_drafter_never_changes_greedy_output(engine, mode):
    base = _generate(engine, None, GenerationRequest(PROMPT, max_new_tokens=16))
    spec = _generate(engine, _Garbage(_ngram(), mode), GenerationRequest(PROMPT, max_new_tokens=16))
    assert spec.token_ids == base.token_ids
    assert spec.stats.draft_fallback == (mode == "raise")


def test_sampled_output_follows_the_target_distribution_with_adaptive_speculation(engine):
    """Chi-square on the 3rd emitted token: spec decoding (adaptive, ngram drafts) vs target-only sampling.

    The expected counts come from target-only runs with other seeds, so both samples are drawn from what
    the target alone would produce; tokens seen rarely are pooled into one bin.
    """
    sampling = lambda seed: SamplingParams(temperature=1.5, top_k=6, seed=seed)  # noqa: E731
    adaptive = AdaptiveSpeculation(AdaptiveConfig(max_k=4))
    n = 300

    async def sample() -> tuple[Counter, Counter]:
        target, draft = LocalTarget(engine), LocalDraft(_ngram())
        ref, spec = Counter(), Counter()
        try:
            for i in range(n):
                r = await _final(target, None, GenerationRequest(PROMPT, 3, sampling(10_000 + i)))
                s = await _final(target, draft, GenerationRequest(PROMPT, 3, sampling(i), adaptive=True), adaptive)
                ref[r.token_ids[2]] += 1
                spec[s.token_ids[2]] += 1
        finally:
            target.close()
            draft.close()
        return ref, spec

    ref, spec = asyncio.run(sample())
    common = [t for t, c in ref.items() if c >= 10]
    obs = [spec[t] for t in common] + [n - sum(spec[t] for t in common)]
    exp = [ref[t] for t in common] + [n - sum(ref[t] for t in common)]
    obs, exp = np.array(obs, dtype=float), np.array(exp, dtype=float)
    keep = exp > 0
    # two-sample comparison via the pooled frequencies
    pooled = (obs + exp) / 2
    stat = chisquare(obs[keep], pooled[keep] * obs[keep].sum() / pooled[keep].sum())
    assert stat.pvalue > 0.001, (dict(spec), dict(ref))


def test_generate_cli_tree_flags(tiny_target_dir, capsys):
    """`generate --tree-nodes` drafts trees with the model drafter (lossless); a chain-only drafter is refused."""
    import json

    from specserve.cli.main import main

    flags = ["generate", "--model", str(tiny_target_dir), "--prompt-ids", ",".join(map(str, PROMPT)),
             "--max-new-tokens", "16", "--json"]
    assert main(flags) == 0
    base = json.loads(capsys.readouterr().out)
    tree = ["--draft", "model", "--draft-model", str(tiny_target_dir), "--tree-nodes", "6", "--tree-depth", "3"]
    assert main(flags + tree) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == base["token_ids"] and out["stats"]["mean_accepted_length"] > 1.0
    assert main(flags + ["--draft", "ngram", "--tree-nodes", "6"]) == 2
    assert "drafts trees" in capsys.readouterr().err
