"""The target's log-probabilities of emitted and prompt tokens (LogprobsSpec): speculation gives the target-only
path's to 1e-5 in float32, chains, trees and batches alike; prompt logprobs are the same numbers again."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.contract.types import DraftBlock, LogprobsSpec, SamplingParams
from specserve.models.loader import load_model
from specserve.target_service.engine.engine import TargetEngine

PROMPT = [5, 17, 99, 3, 250, 42, 7]
TOP = 3


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    model, config = load_model(tiny_checkpoint("qwen3_moe"), progress=False)
    return TargetEngine(model, config, num_blocks=256, block_size=4)


def _target_only(eng, n: int, sampling=SamplingParams()):
    """(emitted ids, their logprobs) decoding one token per step."""
    pre = eng.prefill("ref", PROMPT, sampling, (), logprobs=LogprobsSpec(TOP))
    ids, lps = [pre.next_token], [pre.logprobs]
    while len(ids) < n:
        res = eng.decode("ref")
        ids.append(res.next_token)
        lps.append(res.logprobs)
    eng.release("ref")
    return ids, [
        (lp.token_ids[i], lp.logprobs[i], lp.top_ids[i], lp.top_logprobs[i]) for lp in lps for i in range(len(lp))
    ]


def _close(got, want) -> None:
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, lp, top_ids, top_lp), (_, lp0, top_ids0, top_lp0) in zip(got, want):
        assert abs(lp - lp0) <= 1e-5 and top_ids == top_ids0
        assert max(abs(a - b) for a, b in zip(top_lp, top_lp0)) <= 1e-5


def test_speculation_gives_the_target_only_logprobs(engine):
    ref, want = _target_only(engine, 16)
    # each emitted token's logprob is the log_softmax of the target's logits where it was drawn
    assert all(lp <= 0 and math.isfinite(lp) for _, lp, _, _ in want)
    assert all(top_lp[0] >= lp for _, lp, _, top_lp in want)  # greedy: the chosen token is the most likely
    pre = engine.prefill("s", PROMPT, SamplingParams(), (), logprobs=LogprobsSpec(TOP))
    got = [(pre.logprobs.token_ids[0], pre.logprobs.logprobs[0], pre.logprobs.top_ids[0], pre.logprobs.top_logprobs[0])]
    i = 0
    while len(got) < 14:
        a, b, c = ref[i + 1 : i + 4]
        if i == 0:  # a chain drafted right in full, then a tree with decoys, then one with a wrong token
            block = DraftBlock((a, b, c))
        elif i == 4:
            block = DraftBlock(((a + 1) % 256, a, (b + 1) % 256, b), parents=(-1, -1, 1, 1))
        else:
            block = DraftBlock((a, (b + 1) % 256))
        res = engine.verify("s", block)
        assert res.emitted == tuple(ref[i + 1 : i + 1 + len(res.emitted)])
        lp = res.logprobs
        assert lp.token_ids == res.emitted
        got += [(lp.token_ids[j], lp.logprobs[j], lp.top_ids[j], lp.top_logprobs[j]) for j in range(len(lp))]
        i += len(res.emitted)
    engine.release("s")
    _close(got, want[: len(got)])


def test_prompt_logprobs_score_each_token_where_it_stands(engine):
    ref, want = _target_only(engine, 6)
    seq = PROMPT + ref[:5]
    pre = engine.prefill("p", seq, SamplingParams(), (), logprobs=LogprobsSpec(TOP, prompt=True))
    engine.release("p")
    lp = pre.prompt_logprobs
    assert lp.token_ids == tuple(seq[1:])
    tail = [
        (lp.token_ids[j], lp.logprobs[j], lp.top_ids[j], lp.top_logprobs[j]) for j in range(len(PROMPT) - 1, len(lp))
    ]
    _close(tail, want[:5])


def test_sampled_steps_report_the_model_distribution_and_no_logprobs_unless_asked(engine):
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    _, want = _target_only(engine, 8, sampling)
    # before temperature and top-p: the numbers are the greedy run's distribution at the same tokens
    assert all(math.isfinite(lp) and lp <= 0 for _, lp, _, _ in want)
    pre = engine.prefill("n", PROMPT, SamplingParams(), ())
    res = engine.decode("n")
    engine.release("n")
    assert pre.logprobs is None and pre.prompt_logprobs is None and res.logprobs is None
    with pytest.raises(ValueError, match="logprobs: 21 alternatives"):
        LogprobsSpec(21)


def test_a_batch_gives_each_session_its_own_logprobs(engine):
    _, want = _target_only(engine, 2)
    for sid in ("x", "y"):
        engine.prefill(sid, PROMPT, SamplingParams(), (), logprobs=LogprobsSpec(TOP) if sid == "x" else None)
    x, y = engine.verify_batch([("x", DraftBlock(())), ("y", DraftBlock(()))])
    for sid in ("x", "y"):
        engine.release(sid)
    assert y.logprobs is None
    _close(
        [(x.logprobs.token_ids[0], x.logprobs.logprobs[0], x.logprobs.top_ids[0], x.logprobs.top_logprobs[0])],
        want[1:2],
    )
    assert torch.tensor(x.logprobs.top_logprobs[0]).exp().sum() <= 1 + 1e-6
