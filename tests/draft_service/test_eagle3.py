"""EAGLE-3 head: published layout round trip, malformed heads, rollback/sync for chains and trees."""

from __future__ import annotations

import json

import pytest
import torch
from draft_helpers import FakeFeatures, rollback_matches_fresh
from eagle3_helpers import DRAFT_VOCAB, TARGET_H, TARGET_LAYERS, VOCAB, head_config, save_tiny_eagle3
from safetensors.torch import load_file, save_file

from specserve.contract.types import SamplingParams, TreeSpec
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_errors import DrafterConfigError, ProposerError
from specserve.draft_service.eagle3 import Eagle3Proposer, default_eagle3_layers
from specserve.draft_service.eagle3_head import (
    REQUIRED_TENSORS,
    save_eagle3_head,
)
from specserve.draft_service.registry import build_proposer


@pytest.fixture()
def saved(tmp_path):
    return save_tiny_eagle3(tmp_path)


def make_config(hdir, tdir, **kw):
    return DrafterConfig(
        family="eagle3", checkpoint=hdir, target_checkpoint=tdir, dtype="float64", max_block_size=6, **kw
    )


def test_saved_layout_is_the_published_one(saved):
    _, hdir, _ = saved
    names = set(load_file(str(hdir / "model.safetensors")))
    assert names == set(REQUIRED_TENSORS)
    assert json.loads((hdir / "config.json").read_text())["draft_vocab_size"] == DRAFT_VOCAB


def test_load_and_propose(saved):
    head, hdir, tdir = saved
    p = build_proposer(make_config(hdir, tdir))
    assert isinstance(p, Eagle3Proposer)
    info = p.info
    assert info.family == "eagle3" and info.needs_hidden_states and info.has_probs and info.supports_tree
    assert info.hidden_layers == default_eagle3_layers(TARGET_LAYERS) == (0, 3, 5)
    assert default_eagle3_layers(32) == (1, 15, 28)  # inputs of layers 2, 16, 29 as published
    assert info.vocab_size == VOCAB and info.vocab_hash == f"size:{VOCAB}"
    for name, ref in head.state_dict().items():  # loaded weights are the saved ones
        torch.testing.assert_close(p.head.state_dict()[name].to(ref.dtype), ref)
    feats = FakeFeatures(VOCAB, 3 * TARGET_H)
    seq = [3, 5, 7, 9, 11]
    p.start("s", seq, feats.rows(seq, 0, 4), SamplingParams(temperature=0.8, top_k=10, seed=1))
    block = p.propose("s", 5, [], None, 4)
    allowed = set((torch.arange(DRAFT_VOCAB) + head.d2t).tolist())
    assert len(block) == 4 and set(block.token_ids) <= allowed
    assert block.probs.shape == (4, VOCAB)
    torch.testing.assert_close(block.probs.sum(-1), torch.ones(4, dtype=torch.float32))
    assert float(block.probs[:, ~head.t2d].sum()) == 0.0  # q lives on the draft vocabulary
    assert all(block.probs[i, t] > 0 for i, t in enumerate(block.token_ids))
    with pytest.raises(ProposerError, match="feature width"):
        p.propose("s", 5, [1], torch.zeros(1, 7), 2)
    with pytest.raises(ProposerError, match="append_hidden has 7 rows"):
        p.propose("s", 5, [1], torch.zeros(7, 3 * TARGET_H), 2)
    assert p.session("s").ids.tolist() == seq  # a refused sync leaves the session unchanged
    assert len(p.propose("s", 5, [1], torch.zeros(1, 3 * TARGET_H), 2)) == 2


def test_non_finite_hidden_states_are_refused(saved):
    """NaN or inf target rows (a broken or hostile caller) are refused, at start and at propose;
    the session is left as it was."""
    _, hdir, tdir = saved
    p = build_proposer(make_config(hdir, tdir))
    seq = [3, 5, 7, 9, 11]
    nan_rows = torch.full((4, 3 * TARGET_H), float("nan"))
    with pytest.raises(ProposerError, match="NaN or inf"):
        p.start("s", seq, nan_rows, SamplingParams())
    p.start("s", seq, torch.zeros(4, 3 * TARGET_H), SamplingParams())
    with pytest.raises(ProposerError, match="NaN or inf"):
        p.propose("s", 5, [1], torch.full((1, 3 * TARGET_H), float("inf")), 2)
    assert p.session("s").ids.tolist() == seq


def test_malformed_head_names_the_missing_tensor(saved, tmp_path):
    _, hdir, tdir = saved
    tensors = load_file(str(hdir / "model.safetensors"))
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(hdir / "model.safetensors"))
    with pytest.raises(DrafterConfigError, match="midlayer.hidden_norm.weight"):
        build_proposer(make_config(hdir, tdir))
    cfg = head_config()
    del cfg["draft_vocab_size"]
    (hdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterConfigError, match="draft_vocab_size"):
        build_proposer(make_config(hdir, tdir))


def test_embeddings_from_head_when_present(saved, tmp_path):
    head, _, _ = saved
    hdir = tmp_path / "with_emb"
    save_eagle3_head(head, hdir, with_embeddings=True)
    p = build_proposer(DrafterConfig(family="eagle3", checkpoint=hdir, hidden_layers=(0, 1, 2)))
    assert p.info.hidden_layers == (0, 1, 2)
    torch.testing.assert_close(p.head.embed_tokens.weight, head.embed_tokens.weight)
    with pytest.raises(DrafterConfigError, match="embed_tokens"):
        build_proposer(DrafterConfig(family="eagle3", checkpoint=tmp_path / "head", hidden_layers=(0, 1, 2)))


@pytest.mark.parametrize(
    "tree,sampled",
    [
        (None, True),
        (None, False),
        (TreeSpec(num_nodes=10, top_k=3, depth=4), False),
        (TreeSpec(num_nodes=10, top_k=3, depth=4), True),
    ],
)
def test_rollback_matches_fresh_drafter(saved, tree, sampled):
    _, hdir, tdir = saved
    cfg = make_config(hdir, tdir)
    feats = FakeFeatures(VOCAB, 3 * TARGET_H)
    loaded = build_proposer(cfg)

    def make():  # a fresh proposer (own sessions and caches) sharing the loaded head
        return Eagle3Proposer(loaded.head, loaded.info.hidden_layers, cfg, loaded.info.vocab_hash)

    rollback_matches_fresh(make, feats, VOCAB, tree=tree, sampled=sampled, steps=8)


def test_sampled_tree_declares_draws_without_replacement(saved):
    _, hdir, tdir = saved
    p = build_proposer(make_config(hdir, tdir))
    feats = FakeFeatures(VOCAB, 3 * TARGET_H)
    seq = [1, 2, 3, 4]
    p.start("s", seq, feats.rows(seq, 0, 3), SamplingParams(temperature=1.0, seed=3))
    block = p.propose("s", 4, [], None, 0, TreeSpec(num_nodes=12, top_k=3, depth=3))
    assert len(block) == 12 and block.probs.shape == (12, VOCAB)
    for i, parent in enumerate(block.parents):
        earlier = [j for j in range(i) if block.parents[j] == parent]
        assert len({block.token_ids[j] for j in earlier + [i]}) == len(earlier) + 1  # distinct siblings
        for j in earlier:  # an earlier sibling is excluded from a later sibling's declared q
            assert float(block.probs[i, block.token_ids[j]]) == 0.0
        assert float(block.probs[i, block.token_ids[i]]) > 0.0
