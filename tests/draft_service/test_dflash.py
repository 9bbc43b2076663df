"""DFlash block drafter: checkpoint round trip, one forward per block, rollback/sync."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_helpers import FakeFeatures, rollback_matches_fresh
from specserve.draft_service.dflash import DFlashConfig, DFlashModel, DFlashProposer, save_dflash
from specserve.draft_service.proposer import DrafterConfig, DrafterConfigError
from specserve.draft_service.registry import build_proposer
from specserve.target_service.engine.types import SamplingParams

VOCAB, TH, LAYERS = 40, 12, (0, 2)


def random_dflash(seed=0) -> DFlashModel:
    torch.manual_seed(seed)
    cfg = DFlashConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                       intermediate_size=32, vocab_size=VOCAB, block_size=5, target_hidden_size=TH,
                       target_layer_ids=LAYERS)
    model = DFlashModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
    return model


@pytest.fixture()
def saved(tmp_path):
    model = random_dflash()
    save_dflash(model, tmp_path / "dflash")
    return model, tmp_path / "dflash"


def cfg_for(path, **kw):
    return DrafterConfig(family="dflash", checkpoint=path, dtype="float64", max_block_size=8, **kw)


def test_round_trip_and_info(saved):
    model, path = saved
    p = build_proposer(cfg_for(path))
    assert isinstance(p, DFlashProposer)
    assert p.info.max_block_size == 5 and p.info.hidden_layers == LAYERS and p.info.needs_hidden_states
    assert p.info.has_probs and not p.info.supports_tree
    for name, ref in model.state_dict().items():
        torch.testing.assert_close(p.model.state_dict()[name].float(), ref)
    assert "layers.1.self_attn.q_proj.weight" in load_file(str(path / "model.safetensors"))


def test_missing_tensor_is_named(saved):
    _, path = saved
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(DrafterConfigError, match="layers.1.mlp.up_proj.weight"):
        build_proposer(cfg_for(path))


def test_block_is_one_forward_and_non_causal(saved):
    _, path = saved
    p = build_proposer(cfg_for(path))
    calls = []
    p.model.block_logits = (lambda f: (lambda *a, **k: calls.append(1) or f(*a, **k)))(p.model.block_logits)
    feats = FakeFeatures(VOCAB, len(LAYERS) * TH)
    seq = [1, 2, 3, 4, 5, 6]
    p.start("s", seq, feats.rows(seq, 0, 5), SamplingParams(temperature=1.0, seed=0))
    block = p.propose("s", 6, [], None, 5)
    assert len(calls) == 1 and len(block) == 5 and block.probs.shape == (5, VOCAB)
    # non-causal inside the block: the logits of position 0 depend on the mask queries after it
    m = p.model
    first = torch.tensor([6])
    kv = p.session("s").family_state.kv
    base = m.block_logits(first, 5, kv)
    with torch.no_grad():
        m.mask_embedding.add_(1.0)
    assert not torch.allclose(m.block_logits(first, 5, kv)[0], base[0])


def test_rollback_matches_fresh_drafter(saved):
    _, path = saved
    loaded = build_proposer(cfg_for(path))

    def make():
        return DFlashProposer(loaded.model, cfg_for(path), loaded.info.hidden_layers, loaded.info.vocab_hash)

    rollback_matches_fresh(make, FakeFeatures(VOCAB, len(LAYERS) * TH), VOCAB, steps=10, sampled=True)
    rollback_matches_fresh(make, FakeFeatures(VOCAB, len(LAYERS) * TH), VOCAB, steps=6, sampled=False, seed=1)
