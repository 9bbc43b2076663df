"""Tree layout: depths, positions, ancestor mask, paths, compaction moves."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.contract.types import DraftBlock
from specserve.target_service.engine.tree import StepLayout, compaction_moves, layout_of


def test_chain_layout_is_causal():
    lay = layout_of(DraftBlock(token_ids=(5, 6, 7)))
    assert lay.is_chain and lay.num_nodes == 4
    assert lay.depth == (0, 1, 2, 3)
    assert lay.positions(10) == [10, 11, 12, 13]
    assert torch.equal(lay.attention_mask(), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert lay.path_to(3) == (0, 1, 2, 3)
    assert compaction_moves(lay.path_to(3)) == ([], [])


def test_tree_layout():
    #        pending(0)
    #       /    |     \
    #     1(a)  2(b)   5(e)
    #     / \     \
    #   3(c) 4(d)  6(f)
    #              |
    #              7(g)
    blk = DraftBlock(token_ids=(1, 2, 3, 4, 5, 6, 7), parents=(-1, -1, 0, 0, -1, 1, 5))
    lay = layout_of(blk)
    assert not lay.is_chain
    assert lay.parents == (-1, 0, 0, 1, 1, 0, 2, 6)
    assert lay.depth == (0, 1, 1, 2, 2, 1, 2, 3)
    assert lay.children[0] == (1, 2, 5) and lay.children[2] == (6,) and lay.children[7] == ()
    assert lay.positions(4) == [4, 5, 5, 6, 6, 5, 6, 7]
    assert lay.path_to(7) == (0, 2, 6, 7)
    assert lay.path_to(0) == (0,)
    m = lay.attention_mask()
    expect = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 5}, 6: {0, 2, 6}, 7: {0, 2, 6, 7}}
    for i, anc in expect.items():
        assert {j for j in range(8) if m[i, j]} == anc
    assert compaction_moves((0, 2, 6, 7)) == ([2, 6, 7], [1, 2, 3])
    assert compaction_moves((0, 1, 4)) == ([4], [2])


def test_compaction_moves_are_safe_sequentially_and_gathered():
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(1, 12)
        parents = tuple(rng.randint(-1, i - 1) for i in range(n))
        lay = layout_of(DraftBlock(token_ids=tuple(range(n)), parents=parents))
        node = rng.randint(0, n)
        path = lay.path_to(node)
        src, dst = compaction_moves(path)
        buf = list(range(n + 1))
        for s, d in zip(src, dst):
            buf[d] = buf[s]
        assert buf[: len(path)] == list(path)
        t = torch.arange(n + 1)
        t[torch.tensor(dst, dtype=torch.long)] = t[torch.tensor(src, dtype=torch.long)]
        assert t[: len(path)].tolist() == list(path)


def test_bad_layout_rejected():
    with pytest.raises(ValueError):
        StepLayout(parents=(0,), depth=(0,), children=((),), is_chain=True)
    with pytest.raises(ValueError):
        StepLayout(parents=(-1, 1), depth=(0, 1), children=((), ()), is_chain=False)
    with pytest.raises(ValueError):
        DraftBlock(token_ids=(1, 2), parents=(-1, 1))
    with pytest.raises(IndexError):
        layout_of(DraftBlock(token_ids=(1,))).path_to(2)
