"""EAGLE-2 dynamic tree builder on synthetic logits: shape rules, greedy ranking, sampled draws."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from specserve.contract.types import SamplingParams, TreeSpec
from specserve.draft_service.tree import build_tree
from specserve.models.probs import target_probs

V = 12
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 2  # next-token logits per token
ROOT = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 2


def expand(tokens, parents, nodes):
    return TABLE[[tokens[n] for n in nodes]]


def path_logp(tokens, parents, i):
    lp, node = 0.0, i
    while node != -1:
        logits = ROOT if parents[node] == -1 else TABLE[tokens[parents[node]]]
        lp += float(torch.log_softmax(logits, -1)[tokens[node]])
        node = parents[node]
    return lp


def test_greedy_tree_keeps_the_best_paths():
    spec = TreeSpec(num_nodes=7, top_k=3, depth=3)
    t = build_tree(ROOT, expand, spec, SamplingParams(), torch.Generator())
    assert len(t.tokens) == 7 and t.probs is None
    assert all(-1 <= p < i for i, p in enumerate(t.parents))
    scores = [path_logp(t.tokens, t.parents, i) for i in range(7)]
    root_kids = [t.tokens[i] for i, p in enumerate(t.parents) if p == -1]
    assert root_kids[0] == int(ROOT.argmax())
    # every dropped depth-1 candidate scores below every kept node's ... own parent chain: a kept node
    # never scores above its parent, and the best root child is always kept
    for i, p in enumerate(t.parents):
        if p != -1:
            assert scores[i] <= scores[p] + 1e-6
    top3 = torch.topk(ROOT, 3).indices.tolist()
    assert set(root_kids) <= set(top3)


def test_sampled_tree_siblings_are_draws_from_their_declared_q():
    """Over many builds the first and second kept root children follow q and q-without-the-first."""
    sampling = SamplingParams(temperature=1.0, top_k=6)
    q = target_probs(ROOT[None], sampling)[0].double()
    spec = TreeSpec(num_nodes=4, top_k=3, depth=2)  # the cut keeps only part of what was drawn
    gen = torch.Generator().manual_seed(0)
    first, second, runs = np.zeros(V), np.zeros(V), 1500
    exp_second = torch.zeros(V, dtype=torch.float64)
    for _ in range(runs):
        t = build_tree(ROOT, expand, spec, sampling, gen)
        kids = [i for i, p in enumerate(t.parents) if p == -1]
        assert len(kids) >= 2 and kids == sorted(kids)
        a, b = t.tokens[kids[0]], t.tokens[kids[1]]
        first[a] += 1
        second[b] += 1
        torch.testing.assert_close(t.probs[kids[0]].double(), q, atol=1e-6, rtol=1e-5)
        want = q.clone()
        want[a] = 0
        torch.testing.assert_close(t.probs[kids[1]].double(), want / want.sum(), atol=1e-6, rtol=1e-5)
        exp_second += want / want.sum()
    keep = q.numpy() > 0
    assert first[~keep].sum() == 0
    e1 = q.numpy()[keep]
    assert chisquare(first[keep], e1 * runs / e1.sum()).pvalue > 1e-3
    e2 = exp_second.numpy()
    assert chisquare(second[keep], e2[keep] * runs / e2[keep].sum()).pvalue > 1e-3
