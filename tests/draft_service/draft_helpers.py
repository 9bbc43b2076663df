"""Shared test helpers: fake target features and a random-accept driver for rollback/sync tests."""

from __future__ import annotations

import random

import numpy as np
import torch

from specserve.contract.types import DraftBlock, SamplingParams, TreeSpec


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


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int, scale: float = 0.4) -> torch.nn.Module:
    """Every parameter of `module` drawn N(0, scale^2) from `seed` (a random drafter for tests); returns it."""
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return module


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


def check_sessions_take_turns(eager, graphs, feats, vocab: int, steps: int = 4) -> None:
    """Two sessions take turns on one graph window (each turn must copy its own rows in), greedy: every block of
    `graphs` equals `eager`'s; each step accepts the first drafted token, then one more."""
    seqs = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [9, 8, 7, 6, 5]}
    for p in (eager, graphs):
        for sid, seq in seqs.items():
            p.start(sid, seq, feats.rows(seq, 0, len(seq) - 1), SamplingParams())
    for step in range(steps):
        for sid, seq in seqs.items():
            want, got = eager.propose(sid, len(seq), [], None, 4), graphs.propose(sid, len(seq), [], None, 4)
            assert got.token_ids == want.token_ids and got.probs is want.probs is None, f"step {step} session {sid}"
            assert np.allclose(got.confidence, want.confidence, rtol=0, atol=1e-5), f"step {step} session {sid}"
            grown = seq + [want.token_ids[0], (step * 7 + len(seq)) % vocab]
            for p in (eager, graphs):
                p.propose(sid, len(seq), grown[len(seq) :], feats.rows(grown, len(seq) - 1, len(grown) - 1), 0)
            seq[:] = grown


def draws_pvalue(draws, q: torch.Tensor) -> float:
    """Chi-square p-value of token draws against q [V] (cells of < 5 expected draws pooled into one)."""
    import numpy as np
    from scipy.stats import chisquare

    exp, obs = q.double().numpy() * len(draws), np.bincount(draws, minlength=q.shape[0])
    big = exp >= 5
    obs_c, exp_c = np.append(obs[big], obs[~big].sum()), np.append(exp[big], exp[~big].sum())
    keep = exp_c > 0
    return chisquare(obs_c[keep], exp_c[keep] * obs_c[keep].sum() / exp_c[keep].sum()).pvalue


def check_two_draws_follow_q(proposer, seq, rows, runs: int) -> None:
    """Sampled 2-token blocks of ``runs`` sessions on one S: token 1 follows the reported q_1, token 2 on
    the most common token 1 follows the reported q_2 given it, and q_2 of another token 1 is told apart
    (the negative control: the test has the power to fail)."""
    firsts, seconds, q1, q2 = [], {}, None, {}
    for i in range(runs):
        proposer.start(f"q{i}", seq, rows, SamplingParams(temperature=1.0, seed=i))
        block = proposer.propose(f"q{i}", len(seq), [], None, 2)
        t1, t2 = block.token_ids
        firsts.append(t1)
        seconds.setdefault(t1, []).append(t2)
        q1, q2[t1] = block.probs[0].double(), block.probs[1].double()  # q_1 is the same every time
        proposer.release(f"q{i}")
    assert draws_pvalue(firsts, q1) > 1e-3
    top = max(seconds, key=lambda t: len(seconds[t]))
    assert len(seconds[top]) >= 100 and len(set(seconds[top])) > 3
    assert draws_pvalue(seconds[top], q2[top]) > 1e-3
    other = max(q2, key=lambda t: float((q2[t] - q2[top]).abs().sum()))  # q_2 depends on token 1 ...
    assert draws_pvalue(seconds[top], q2[other]) < 1e-3  # ... and the test tells the two apart


def paired_greedy(
    engine, verified, shadow, sid: str, prompt, k: int, max_new: int, tree: TreeSpec | None = None
) -> tuple[list[int], int, int]:
    """A greedy loop that verifies `verified`'s blocks (chains, or trees of `tree`) while `shadow` gets the same syncs
    and drafts on the same sequence each step: (emitted tokens, steps whose two blocks were equal, steps)."""
    sampling = SamplingParams()
    layers = verified.info.hidden_layers if verified.info.needs_hidden_states else ()
    pre = engine.prefill(sid, prompt, sampling, layers)
    seq, emitted = list(prompt) + [pre.next_token], [pre.next_token]
    for p in (verified, shadow):
        p.start(sid, seq, pre.hidden, sampling)
    prefix, append, hidden, same, steps = len(seq), (), None, 0, 0
    while len(emitted) < max_new:
        block = verified.propose(sid, prefix, append, hidden, k, tree)
        same += block_tokens(shadow.propose(sid, prefix, append, hidden, k, tree)) == block_tokens(block)
        steps += 1
        res = engine.verify(sid, block)
        prefix, append, hidden = len(seq), tuple(res.accepted_ids) + (res.next_token,), res.hidden
        seq.extend(append)
        emitted.extend(append)
    engine.release(sid)
    verified.release(sid)
    shadow.release(sid)
    return emitted, same, steps


def check_graphs_draft_as_eager(
    engine, graphs, eager, prompts, dtype: str, k: int = 4, max_new: int = 40, tree: TreeSpec | None = None
) -> None:
    """paired_greedy over each prompt text, the captured graphs' blocks verified, the eager proposer's beside them:
    float32: every block equal and the output = target-only; bf16 (sums round differently, near-ties may split): at
    least 90 % of the blocks equal; either way the drafts were accepted (fewer steps than tokens)."""
    same = steps = 0
    for i, text in enumerate(prompts):
        prompt = engine.tokenizer.encode(text).ids
        emitted, s, n = paired_greedy(engine, graphs, eager, f"p{i}", prompt, k, max_new, tree)
        same, steps = same + s, steps + n
        if dtype == "float32":
            assert emitted[:max_new] == engine.generate_greedy(prompt, max_new), (
                f"prompt {i}: output differs from target-only"
            )
    assert same >= (steps if dtype == "float32" else 0.9 * steps), f"{same} of {steps} blocks equal"
    assert steps < len(prompts) * (max_new - 1)  # the drafts were accepted: fewer steps than tokens


def lockstep(engines, drafters, prompt: list[int], k: int, max_new: int, tree: TreeSpec | None = None) -> list[int]:
    """Greedy speculation on both targets at once, each drafter synced from its own target: every block (and every
    verify result) equal; returns the scaled side's emitted tokens."""
    sampling = SamplingParams()
    pre = [
        e.prefill("s", prompt, sampling, p.info.hidden_layers if p.info.needs_hidden_states else ())
        for e, p in zip(engines, drafters)
    ]
    assert pre[0].next_token == pre[1].next_token
    seq = list(prompt) + [pre[0].next_token]
    for p, r in zip(drafters, pre):
        p.start("s", seq, r.hidden, sampling)
    emitted, prefix, append, hidden, steps = [pre[0].next_token], len(seq), (), (None, None), 0
    try:
        while len(emitted) < max_new:
            blocks = [p.propose("s", prefix, append, h, k, tree) for p, h in zip(drafters, hidden)]
            assert (blocks[0].token_ids, blocks[0].parents) == (blocks[1].token_ids, blocks[1].parents), steps
            assert np.allclose(blocks[0].confidence, blocks[1].confidence, rtol=0, atol=1e-4), steps
            res = [e.verify("s", b) for e, b in zip(engines, blocks)]
            assert (res[0].accepted_ids, res[0].next_token) == (res[1].accepted_ids, res[1].next_token)
            prefix, append, hidden = len(seq), (*res[1].accepted_ids, res[1].next_token), (res[0].hidden, res[1].hidden)
            seq.extend(append)
            emitted.extend(append)
            steps += 1
    finally:
        for e, p in zip(engines, drafters):
            e.release("s")
            p.release("s")
    assert steps < max_new - 1  # drafts were accepted
    return emitted[:max_new]


def first_draft_q(engine, proposer, prompt: list[int]) -> torch.Tensor:  # [V] the first drafted token's q
    """q of the token a sampled session drafts after the prompt and the target's greedy next token."""
    layers = proposer.info.hidden_layers if proposer.info.needs_hidden_states else ()
    sampling = SamplingParams(temperature=1.0, seed=0)
    pre = engine.prefill("q", prompt, SamplingParams(), layers)
    try:
        proposer.start("q", list(prompt) + [pre.next_token], pre.hidden, sampling)
        return proposer.propose("q", len(prompt) + 1, [], None, 1).probs[0]
    finally:
        engine.release("q")
        proposer.release("q")


def with_graph_bodies(proposer, window: int = 256):
    """The proposer (model / mtp) drafting chains through its (uncaptured) graph bodies, its free blocks shuffled first
    so that a session's block table is not the identity (slots must come from the table, not from the positions)."""
    proposer.chain_graphs = proposer.build_chain_graphs(window, proposer.info.max_block_size)
    holders = [object() for _ in range(4)]
    for h in holders:
        proposer.blocks.add(h, proposer.blocks.block_size)  # blocks 0, 1, 2, 3
    for i in (1, 3, 0):
        proposer.blocks.free(holders[i])  # the next sessions take 0, 3, 1, then 4, 5, ...
    return proposer


def skipped_catch_up_keys(live, eager, feats, vocab, skipped: int, k: int = 3) -> list[tuple]:
    """A drafter left `skipped` tokens behind (steps adaptive skipped; their rows sent in one call) drafts, through its
    graph bodies (`live`), the greedy block a fresh eager drafter drafts over the same S; returns the graph keys that
    propose ran (recorded from live.chain_graphs._run)."""
    rnd = random.Random(skipped)
    ran = []
    inner = live.chain_graphs._run
    live.chain_graphs._run = lambda key: (ran.append(key), inner(key))[1]
    seq = [rnd.randrange(vocab) for _ in range(5)]
    live.start("s", seq, feats.rows(seq, 0, len(seq) - 1), SamplingParams())
    live.propose("s", len(seq), [], None, k)
    before = len(seq)
    seq += [rnd.randrange(vocab) for _ in range(skipped)]
    ran.clear()
    got = live.propose("s", before, seq[before:], feats.rows(seq, before - 1, len(seq) - 1), k)
    eager.start("f", seq, feats.rows(seq, 0, len(seq) - 1), SamplingParams())
    assert got.token_ids == eager.propose("f", len(seq), [], None, k).token_ids
    return ran
