"""DFlash training pieces on small random tensors (no trained checkpoint): the batched block forward
against the proposer's, the greedy-chain mask, chain anchors, given tokens and the arch flags. The CLI
runs of the DFlash trainer are in test_train.py."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("shared", [False, True])
def test_batched_dflash_blocks_match_the_proposer_forward(shared):
    from specserve.train.draft_dflash import DFlashSpec, blocks_logits, build_dflash

    torch.manual_seed(0)

    class _T:  # the target fields build_dflash reads (embeddings, lm_head and norm only when shared)
        class config:
            vocab_size, hidden_size = 50, 8

        class model:
            embed_tokens, norm = torch.nn.Embedding(50, 8), torch.nn.LayerNorm(8)

        lm_head = torch.nn.Linear(8, 50, bias=False)

    spec = DFlashSpec(
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        intermediate_size=24,
        block_size=4,
        shared_target_head=shared,
    )
    model = build_dflash(_T, spec, (0, 1)).eval()
    assert model.cfg.hidden_size == (8 if shared else 16)
    if shared:
        assert torch.equal(model.lm_head.weight, _T.lm_head.weight) and not model.lm_head.weight.requires_grad
    ids = torch.randint(0, 50, (2, 12))
    feats = torch.randn(2, 12, 16)
    anchors = torch.tensor([[1, 5, 8], [2, 4, 8]])
    given = torch.tensor([[0, 2, 1], [1, 0, 2]])  # true tokens a+1..a+m in place of the first m masks
    with torch.no_grad():
        batched = blocks_logits(model, ids, feats, anchors)  # [2, 3, b, V]
        with_given = blocks_logits(model, ids, feats, anchors, given)
        for g in range(2):
            for j, a in enumerate(anchors[g].tolist()):
                ctx = model.context_kv(feats[g, :a], torch.arange(a))
                ref = model.block_logits(ids[g, a : a + 1], a, ctx)
                torch.testing.assert_close(batched[g, j], ref, rtol=1e-4, atol=1e-4)
                m = int(given[g, j])
                ref = model.block_logits(ids[g, a : a + 1], a, ctx, given=ids[g, a + 1 : a + 1 + m])
                torch.testing.assert_close(with_given[g, j], ref, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(with_given[0, 1], batched[0, 1])  # the given tokens change the block


def test_dflash_shared_target_head_arch_flag():
    from specserve.train.common import TrainError, apply_arch
    from specserve.train.draft_dflash import DFlashSpec

    assert DFlashSpec().shared_target_head is False  # the default: the drafter's own head
    assert apply_arch(DFlashSpec(), {"shared_target_head": "1"}).shared_target_head is True
    with pytest.raises(TrainError, match="shared_target_head must be 0 or 1"):
        apply_arch(DFlashSpec(), {"shared_target_head": "2"})


def test_dflash_chain_labels_arch_flag():
    from specserve.train.common import TrainError, apply_arch
    from specserve.train.draft_dflash import DFlashSpec

    assert apply_arch(DFlashSpec(), {"chain_labels": "1"}).chain_labels is True
    with pytest.raises(TrainError, match="chain_labels must be 0 or 1"):
        apply_arch(DFlashSpec(), {"chain_labels": "3"})


def test_greedy_chain_mask_follows_the_targets_argmax_chain():
    """Output i of a block at anchor a is on the chain iff tokens a+1..a+i each equal the target's argmax
    at the position before; checked against a plain loop on fresh random data."""
    from specserve.train.draft_dflash import greedy_chain_mask

    gen = torch.Generator().manual_seed(3)
    G, T, V, A, b = 3, 40, 5, 7, 4  # a small vocabulary so that chains of several tokens occur
    ids = torch.randint(0, V, (G, T), generator=gen)
    probs = torch.rand(G, T, V, generator=gen).softmax(-1)
    greedy = probs.argmax(-1)
    ids[0, 11:16] = greedy[0, 10:15]  # one long chain from anchor 10
    anchors = torch.randint(1, T - b + 1, (G, A), generator=gen)
    anchors[0, 0] = 10
    idx = anchors[:, :, None] + torch.arange(b)
    got = greedy_chain_mask(ids, greedy, idx)
    assert got.dtype == torch.bool and got.shape == (G, A, b)
    for g in range(G):
        for j in range(A):
            a = int(anchors[g, j])
            for i in range(b):
                want = all(int(ids[g, a + m]) == int(greedy[g, a + m - 1]) for m in range(1, i + 1))
                assert bool(got[g, j, i]) == want, (g, a, i)
    assert got[0, 0].all()  # the planted chain
    assert got[..., 0].all() and not got.all()  # output 0 always counts; random tokens break chains


def test_chain_anchors_land_on_full_greedy_chain_blocks():
    """With chain_anchors=1 every anchor of a sequence that has a full greedy-chain block starts one
    (checked with a plain loop); a sequence without any draws uniformly; the share splits the anchors."""
    from specserve.train.common import TrainError
    from specserve.train.draft_dflash import DFlashSpec, sample_anchors

    gen = torch.Generator().manual_seed(4)
    G, T, V, b = 3, 50, 7, 4
    ids = torch.randint(0, V, (G, T), generator=gen)
    greedy = torch.randint(0, V, (G, T), generator=gen)
    ids[0, 21:27] = greedy[0, 20:26]  # a chain: full chain blocks at anchors 20..23
    ids[1, 1:] = (greedy[1, :-1] + 1) % V  # no chain token ...
    ids[1, 31:34] = greedy[1, 30:33]  # ... but tokens 31..33: exactly one full chain block, anchor 30
    ids[2, 1:] = (greedy[2, :-1] + 1) % V  # none
    spec = DFlashSpec(block_size=b, anchors=200, chain_anchors=1.0)
    anchors = sample_anchors(gen, ids, greedy, spec)
    assert anchors.shape == (G, 200) and anchors.min() >= 1 and anchors.max() <= T - b

    def full_chain(g, a):
        return all(int(ids[g, a + m]) == int(greedy[g, a + m - 1]) for m in range(1, b))

    chains = [{a for a in range(1, T - b + 1) if full_chain(g, a)} for g in range(G)]
    assert {20, 21, 22, 23} <= chains[0] and chains[1] == {30} and not chains[2]
    assert set(anchors[0].tolist()) == chains[0]  # 200 draws reach each of a few blocks
    assert set(anchors[1].tolist()) == {30}
    assert len(set(anchors[2].tolist())) > 20
    half = sample_anchors(gen, ids, greedy, DFlashSpec(block_size=b, anchors=200, chain_anchors=0.5))
    assert (half[1, 100:] == 30).all() and (half[1, :100] != 30).sum() > 80  # uniform half, chain half
    with pytest.raises(TrainError, match=r"chain_anchors must be in \[0, 1\]"):
        DFlashSpec(chain_anchors=1.5)


def test_given_tokens_chain_mask_and_loss():
    """With m given tokens, output i needs only the unseen tokens a+m+1..a+i on the chain (a plain loop
    on random data), and the loss does not read the labels of outputs i < m (their answers are given)."""
    import torch.nn.functional as F

    from specserve.train.common import TrainError
    from specserve.train.draft_dflash import (
        DFlashSpec,
        block_loss,
        build_dflash,
        greedy_chain_mask,
    )

    gen = torch.Generator().manual_seed(6)
    G, T, V, A, b = 2, 30, 4, 9, 4
    ids = torch.randint(0, V, (G, T), generator=gen)
    probs = torch.rand(G, T, V, generator=gen).softmax(-1)
    greedy = probs.argmax(-1)
    anchors = torch.randint(1, T - b + 1, (G, A), generator=gen)
    given = torch.randint(0, 3, (G, A), generator=gen)
    idx = anchors[:, :, None] + torch.arange(b)
    got = greedy_chain_mask(ids, greedy, idx, given)
    for g in range(G):
        for j in range(A):
            a, m = int(anchors[g, j]), int(given[g, j])
            for i in range(b):
                want = all(int(ids[g, a + n]) == int(greedy[g, a + n - 1]) for n in range(m + 1, i + 1))
                assert bool(got[g, j, i]) == want, (g, a, m, i)

    class _T:
        class config:  # noqa: N801 - mimics a transformers config
            hidden_size, vocab_size = 16, V

    model = build_dflash(
        _T,
        DFlashSpec(
            hidden_size=16,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_dim=8,
            intermediate_size=24,
            block_size=b,
            given_tokens=2,
        ),
        (0,),
    ).eval()
    assert model.cfg.denoise_steps == 3
    feats = torch.randn(G, T, 16, generator=gen)
    all_given = torch.full((G, A), 2)
    only_first = torch.zeros(G, T, dtype=torch.bool)  # label positions of output 0 alone (never asked)
    only_first.scatter_(1, idx[..., 0], True)
    only_first.scatter_(1, idx[..., 1:].reshape(G, -1), False)
    assert only_first.any()
    sharper = 0.5 * probs + 0.5 * F.one_hot(greedy, V)  # other labels there, the same argmax
    bumped = torch.where(only_first[..., None], sharper, probs)
    with torch.no_grad():
        losses = [block_loss(model, ids, feats, p, greedy, anchors, 0.8, True, all_given)[0] for p in (probs, bumped)]
    torch.testing.assert_close(losses[0], losses[1])
    with pytest.raises(TrainError, match="given_tokens must be in 0..block_size - 2"):
        DFlashSpec(block_size=4, given_tokens=3)


def test_dflash_chain_labels_loss_ignores_off_chain_blocks():
    """With chain_labels the loss does not depend on the labels of off-chain outputs; without, it does."""
    from specserve.train.draft_dflash import (
        DFlashSpec,
        block_loss,
        build_dflash,
        greedy_chain_mask,
    )

    class _T:
        class config:  # noqa: N801 - mimics a transformers config
            hidden_size, vocab_size = 16, 11

    spec = DFlashSpec(
        hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24, block_size=3
    )
    torch.manual_seed(0)
    model = build_dflash(_T, spec, (0,)).eval()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 11, (2, 20), generator=gen)
    feats = torch.randn(2, 20, 16, generator=gen)
    probs = torch.rand(2, 20, 11, generator=gen).softmax(-1)
    anchors = torch.randint(1, 18, (2, 6), generator=gen)
    idx = anchors[:, :, None] + torch.arange(3)
    chain = greedy_chain_mask(ids, probs.argmax(-1), idx)
    off = idx[~chain]  # label positions used only by off-chain outputs
    on = set(idx[chain].tolist())
    off = sorted(set(off.tolist()) - on)
    assert off, "the random data should break some chains"
    bumped = probs.clone()
    bumped[:, off] = bumped[:, off].flip(-1)  # other labels there, same argmax chain elsewhere
    assert greedy_chain_mask(ids, bumped.argmax(-1), idx).equal(chain)  # same chains
    with torch.no_grad():
        masked = [
            block_loss(model, ids, feats, p, p.argmax(-1), anchors, 0.8, chain_labels=True)[0] for p in (probs, bumped)
        ]
        plain = [block_loss(model, ids, feats, p, p.argmax(-1), anchors, 0.8)[0] for p in (probs, bumped)]
    torch.testing.assert_close(masked[0], masked[1])
    assert not torch.allclose(plain[0], plain[1])
