"""The per-request loop with the real engine and real drafters in one process.

Greedy: every policy (fixed, adaptive, draft-ahead) and every drafter failure mode gives the
target-only tokens. Sampled: a two-sample contingency chi-square of one emitted token, speculative vs
target-only, with a negative control (target-only at another temperature) the same test rejects.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest
import torch
from stats_helpers import two_sample_pvalue

from specserve.contract.types import DraftBlock, GenerationRequest, SamplingParams
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.registry import build_proposer
from specserve.loop.adaptive import AdaptiveConfig, AdaptiveSpeculation
from specserve.loop.local import LocalDraft, LocalTarget
from specserve.loop.probing import ProbePolicy
from specserve.loop.step_loop import FinalEvent, run_request
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


def test_two_sample_test_rejects_samples_of_different_laws():
    """The test itself: equal laws pass, a law with 5% of its mass moved to one token fails."""
    rng = np.random.default_rng(0)
    law = np.array([0.3, 0.25, 0.2, 0.15, 0.1])
    shifted = law * 0.95 + np.eye(5)[4] * 0.05
    same = [Counter(rng.choice(5, 4000, p=law).tolist()) for _ in range(2)]
    assert two_sample_pvalue(*same) > 1e-3
    assert two_sample_pvalue(same[0], Counter(rng.choice(5, 4000, p=shifted).tolist())) < 1e-3


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """A small dense draft LM with the target's vocabulary and random weights (its drafts are often refused)."""
    from tiny_hf import save_tiny_hf

    config = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return save_tiny_hf("llama", config, tmp_path_factory.mktemp("draft") / "llama", seed=1)


def _model(checkpoint):
    return build_proposer(DrafterConfig(family="model", checkpoint=checkpoint, max_block_size=8))


def _cheap_drafting(max_k: int = 4) -> AdaptiveSpeculation:
    """A chooser that has seen drafting cost nothing and verify cost 1 s whatever its size: it drafts
    full blocks (real CPU timings, a few ms, then hardly move the fits)."""
    spec = AdaptiveSpeculation(AdaptiveConfig(max_k=max_k))
    for _ in range(40):
        for n in range(1, max_k + 2):
            spec.cost.observe(n, 0, 1000.0)
    spec.cost.fit()
    return spec


@pytest.mark.parametrize("adaptive,draft_ahead", [(False, False), (True, False), (False, True), (True, True)])
def test_greedy_output_is_target_only_output_under_every_policy(engine, adaptive, draft_ahead):
    base = _generate(engine, None, GenerationRequest(PROMPT, max_new_tokens=24))
    request = GenerationRequest(
        PROMPT, max_new_tokens=24, num_speculative_tokens=4, adaptive=adaptive, draft_ahead=draft_ahead
    )
    steps = []
    spec = _generate(engine, _ngram(), request, AdaptiveSpeculation(AdaptiveConfig(max_k=4)), steps)
    assert spec.token_ids == base.token_ids and len(base.token_ids) == 24
    assert spec.stats.steps == len(steps) and sum(s.drafted for s in steps) > 0
    assert engine.kv_usage().used_blocks == 0


def test_adaptive_draft_ahead_drafts_and_reports_its_contention(engine, tiny_target_dir):
    """Regression (H200 bench: adaptive + draft-ahead verified 0 tokens on every step). With drafting
    worth it, adaptive + draft-ahead drafts, uses ahead blocks, and the verify steps that drafted
    ahead meanwhile reach the cost model as such; greedy output stays the target's."""
    base = _generate(engine, None, GenerationRequest(PROMPT, max_new_tokens=24))
    spec = _cheap_drafting()
    request = GenerationRequest(PROMPT, max_new_tokens=24, num_speculative_tokens=4, adaptive=True, draft_ahead=True)
    steps = []
    out = _generate(engine, _model(tiny_target_dir), request, spec, steps)
    assert out.token_ids == base.token_ids
    assert all(s.drafted > 0 for s in steps[:-1]) and out.stats.draft_ahead_hits > 0
    assert any(s.ahead for s in steps) and not any(s.ahead for s in steps if s.drafted == 0)
    assert spec.cost.observed_ahead > 0 and spec.ahead_hit_rate > 0.5


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
    assert spec.stats.draft_fallback == (mode in ("raise", "nan"))  # a q that is no distribution: target-only


class _LyingQ:
    """Negative control: a real model drafter with the target's own weights drafting greedily (the
    target's argmax) while claiming a uniform q, so min(1, p/q) accepts the argmax almost always when
    the loop trusts q."""

    def __init__(self, inner) -> None:
        self.inner, self.info = inner, inner.info

    def start(self, sid, ids, hidden, sampling):
        return self.inner.start(sid, ids, hidden, SamplingParams())

    def release(self, sid):
        return self.inner.release(sid)

    def propose(self, sid, prefix_len, ids, hidden, k, tree=None):
        block = self.inner.propose(sid, prefix_len, ids, hidden, k, tree)
        return DraftBlock(token_ids=block.token_ids, probs=torch.full((len(block), 256), 1 / 256))


def test_sampled_output_follows_the_target_distribution_with_adaptive_speculation(engine, tiny_target_dir):
    """Two-sample chi-square on the 3rd emitted token: spec decoding (adaptive, ngram drafts) vs
    target-only sampling with other seeds. Negative control: the same drafts with a lying q, trusted,
    are told apart by the same test at the same sample size; untrusted (proposal-only), they are not."""
    sampling = lambda seed: SamplingParams(temperature=1.5, top_k=6, seed=seed)  # noqa: E731
    adaptive = AdaptiveSpeculation(AdaptiveConfig(max_k=4))
    n = 400

    async def sample() -> dict[str, Counter]:
        target, draft, liar = LocalTarget(engine), LocalDraft(_ngram()), LocalDraft(_LyingQ(_model(tiny_target_dir)))
        out = {name: Counter() for name in ("ref", "spec", "lie_trusted", "lie_untrusted")}
        try:
            for i in range(n):
                r = await _final(target, None, GenerationRequest(PROMPT, 3, sampling(10_000 + i)))
                s = await _final(target, draft, GenerationRequest(PROMPT, 3, sampling(i), adaptive=True), adaptive)
                lt = await _final(target, liar, GenerationRequest(PROMPT, 3, sampling(20_000 + i)))
                lu = await _final(
                    target, liar, GenerationRequest(PROMPT, 3, sampling(30_000 + i), trust_draft_probs=False)
                )
                for name, final in (("ref", r), ("spec", s), ("lie_trusted", lt), ("lie_untrusted", lu)):
                    out[name][final.token_ids[2]] += 1
        finally:
            target.close()
            draft.close()
            liar.close()
        return out

    got = asyncio.run(sample())
    ref, spec = got["ref"], got["spec"]
    assert two_sample_pvalue(got["lie_trusted"], ref) < 0.001, (dict(got["lie_trusted"]), dict(ref))
    assert two_sample_pvalue(got["lie_untrusted"], ref) > 0.001, (dict(got["lie_untrusted"]), dict(ref))
    assert two_sample_pvalue(spec, ref) > 0.001, (dict(spec), dict(ref))


def _sampled_5th_tokens(engine, checkpoint, adaptive, n: int, **request) -> tuple[Counter, Counter, list]:
    """The 5th emitted token of n target-only requests and of n adaptive ones (``request``: more
    GenerationRequest fields) with a model drafter of ``checkpoint``, seeds apart; and the adaptive ones' stats."""
    sampling = lambda seed: SamplingParams(temperature=1.2, top_k=6, seed=seed)  # noqa: E731
    pos = 4

    async def sample() -> tuple[Counter, Counter, list]:
        target, draft = LocalTarget(engine), LocalDraft(_model(checkpoint))
        ref, spec, stats = Counter(), Counter(), []
        try:
            for i in range(n):
                r = await _final(target, None, GenerationRequest(PROMPT, pos + 1, sampling(10_000 + i)))
                s = await _final(
                    target, draft, GenerationRequest(PROMPT, pos + 1, sampling(i), adaptive=True, **request), adaptive
                )
                ref[r.token_ids[pos]] += 1
                spec[s.token_ids[pos]] += 1
                stats.append(s.stats)
        finally:
            target.close()
            draft.close()
        return ref, spec, stats

    return asyncio.run(sample())


@pytest.mark.parametrize("drafter", ["other", "target"])
def test_sampled_output_is_lossless_with_adaptive_draft_ahead_and_a_model_drafter(
    engine, other_model_dir, tiny_target_dir, drafter
):
    """Chi-square on the 5th emitted token: adaptive + draft-ahead with a model drafter that sends
    probabilities (its q feeds the calibration; ahead blocks are truncated) vs target-only sampling.
    "other" (random weights): drafts often refused; "target" (the target's own weights): drafts always
    accepted, so ahead blocks are used whenever the bonus token matches the ahead guess."""
    adaptive = _cheap_drafting()
    checkpoint = other_model_dir if drafter == "other" else tiny_target_dir
    ref, spec, stats = _sampled_5th_tokens(engine, checkpoint, adaptive, 150, draft_ahead=True)
    assert sum(s.draft_ahead_hits for s in stats) > 0 or drafter == "other"  # ahead blocks were used
    assert adaptive.calibration.trials.sum() > 0  # q of verified blocks reached the calibration
    assert two_sample_pvalue(spec, ref) > 0.001, (dict(spec), dict(ref))


def test_sampled_output_is_lossless_while_adaptive_skips_and_probes(engine, tiny_target_dir):
    """Chi-square on the 5th emitted token with speculation off but for a probe every 3rd step (shared by the
    requests, so a probe may be a request's first draft: a lazy start) and the target's own weights drafting
    (probes accepted): the drafter catches up on skipped steps and sampled output keeps the target's law."""
    adaptive = AdaptiveSpeculation(AdaptiveConfig(max_k=4, probe=ProbePolicy(min_interval=2, max_interval=2)))
    for _ in range(adaptive.config.draft_window):  # drafting is measured ruinous, k settled
        for k in (1, 4):
            adaptive.observe_draft(k, 1e4)
    ref, spec, stats = _sampled_5th_tokens(engine, tiny_target_dir, adaptive, 150)
    assert adaptive.probing.probes >= 150 and sum(s.accepted for s in stats) > 75  # probes were made and accepted
    assert all(set(s.chosen_k) <= {0, 1} for s in stats)
    assert two_sample_pvalue(spec, ref) > 0.001, (dict(spec), dict(ref))


def test_generate_cli_tree_flags(tiny_target_dir, capsys):
    """`generate --tree-nodes` drafts trees with the model drafter (lossless); a chain-only drafter is refused."""
    import json

    from specserve.cli.main import main

    flags = [
        "generate",
        "--model",
        str(tiny_target_dir),
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-new-tokens",
        "16",
        "--json",
    ]
    assert main(flags) == 0
    base = json.loads(capsys.readouterr().out)
    tree = ["--draft", "model", "--draft-model", str(tiny_target_dir), "--tree-nodes", "6", "--tree-depth", "3"]
    assert main(flags + tree) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == base["token_ids"] and out["stats"]["mean_accepted_length"] > 1.0
    assert main(flags + ["--draft", "ngram", "--tree-nodes", "6"]) == 2
    assert "drafts trees" in capsys.readouterr().err


def test_generate_cli_tiny_temperature_decodes_as_greedy(tiny_target_dir, capsys):
    """`generate --temperature 1e-40` (valid, below float32's normal range) gives the greedy tokens,
    with a drafter that sends q too; it printed a NaN traceback before."""
    import json

    from specserve.cli.main import main

    flags = [
        "generate",
        "--model",
        str(tiny_target_dir),
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-new-tokens",
        "8",
        "--json",
        "--draft",
        "model",
        "--draft-model",
        str(tiny_target_dir),
    ]
    assert main(flags) == 0
    greedy = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(flags + ["--temperature", "1e-40"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy
