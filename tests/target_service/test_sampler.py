"""Verification rules: lossless rejection sampling (chi-square), greedy acceptance, p transforms, seeds.

The world: a vocabulary of 8 tokens, a Markov target p(x | previous token) and a different Markov
drafter q(x | previous token). A step drafts a chain or tree after the pending token, the sampler
verifies it, and (when the step emitted only one token) a second step drafts from the new pending
token. The joint law of the first two emitted tokens must be p(a | s0) p(b | a).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specserve.contract.types import DraftBlock, SamplingParams
from specserve.models.probs import make_generator, target_probs
from specserve.target_service.engine.sampler import (
    align_draft_probs,
    verify_greedy,
    verify_sampled,
    verify_step,
)
from specserve.target_service.engine.tree import StepLayout, layout_of

V = 8
S0 = 3  # pending token
N = 50_000  # trials per case: the 5% control below still fails with p < 1e-30


def _world(seed: int):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(V, V, generator=g) * 1.5  # [prev, next]
    draft_logits = target_logits + torch.randn(V, V, generator=g) * 1.2  # correlated, not equal
    return target_logits, draft_logits


def _draft(layout: StepLayout, prev0: torch.Tensor, draft_p: torch.Tensor, mode: str, gen):
    """Draft the layout's nodes for each row. Returns tokens [R, n] and q [R, n, V] (None = one-hot)."""
    rows = prev0.shape[0]
    n = layout.num_nodes - 1
    tok = torch.empty(rows, layout.num_nodes, dtype=torch.long)
    tok[:, 0] = prev0
    qs = torch.zeros(rows, n, V)
    used = {}  # parent node -> [R, V] mask of tokens already drawn for its children
    for j in range(1, layout.num_nodes):
        par = layout.parents[j]
        q = draft_p[tok[:, par]]  # [R, V]
        if mode == "iid":  # siblings drawn independently from the parent's q
            x = torch.multinomial(q, 1, generator=gen).squeeze(1)
        elif mode == "no_replacement":  # siblings drawn without replacement; q_j excludes earlier ones
            mask = used.setdefault(par, torch.zeros(rows, V, dtype=torch.bool))
            q = q.masked_fill(mask, 0.0)
            q = q / q.sum(1, keepdim=True)
            x = torch.multinomial(q, 1, generator=gen).squeeze(1)
            mask[torch.arange(rows), x] = True
        elif mode == "topk":  # deterministic: the k-th most likely token for the k-th sibling
            rank = layout.children[par].index(j)
            x = q.argsort(1, descending=True)[:, rank]
        else:
            raise AssertionError(mode)
        tok[:, j] = x
        qs[:, j - 1] = q
    return tok[:, 1:], (None if mode == "topk" else qs), tok


def _ancestor_at_depth(layout: StepLayout, node: torch.Tensor, d: int) -> torch.Tensor:
    par = torch.tensor(layout.parents[:1] + layout.parents[1:], dtype=torch.long).clamp_min(0)
    depth = torch.tensor(layout.depth)
    for _ in range(max(layout.depth)):
        node = torch.where(depth[node] > d, par[node], node)
    return node


def _step(layout, prev0, target_logits, draft_p, params, mode, verifier, gen):
    tokens, q, all_tok = _draft(layout, prev0, draft_p, mode, gen)
    p = target_probs(target_logits[all_tok.reshape(-1)], params).reshape(prev0.shape[0], -1, V)
    last, nxt = verifier(layout, tokens, p, q, gen)
    return all_tok, last, nxt


def _first_two_emitted(layout, target_logits, draft_p, params, mode, verifier, seed):
    gen = torch.Generator().manual_seed(seed)
    prev0 = torch.full((N,), S0, dtype=torch.long)
    all_tok, last, nxt = _step(layout, prev0, target_logits, draft_p, params, mode, verifier, gen)
    depth = torch.tensor(layout.depth)[last]
    ar = torch.arange(N)
    e1 = torch.where(depth >= 1, all_tok[ar, _ancestor_at_depth(layout, last, 1)], nxt)
    e2 = torch.where(depth >= 2, all_tok[ar, _ancestor_at_depth(layout, last, 2)], nxt)
    again = depth == 0  # only the recovered token was emitted: run the next step from it
    a_tok, a_last, a_nxt = _step(layout, e1[again], target_logits, draft_p, params, mode, verifier, gen)
    a_depth = torch.tensor(layout.depth)[a_last]
    e2[again] = torch.where(
        a_depth >= 1, a_tok[torch.arange(a_tok.shape[0]), _ancestor_at_depth(layout, a_last, 1)], a_nxt
    )
    return e1, e2, (depth.float().mean().item())


def _chisquare_pvalue(e1, e2, target_logits, params) -> float:
    p = target_probs(target_logits, params).double()  # [prev, next]
    expected = (p[S0][:, None] * p).reshape(-1) * len(e1)  # joint of (e1, e2)
    observed = torch.bincount(e1 * V + e2, minlength=V * V).double()
    if observed[expected == 0].sum() > 0:
        return 0.0  # emitted a token pair the target gives zero probability
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def _biased_5pct(layout, tokens, p, q, gen):
    """Negative control: in 5% of the steps accept every drafted token without the test."""
    last, nxt = verify_sampled(layout, tokens, p, q, gen)
    skip = torch.rand(tokens.shape[0], generator=gen) < 0.05
    leaf = tokens.shape[1]  # last node of a chain / of the tree's last branch
    bonus = torch.multinomial(p[:, leaf], 1, generator=gen).squeeze(1)
    return torch.where(skip, leaf, last), torch.where(skip, bonus, nxt)


CHAIN = layout_of(DraftBlock(token_ids=(0, 0, 0)))
#  pending -> {1, 2, 3}; 1 -> {4, 5}; 2 -> {6}; 4 -> {7}
TREE = layout_of(DraftBlock(token_ids=(0,) * 7, parents=(-1, -1, -1, 0, 0, 1, 3)))
SAMPLED = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)

CASES = [
    ("chain-q", CHAIN, SAMPLED, "iid"),
    ("chain-onehot", CHAIN, SAMPLED, "topk"),
    ("chain-filtered", CHAIN, FILTERED, "iid"),
    ("tree-iid", TREE, SAMPLED, "iid"),
    ("tree-no-replacement", TREE, SAMPLED, "no_replacement"),
    ("tree-topk-onehot", TREE, SAMPLED, "topk"),
    ("tree-filtered", TREE, FILTERED, "no_replacement"),
]


@pytest.mark.parametrize("name,layout,params,mode", CASES, ids=[c[0] for c in CASES])
def test_rejection_sampling_is_lossless(name, layout, params, mode):
    target_logits, draft_logits = _world(7)
    draft_p = torch.softmax(draft_logits / max(params.temperature, 1e-6), dim=-1)
    e1, e2, mean_accepted = _first_two_emitted(layout, target_logits, draft_p, params, mode, verify_sampled, 11)
    assert 0.3 < mean_accepted < layout.num_nodes - 1  # the case exercises both acceptance and rejection
    pval = _chisquare_pvalue(e1, e2, target_logits, params)
    assert pval > 1e-3
    # power: the same test rejects a sampler that skips the acceptance test in 5% of steps
    e1b, e2b, _ = _first_two_emitted(layout, target_logits, draft_p, params, mode, _biased_5pct, 11)
    pval_biased = _chisquare_pvalue(e1b, e2b, target_logits, params)
    print(f"{name}: p={pval:.3g} biased p={pval_biased:.3g} mean accepted={mean_accepted:.2f}")
    assert pval_biased < 1e-3


def test_greedy_chain_and_tree_follow_argmax():
    g = torch.Generator().manual_seed(0)
    for layout in (CHAIN, TREE, layout_of(DraftBlock(token_ids=(0,) * 6, parents=(-1, 0, 0, 1, -1, 4)))):
        n = layout.num_nodes - 1
        rows = 2000
        tokens = torch.randint(0, 2, (rows, n), generator=g)
        argmax = torch.randint(0, 2, (rows, n + 1), generator=g)
        last, nxt = verify_greedy(layout, tokens, argmax)
        for r in range(rows):
            node = 0
            while True:  # reference: first child whose token is the argmax at the current node
                kids = [c for c in layout.children[node] if tokens[r, c - 1] == argmax[r, node]]
                if not kids:
                    break
                node = kids[0]
            assert last[r] == node and nxt[r] == argmax[r, node]


def test_target_probs_transforms():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = target_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.7311, 0.2689, 0, 0, 0]]), atol=1e-4)
    full = torch.softmax(logits, -1)[0]  # [0.574, 0.211, 0.128, 0.078, 0.029]
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))  # needs 3 tokens to reach 0.8
    assert torch.allclose(p[0], torch.cat([full[:3] / full[:3].sum(), torch.zeros(2)]), atol=1e-6)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.1))  # the top token always stays
    assert torch.equal(p[0], torch.tensor([1.0, 0, 0, 0, 0]))
    p = target_probs(logits, SamplingParams())
    assert torch.equal(p[0], torch.tensor([1.0, 0, 0, 0, 0]))
    q = align_draft_probs(torch.ones(2, 3) / 3, 5)
    assert q.shape == (2, 5) and torch.equal(q[:, 3:], torch.zeros(2, 2))


def test_seed_reproduces_and_greedy_needs_no_generator():
    target_logits, draft_logits = _world(3)
    logits = target_logits[torch.tensor([S0, 1, 2, 4, 5, 6, 7, 0])]
    block = DraftBlock(token_ids=(1, 2, 4, 5, 6, 7, 0), parents=(-1, -1, -1, 0, 0, 1, 3))
    lay = layout_of(block)
    tokens = torch.tensor(block.token_ids)
    q = torch.softmax(draft_logits[:7], -1)
    params = SamplingParams(temperature=1.0, seed=5)
    runs = [verify_step(lay, tokens, logits, q, params, make_generator(5)) for _ in range(2)]
    assert runs[0] == runs[1]
    many = {verify_step(lay, tokens, logits, q, params, make_generator(s)) for s in range(40)}
    assert len(many) > 1
    path, nxt = verify_step(lay, tokens, logits, None, SamplingParams(), None)
    assert nxt == int(logits[lay.path_to(path[-1] if path else 0)[-1]].argmax())
    with pytest.raises(ValueError, match="generator"):
        verify_step(lay, tokens, logits, q, params, None)


# ------------------------------------------------------------------------ the bonus token (issue #19)
CHAIN1 = layout_of(DraftBlock(token_ids=(0,)))


def _bonus_from_q(layout, tokens, p, q, gen):
    """Deliberate bug: a fully accepted chain's bonus drawn from the last drafted position's q."""
    last, nxt = verify_sampled(layout, tokens, p, q, gen)
    n = tokens.shape[1]
    wrong = torch.multinomial(q[:, n - 1], 1, generator=gen).squeeze(1)
    return last, torch.where(last == n, wrong, nxt)


def _bonus_one_node_early(layout, tokens, p, q, gen):
    """Deliberate bug: a fully accepted chain's bonus drawn from p one node early."""
    last, nxt = verify_sampled(layout, tokens, p, q, gen)
    n = tokens.shape[1]
    wrong = torch.multinomial(p[:, n - 1], 1, generator=gen).squeeze(1)
    return last, torch.where(last == n, wrong, nxt)


def _chain_emitted(n: int, target_logits, draft_p, params, verifier, seed: int, count: int) -> torch.Tensor:
    """The first ``count`` emitted tokens of N independent runs drafting n-token chains (iid q), steps
    repeated until each run emitted ``count``: [N, count]."""
    layout = layout_of(DraftBlock(token_ids=(0,) * n))
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((N, count), -1, dtype=torch.long)
    filled = torch.zeros(N, dtype=torch.long)
    prev = torch.full((N,), S0, dtype=torch.long)
    while bool((filled < count).any()):
        act = torch.nonzero(filled < count).squeeze(1)
        all_tok, last, nxt = _step(layout, prev[act], target_logits, draft_p, params, "iid", verifier, gen)
        for j in range(n + 1):  # j-th token this step emitted: drafted j (accepted) or the next token
            tok = torch.where(j < last, all_tok[:, min(j + 1, n)], nxt)
            pos = filled[act] + j
            ok = (j <= last) & (pos < count)
            out[act[ok], pos[ok]] = tok[ok]
        filled[act] += last + 1
        prev[act] = nxt
    return out


def _pair_pvalue(a: torch.Tensor, b: torch.Tensor, first: torch.Tensor, trans: torch.Tensor) -> float:
    """Chi-square of the observed pairs (a, b) against the law first(a) trans(a, b)."""
    expected = (first[:, None] * trans).reshape(-1) * len(a)
    observed = torch.bincount(a * V + b, minlength=V * V).double()
    if observed[expected == 0].sum() > 0:
        return 0.0
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize("n", [1, 3])
def test_bonus_of_a_fully_accepted_chain_follows_the_target(n):
    """The token after a fully accepted chain (1 token, and a 3-token chain read to its end) follows
    p at the last drafted token: the pair (emitted n, emitted n + 1) has the law
    (P^n)[s0](a) p(b | a). Both deliberate bugs (bonus from the last q, bonus from p one node early)
    are rejected by the same test."""
    target_logits, draft_logits = _world(7)
    draft_p = torch.softmax(draft_logits, dim=-1)
    trans = target_probs(target_logits, SAMPLED).double()  # [prev, next]
    first = torch.linalg.matrix_power(trans, n)[S0]  # law of emitted token n
    out = _chain_emitted(n, target_logits, draft_p, SAMPLED, verify_sampled, 5, n + 1)
    assert _pair_pvalue(out[:, n - 1], out[:, n], first, trans) > 1e-3
    for bug in (_bonus_from_q, _bonus_one_node_early):
        bad = _chain_emitted(n, target_logits, draft_p, SAMPLED, bug, 5, n + 1)
        assert _pair_pvalue(bad[:, n - 1], bad[:, n], first, trans) < 1e-3, bug.__name__


def test_tiny_temperatures_decode_and_never_give_nan():
    """Temperatures that overflow float32 logits (1e-37) still give a distribution (one-hot at the
    argmax); below the smallest normal float32 (1e-40, 1e-45) the request decodes as greedy."""
    logits = torch.tensor([[50.0, 49.0, -3.0, 0.0]])
    for t in (1e-30, 1e-37):
        p = target_probs(logits, SamplingParams(temperature=t))
        assert torch.isfinite(p).all() and torch.equal(p[0], torch.tensor([1.0, 0, 0, 0]))
    for t in (1e-40, 1e-45):
        params = SamplingParams(temperature=t)
        assert params.greedy
        layout = layout_of(DraftBlock(token_ids=(0,)))
        assert verify_step(layout, torch.tensor([0]), logits.repeat(2, 1), None, params, None) == (
            (1,),
            0,
        )  # node 1 accepted


def _on_cuda(verifier):
    """The verifier run on the GPU (the engine's device-side rule): rows, p and q moved to CUDA, draws from a CUDA
    generator seeded from the CPU one, results back on the CPU for the same chi-square."""

    def run(layout, tokens, p, q, gen):
        cuda_gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
        last, nxt = verifier(layout, tokens.cuda(), p.cuda(), None if q is None else q.cuda(), cuda_gen)
        return last.cpu(), nxt.cpu()

    return run


def _biased_5pct_any_device(layout, tokens, p, q, gen):
    """_biased_5pct with its own draws on the rows' device."""
    last, nxt = verify_sampled(layout, tokens, p, q, gen)
    skip = torch.rand(tokens.shape[0], generator=gen, device=tokens.device) < 0.05
    leaf = tokens.shape[1]
    bonus = torch.multinomial(p[:, leaf], 1, generator=gen).squeeze(1)
    return torch.where(skip, leaf, last), torch.where(skip, bonus, nxt)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,layout,params,mode", CASES, ids=[c[0] for c in CASES])
def test_rejection_sampling_on_the_gpu_is_lossless(name, layout, params, mode):
    """The same chi-square and negative control with acceptance, residual and bonus drawn on the GPU."""
    target_logits, draft_logits = _world(7)
    draft_p = torch.softmax(draft_logits / max(params.temperature, 1e-6), dim=-1)
    e1, e2, _ = _first_two_emitted(layout, target_logits, draft_p, params, mode, _on_cuda(verify_sampled), 13)
    assert _chisquare_pvalue(e1, e2, target_logits, params) > 1e-3
    e1b, e2b, _ = _first_two_emitted(
        layout, target_logits, draft_p, params, mode, _on_cuda(_biased_5pct_any_device), 13
    )
    assert _chisquare_pvalue(e1b, e2b, target_logits, params) < 1e-3


def test_a_seeded_generator_is_keyed_by_the_targets_secret():
    """#33: a seeded request's draws come from an HMAC of its seed under the target's key: the same key
    and seed give the same stream, another key (or the bare seed, as before) another; a pinned key must
    be hex of >= 16 bytes."""
    from specserve.models.probs import derive_seed, make_generator, seed_key_from_hex

    a, b = b"a" * 32, b"b" * 32
    draw = lambda gen: torch.rand(8, generator=gen)  # noqa: E731
    assert torch.equal(draw(make_generator(7, key=a)), draw(make_generator(7, key=a)))
    assert not torch.equal(draw(make_generator(7, key=a)), draw(make_generator(7, key=b)))
    assert not torch.equal(draw(make_generator(7, key=a)), draw(torch.Generator().manual_seed(7)))
    assert derive_seed(a, 7) != derive_seed(a, 8) and 0 <= derive_seed(a, 2**64 - 1) < 2**63
    assert seed_key_from_hex("ab" * 16) == b"\xab" * 16
    for bad, why in (("zz", "not hex"), ("ab" * 8, "at least 16")):
        with pytest.raises(ValueError, match=why):
            seed_key_from_hex(bad)
