"""DFlash block drafter: checkpoint round trip, one forward per block, rollback/sync."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from draft_helpers import FakeFeatures, rollback_matches_fresh
from safetensors.torch import load_file, save_file

from specserve.contract.types import SamplingParams
from specserve.draft_service.dflash import (
    DFlashConfig,
    DFlashModel,
    DFlashProposer,
    save_dflash,
)
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_errors import DrafterConfigError
from specserve.draft_service.registry import build_proposer

VOCAB, TH, LAYERS = 40, 12, (0, 2)


def random_dflash(seed=0) -> DFlashModel:
    torch.manual_seed(seed)
    cfg = DFlashConfig(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        intermediate_size=32,
        vocab_size=VOCAB,
        block_size=5,
        target_hidden_size=TH,
        target_layer_ids=LAYERS,
    )
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
    p.model.block_logits = (lambda f: lambda *a, **k: calls.append(1) or f(*a, **k))(p.model.block_logits)
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


# ---------------------------------------------------------------- shared target head (embeddings + lm_head)
TARGET_V, TARGET_H = 64, 32  # tiny_ckpt("target_moe"): qwen3_moe, hidden 32, vocab 64, untied


def shared_dflash(seed=0, hidden=TARGET_H) -> DFlashModel:
    torch.manual_seed(seed)
    cfg = DFlashConfig(
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=TARGET_V,
        block_size=4,
        target_hidden_size=TARGET_H,
        target_layer_ids=(0, 2),
        shared_target_head=True,
    )
    model = DFlashModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
    return model


def test_old_checkpoint_layout_is_unchanged(saved):
    _, path = saved
    assert "shared_target_head" not in json.loads((path / "config.json").read_text())
    names = load_file(str(path / "model.safetensors"))
    assert "embed_tokens.weight" in names and "lm_head.weight" in names


def test_shared_head_saves_without_it_and_loads_it_from_the_target(tiny_ckpt, tmp_path):
    target = tiny_ckpt("target_moe")
    t = load_file(str(target / "model.safetensors"))
    model = shared_dflash()
    assert not model.embed_tokens.weight.requires_grad and not model.lm_head.weight.requires_grad
    with torch.no_grad():  # what the trainer does: the target's tensors
        model.embed_tokens.weight.copy_(t["model.embed_tokens.weight"])
        model.lm_head.weight.copy_(t["lm_head.weight"])
    save_dflash(model, tmp_path / "d")
    saved_names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert "embed_tokens.weight" not in saved_names and "lm_head.weight" not in saved_names
    assert "norm.weight" in saved_names and "layers.1.mlp.down_proj.weight" in saved_names
    assert json.loads((tmp_path / "d" / "config.json").read_text())["shared_target_head"] is True

    p = build_proposer(
        DrafterConfig(
            family="dflash", checkpoint=tmp_path / "d", target_checkpoint=target, dtype="float32", max_block_size=4
        )
    )
    assert p.model.cfg.shared_target_head
    torch.testing.assert_close(p.model.embed_tokens.weight, t["model.embed_tokens.weight"], rtol=0, atol=0)
    torch.testing.assert_close(p.model.lm_head.weight, t["lm_head.weight"], rtol=0, atol=0)
    feats = torch.randn(7, 2 * TARGET_H)
    with torch.no_grad():
        ref = model.eval().block_logits(torch.tensor([5]), 7, model.context_kv(feats, torch.arange(7)))
        got = p.model.block_logits(torch.tensor([5]), 7, p.model.context_kv(feats, torch.arange(7)))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_shared_head_without_the_target_is_a_clear_error(tmp_path):
    save_dflash(shared_dflash(), tmp_path / "d")
    with pytest.raises(DrafterConfigError, match="shared_target_head.*give the target checkpoint"):
        build_proposer(DrafterConfig(family="dflash", checkpoint=tmp_path / "d"))


def test_shared_head_config_errors(tiny_ckpt, tmp_path):
    with pytest.raises(DrafterConfigError, match="hidden_size == target_hidden_size"):
        shared_dflash(hidden=16)
    raw = dict(random_dflash().cfg.to_dict(), shared_target_head="yes")
    with pytest.raises(DrafterConfigError, match="shared_target_head must be true or false"):
        DFlashConfig.from_dict(raw)
    save_dflash(shared_dflash(), tmp_path / "d")  # vocab 64 against a target of vocab 72
    with pytest.raises(DrafterConfigError, match=r"model.embed_tokens.weight .* shape \(72, 32\)"):
        build_proposer(
            DrafterConfig(family="dflash", checkpoint=tmp_path / "d", target_checkpoint=tiny_ckpt("draft_other_vocab"))
        )


def test_shared_head_of_a_tied_target_is_its_embeddings(tmp_path):
    from tiny_hf import save_tiny_hf

    from specserve.draft_service.dflash import read_target_head

    kw = dict(
        hidden_size=32,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=1,
        vocab_size=TARGET_V,
        tie_word_embeddings=True,
    )
    target = save_tiny_hf("llama", kw, tmp_path / "tied")
    head = read_target_head(target)
    assert head["lm_head.weight"] is head["embed_tokens.weight"]
    assert tuple(head["embed_tokens.weight"].shape) == (TARGET_V, 32)


def test_shipped_checkpoint_still_loads():
    from specserve.draft_service.dflash import read_target_head
    from specserve.paths import demo_dir

    root = demo_dir()
    if not (root / "dflash" / "config.json").is_file():
        pytest.skip("no shipped demo_model/ in this checkout")
    p = build_proposer(DrafterConfig(family="dflash", checkpoint=root / "dflash", target_checkpoint=root / "target"))
    assert p.model.cfg.shared_target_head  # the shipped drafter reads the target's embeddings and lm_head
    assert p.model.cfg.denoise_steps == 4  # drafts k = 4 in four passes (demo_model/README.md)
    head = read_target_head(root / "target")
    assert torch.equal(p.model.embed_tokens.weight, head["embed_tokens.weight"].float())
    assert torch.equal(p.model.lm_head.weight, head["lm_head.weight"].float())
    with pytest.raises(DrafterConfigError, match="give the target checkpoint"):
        build_proposer(DrafterConfig(family="dflash", checkpoint=root / "dflash"))


# ---------------------------------------------------------------- denoising passes (denoise_steps)
def test_denoise_steps_config_round_trip_and_errors(tmp_path):
    from specserve.draft_service.dflash import load_dflash

    model = random_dflash()
    assert "denoise_steps" not in model.cfg.to_dict()  # the one-pass layout, unchanged
    raw = dict(model.cfg.to_dict(), denoise_steps=3)
    assert DFlashConfig.from_dict(raw).denoise_steps == 3
    model.cfg = DFlashConfig.from_dict(raw)
    save_dflash(model, tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["denoise_steps"] == 3
    assert load_dflash(tmp_path / "d").cfg.denoise_steps == 3
    with pytest.raises(DrafterConfigError, match="denoise_steps 5 > block_size - 1 = 4"):
        DFlashConfig.from_dict(dict(raw, denoise_steps=5))
    with pytest.raises(DrafterConfigError, match="denoise_steps must be a positive int"):
        DFlashConfig.from_dict(dict(raw, denoise_steps=0))


@pytest.mark.parametrize("sampled", [False, True])
def test_denoise_passes_fix_one_token_each_then_the_rest(tmp_path, sampled):
    """denoise_steps 3, k 4: pass 1 fixes token 1, pass 2 (given token 1) token 2, pass 3 (given 1, 2)
    tokens 3 and 4; each token's q is its pass's row, recomputed here from block_logits(given=...)."""
    model = random_dflash()
    model.cfg = DFlashConfig.from_dict(dict(model.cfg.to_dict(), denoise_steps=3))
    save_dflash(model, tmp_path / "d")
    p = build_proposer(cfg_for(tmp_path / "d"))
    calls = []
    p.model.block_logits = (lambda f: lambda *a, **k: calls.append(k["given"].tolist()) or f(*a, **k))(
        p.model.block_logits
    )
    feats = FakeFeatures(VOCAB, len(LAYERS) * TH)
    seq = [1, 2, 3, 4, 5, 6]
    sampling = SamplingParams(temperature=1.0, seed=3) if sampled else SamplingParams()
    p.start("s", seq, feats.rows(seq, 0, 5), sampling)
    block = p.propose("s", 6, [], None, 4)
    t = list(block.token_ids)
    assert calls == [[], t[:1], t[:2]] and len(t) == 4
    m, kv = p.model, p.session("s").family_state.kv
    with torch.no_grad():
        rows = [
            m.block_logits(torch.tensor([6]), 5, kv, given=torch.tensor(t[:n], dtype=torch.int64)) for n in range(3)
        ]
    want = torch.stack([rows[0][0], rows[1][1], rows[2][2], rows[2][3]])  # [4, V]
    if sampled:
        torch.testing.assert_close(block.probs, torch.softmax(want.double(), -1).float(), rtol=1e-5, atol=1e-6)
    else:
        assert t == want.argmax(-1).tolist() and block.probs is None
    calls.clear()
    assert len(p.propose("s", 6, [], None, 1)) == 1 and len(calls) == 1  # k = 1: one pass


def test_serve_time_denoise_steps_override_the_checkpoint(saved):
    """DrafterConfig.denoise_steps replaces the checkpoint's pass count; beyond block_size - 1 (or < 1)
    it is a config error that names the problem."""
    _, path = saved  # a one-pass checkpoint, block 5
    p = build_proposer(cfg_for(path, denoise_steps=3))
    calls = []
    p.model.block_logits = (lambda f: lambda *a, **k: calls.append(1) or f(*a, **k))(p.model.block_logits)
    feats = FakeFeatures(VOCAB, len(LAYERS) * TH)
    seq = [1, 2, 3, 4, 5, 6]
    p.start("s", seq, feats.rows(seq, 0, 5), SamplingParams())
    assert len(p.propose("s", 6, [], None, 4)) == 4 and len(calls) == 3
    with pytest.raises(DrafterConfigError, match="denoise_steps 5 > block_size - 1 = 4"):
        build_proposer(cfg_for(path, denoise_steps=5))
    with pytest.raises(DrafterConfigError, match="denoise_steps must be >= 1"):
        cfg_for(path, denoise_steps=0)


def test_denoise_draws_follow_the_reported_q():
    """Sampled with 2 passes, token 1 is drawn from q_1 and token 2 from q_2 given token 1 (the rows the
    block reports): chi-square over 1500 sessions of one prompt, token 2 on the most common token 1."""
    from scipy.stats import chisquare

    model = random_dflash()
    model.cfg = DFlashConfig.from_dict(dict(model.cfg.to_dict(), denoise_steps=2))
    p = DFlashProposer(model.double(), cfg_for(None), LAYERS, f"size:{VOCAB}")
    feats = FakeFeatures(VOCAB, len(LAYERS) * TH)
    seq = [1, 2, 3, 4, 5, 6]
    runs, firsts, seconds, q1, q2 = 1500, [], {}, None, {}
    for i in range(runs):
        p.start(f"s{i}", seq, feats.rows(seq, 0, 5), SamplingParams(temperature=1.0, seed=i))
        block = p.propose(f"s{i}", 6, [], None, 2)
        t1, t2 = block.token_ids
        firsts.append(t1)
        seconds.setdefault(t1, []).append(t2)
        q1, q2[t1] = block.probs[0].double(), block.probs[1].double()  # q_1 is the same every time
        p.release(f"s{i}")

    def pvalue(draws, q):
        exp = q.numpy() * len(draws)
        obs = np.bincount(draws, minlength=VOCAB)
        big = exp >= 5
        obs_cells, exp_cells = np.append(obs[big], obs[~big].sum()), np.append(exp[big], exp[~big].sum())
        keep = exp_cells > 0
        return chisquare(obs_cells[keep], exp_cells[keep] * obs_cells[keep].sum() / exp_cells[keep].sum()).pvalue

    assert pvalue(firsts, q1) > 1e-3
    top = max(seconds, key=lambda t: len(seconds[t]))
    assert len(seconds[top]) >= 100 and len(set(seconds[top])) > 5
    assert pvalue(seconds[top], q2[top]) > 1e-3
    other = max(q2, key=lambda t: float((q2[t] - q2[top]).abs().sum()))  # q_2 depends on token 1 ...
    assert pvalue(seconds[top], q2[other]) < 1e-3  # ... and the test can tell the two apart
