"""Batching, tree masks and slot compaction give the same logits as plain sequential feeding."""

from __future__ import annotations

import pytest
import torch

from specserve.models.loader import load_model

NAMES = ("deepseek_v3", "qwen3_moe", "mixtral", "llama")
RTOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    return {name: load_model(tiny_checkpoint(name), progress=False)[0] for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_batch_of_two_equals_separate_forwards(name, models, paged_runner):
    model = models[name]
    a, b = tokens(11, 1), tokens(6, 2)
    together = paged_runner(model)
    out = together.step([0, 1], [a, b])
    # mixed step: sequence 0 decodes one token while sequence 1 feeds three
    out2 = together.step([0, 1], [[5], [7, 8, 9]])
    alone_a, alone_b = paged_runner(model, seed=1), paged_runner(model, seed=2)
    ref_a, ref_b = alone_a.step([0], [a]), alone_b.step([0], [b])
    ref_a2, ref_b2 = alone_a.step([0], [[5]]), alone_b.step([0], [[7, 8, 9]])
    logits = together.logits(out)
    assert rel_err(logits[:11], alone_a.logits(ref_a)) < RTOL
    assert rel_err(logits[11:], alone_b.logits(ref_b)) < RTOL
    logits2 = together.logits(out2)
    assert rel_err(logits2[:1], alone_a.logits(ref_a2)) < RTOL
    assert rel_err(logits2[1:], alone_b.logits(ref_b2)) < RTOL
    if out.routed_experts is not None:
        assert torch.equal(out.routed_experts[:, :11], ref_a.routed_experts)


# a tree of 7 drafted nodes after the pending token; parents come before children
PARENTS = (-1, 0, 0, 1, 1, 2, 3)


def tree_mask(parents) -> torch.Tensor:
    n = len(parents) + 1  # node 0 of the forward = the pending token (root)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents, start=1):
        mask[i] = mask[p + 1]
        mask[i, i] = True
    return mask


def depth(parents, i: int) -> int:
    d = 0
    while i >= 0:
        d, i = d + 1, parents[i]
    return d


@pytest.mark.parametrize("name", NAMES)
def test_tree_forward_equals_feeding_the_path(name, models, paged_runner):
    model = models[name]
    prompt, pending = tokens(9, 3), 17
    drafted = tokens(len(PARENTS), 4)
    runner = paged_runner(model)
    runner.step([0], [prompt])
    ctx = runner.lens[0]
    feed = [pending, *drafted]
    positions = [ctx] + [ctx + depth(PARENTS, i) for i in range(len(PARENTS))]
    tree_out = runner.step([0], [feed], tree_masks=[tree_mask(PARENTS)], positions=[positions], commit=False)
    tree_logits = runner.logits(tree_out)

    path = [0, 1, 3, 6]  # drafted node indices from the root to a leaf
    ref = paged_runner(model, seed=5)
    ref.step([0], [prompt])
    ref_logits = [ref.logits(ref.step([0], [[pending]]))[0]]
    for node in path:
        ref_logits.append(ref.logits(ref.step([0], [[drafted[node]]]))[0])
    rows = [0] + [n + 1 for n in path]
    assert rel_err(tree_logits[rows], torch.stack(ref_logits)) < RTOL

    # accept the path: compact its cache slots to ctx+1.. and continue decoding from there
    table, bs = runner.tables[0], runner.cache.block_size
    slot = lambda p: table[p // bs] * bs + p % bs  # noqa: E731
    src = torch.tensor([slot(ctx + 1 + n) for n in path[1:]])
    dst = torch.tensor([slot(ctx + 2 + k) for k in range(len(path) - 1)])
    runner.cache.copy_slots(src, dst)
    runner.lens[0] = ctx + 1 + len(path)
    nxt = runner.logits(runner.step([0], [[42]]))[0]
    want = ref.logits(ref.step([0], [[42]]))[0]
    assert rel_err(nxt, want) < RTOL


def test_tree_nodes_see_only_their_ancestors(models, paged_runner):
    """Changing a sibling branch's token must not change another branch's logits."""
    model = models["llama"]
    prompt = tokens(5, 6)
    parents = (-1, -1)  # two children of the pending token
    mask = tree_mask(parents)
    outs = []
    for sibling in (3, 200):
        runner = paged_runner(model)
        runner.step([0], [prompt])
        c = runner.lens[0]
        out = runner.step([0], [[9, 11, sibling]], tree_masks=[mask], positions=[[c, c + 1, c + 1]], commit=False)
        outs.append(runner.logits(out))
    assert torch.equal(outs[0][:2], outs[1][:2])
    assert not torch.allclose(outs[0][2], outs[1][2])
