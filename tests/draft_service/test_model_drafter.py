"""`model` drafter: vocabulary refusal, q = the sampling distribution, rollback/sync (chains, trees)."""

from __future__ import annotations

import pytest
import torch
from draft_helpers import FakeFeatures, rollback_matches_fresh

from specserve.contract.types import SamplingParams, TreeSpec
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_errors import ProposerError, VocabMismatchError
from specserve.draft_service.model_drafter import ModelProposer
from specserve.draft_service.registry import build_proposer
from specserve.models.probs import target_probs


def config(tiny_ckpt, draft="draft_llama", **kw):
    kw = dict(dict(dtype="float64", kv_num_blocks=64), **kw)
    return DrafterConfig(
        family="model",
        checkpoint=tiny_ckpt(draft),
        target_checkpoint=tiny_ckpt("target_moe"),
        max_block_size=6,
        kv_block_size=4,
        **kw,
    )


def test_info_and_vocab_refusal(tiny_ckpt):
    p = build_proposer(config(tiny_ckpt))
    assert isinstance(p, ModelProposer)
    assert p.info.family == "model" and p.info.has_probs and p.info.supports_tree
    assert not p.info.needs_hidden_states and p.info.vocab_size == 64
    assert p.info.vocab_hash.startswith("sha256:")
    with pytest.raises(VocabMismatchError, match="does not match the target"):
        build_proposer(config(tiny_ckpt, draft="draft_other_vocab"))


def test_sampled_probs_are_the_distribution_drawn_from(tiny_ckpt):
    """q of drafted token 1 = the target sampler's transform of the draft model's own logits."""
    sampling = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=0)
    p = build_proposer(config(tiny_ckpt))
    seq = [5, 9, 2, 33, 7]
    p.start("s", seq, None, sampling)
    block = p.propose("s", len(seq), [], None, 3)
    assert block.probs.shape == (3, 64) and block.probs.dtype == torch.float32
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt("draft_llama"), dtype=torch.float64)
    with torch.no_grad():
        logits = hf(torch.tensor([seq + list(block.token_ids[:2])])).logits[0, len(seq) - 1 :]
    want = target_probs(logits, sampling).float()
    torch.testing.assert_close(block.probs, want, atol=1e-5, rtol=1e-4)
    assert all(int((row > 0).sum()) <= 5 for row in block.probs)  # top-k applied
    assert all(block.probs[i, t] > 0 for i, t in enumerate(block.token_ids))
    greedy = build_proposer(config(tiny_ckpt))
    greedy.start("g", seq, None, SamplingParams())
    g = greedy.propose("g", len(seq), [], None, 1)
    assert g.probs is None and g.token_ids == (int(logits[0].argmax()),)


@pytest.mark.parametrize(
    "draft,tree,sampled,steps",
    [
        ("draft_llama", None, True, 10),
        ("draft_llama", TreeSpec(num_nodes=9, top_k=3, depth=4), False, 6),
        ("draft_llama", TreeSpec(num_nodes=9, top_k=3, depth=4), True, 6),
        ("draft_moe", None, True, 5),
    ],
)
def test_rollback_matches_fresh_drafter(tiny_ckpt, draft, tree, sampled, steps):
    from specserve.models.loader import load_model

    cfg = config(tiny_ckpt, draft=draft)
    model, mcfg = load_model(cfg.checkpoint, dtype=torch.float64, progress=False)
    info = build_proposer(cfg).info

    def make():  # a fresh proposer (own cache and sessions) sharing the loaded weights
        return ModelProposer(model, mcfg, cfg, info.vocab_size, info.vocab_hash)

    rollback_matches_fresh(make, FakeFeatures(64, 4), 64, tree=tree, steps=steps, sampled=sampled)


def test_cache_full_is_a_clear_error(tiny_ckpt):
    p = build_proposer(config(tiny_ckpt, kv_num_blocks=2))  # 8 token slots
    p.start("s", list(range(6)), None, SamplingParams())
    with pytest.raises(ProposerError, match="KV cache is full"):
        p.propose("s", 6, [1, 2, 3, 4], None, 3)
    p.release("s")
    assert p.blocks.num_free_blocks == 2
