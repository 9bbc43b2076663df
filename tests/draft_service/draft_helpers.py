"""Shared test helpers: fake target features and a random-accept driver for rollback/sync tests."""

from __future__ import annotations

import random

import torch

from specserve.contract.types import DraftBlock, SamplingParams


class FakeFeatures:
    """Deterministic 'target hidden rows': row j depends only on (token_j, j), like a real target's
    rows depend only on the prefix."""

    def __init__(self, vocab: int, width: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, width, generator=g, dtype=torch.float64)

    def rows(self, ids, start: int, end: int) -> torch.Tensor:  # [end - start, width]
        idx = torch.as_tensor(list(ids[start:end]), dtype=torch.int64)
        scale = 1.0 + 0.01 * torch.arange(start, end, dtype=torch.float64)[:, None]
        return (self.table[idx] * scale).float()


def block_tokens(block: DraftBlock) -> tuple:
    return (block.token_ids, block.parents)


def rollback_matches_fresh(make, feats, vocab, tree=None, steps=12, k=4, seed=0, sampled=True):
    """Drive one long-lived session with random accept patterns (including a replaced last token);
    after every step a fresh proposer started on the same S must propose the same block. Sampled
    mode reseeds both sessions' generators alike each step, so tokens AND q must agree."""
    rnd = random.Random(seed)
    sampling = SamplingParams(temperature=1.0, seed=0) if sampled else SamplingParams()
    live = make()
    needs = live.info.needs_hidden_states
    seq = [rnd.randrange(vocab) for _ in range(rnd.randint(3, 9))]
    live.start("s", seq, feats.rows(seq, 0, len(seq) - 1) if needs else None, sampling)
    rows_from, prefix, append = 0, len(seq), []
    for step in range(steps):
        hid = feats.rows(seq, rows_from, len(seq) - 1) if needs and append else None
        live.session("s").generator.manual_seed(step)
        block = live.propose("s", prefix, append, hid, k, tree)
        fresh = make()
        fresh.start("f", seq, feats.rows(seq, 0, len(seq) - 1) if needs else None, sampling)
        fresh.session("f").generator.manual_seed(step)
        want = fresh.propose("f", len(seq), [], None, k, tree)
        assert block_tokens(block) == block_tokens(want), f"step {step}: {block} != {want}"
        if block.probs is not None:
            torch.testing.assert_close(block.probs, want.probs, atol=1e-5, rtol=1e-4)
        fresh.release("f")
        # the target accepts a random root-to-node path (chain: a random prefix), then one more token
        if block.parents is None:
            accepted = list(block.token_ids[: rnd.randint(0, len(block))])
        else:
            node, accepted = rnd.randint(-1, len(block) - 1), []
            while node != -1:
                accepted.insert(0, block.token_ids[node])
                node = block.parents[node]
        nxt, roll = rnd.randrange(vocab), rnd.random()
        if roll < 0.25 or step == 1:  # a deeper rollback: the last 1..3 tokens of S are replaced
            back = rnd.randint(1, min(3, len(seq) - 2))
            append = [rnd.randrange(vocab) for _ in range(back)] + [nxt]
            rows_from, prefix = len(seq) - back - 1, len(seq) - back
            seq = seq[:prefix] + append
            continue
        if block.parents is None and roll < 0.6:  # count accepted drafted tokens into the prefix
            rows_from, prefix, append = len(seq) - 1, len(seq) + len(accepted), [nxt]
        else:
            rows_from, prefix, append = len(seq) - 1, len(seq), accepted + [nxt]
        seq = seq + accepted + [nxt]
    live.release("s")
    assert live.active_sessions == 0
