"""DFlash drafters in z-lab's published layout (config.json of a qwen3 ``DFlashDraftModel`` + tensors
without embeddings or head): written here with random weights, read through the same proposer.

The reference below is written from the layout's description only (issue #23), in plain float64 torch:
T = hidden_norm(fc(taps)); block = [anchor, mask ...] embedded with the target's embeddings; per layer
q from the block, k/v from concat(T, block) with q_norm / k_norm and RoPE, non-causal; the target's
lm_head(norm(.)) at block positions 1.. gives the drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draft_helpers import FakeFeatures, check_two_draws_follow_q, rollback_matches_fresh
from safetensors.torch import load_file, save_file
from tiny_hf import save_zlab_dflash as write_zlab_dflash

from specserve.contract.types import SamplingParams
from specserve.draft_service.dflash import DFlashProposer
from specserve.draft_service.dflash_config import spread_target_layers
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_errors import DrafterConfigError
from specserve.draft_service.registry import build_proposer

V, H = 64, 32  # tiny_ckpt("target_moe"): hidden 32, vocab 64, 3 layers, untied


# ---------------------------------------------------------------- the reference, from the description
def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [T, heads, D]: rotate the two halves (Qwen3)
    d = x.shape[-1]
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)[None]  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def reference_block(ckpt: Path, embed, head, feats, anchor: int, given=()):  # -> [block_size - 1, V]
    """feats [P, taps * H] for positions 0..P-1; the block starts at position P with the anchor."""
    cfg = json.loads((ckpt / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    eps, theta, b, d = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["block_size"], cfg["head_dim"]
    nh, nkv, p = cfg["num_attention_heads"], cfg["num_key_value_heads"], feats.shape[0]
    ctx = _rms(feats.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # T [P, H]
    ids = [anchor, *given] + [cfg["dflash_config"]["mask_token_id"]] * (b - 1 - len(given))
    x = embed.double()[ids]  # [b, H]
    block_pos, all_pos = torch.arange(p, p + b), torch.arange(p + b)
    for n in range(cfg["num_hidden_layers"]):
        L = {k[len(f"layers.{n}.") :]: v for k, v in w.items() if k.startswith(f"layers.{n}.")}
        hb = _rms(x, L["input_layernorm.weight"], eps)
        q = _rope(
            _rms((hb @ L["self_attn.q_proj.weight"].T).view(b, nh, d), L["self_attn.q_norm.weight"], eps),
            block_pos,
            theta,
        )
        kv_in = torch.cat([ctx, hb])  # [P + b, H]: keys and values from concat(T, block)
        k = _rope(
            _rms((kv_in @ L["self_attn.k_proj.weight"].T).view(p + b, nkv, d), L["self_attn.k_norm.weight"], eps),
            all_pos,
            theta,
        )
        v = (kv_in @ L["self_attn.v_proj.weight"].T).view(p + b, nkv, d)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d**0.5, -1)  # no mask: non-causal
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(b, nh * d) @ L["self_attn.o_proj.weight"].T
        h2 = _rms(x, L["post_attention_layernorm.weight"], eps)
        x = (
            x
            + (torch.nn.functional.silu(h2 @ L["mlp.gate_proj.weight"].T) * (h2 @ L["mlp.up_proj.weight"].T))
            @ L["mlp.down_proj.weight"].T
        )
    return (_rms(x, w["norm.weight"], eps) @ head.double().T)[1:]


@pytest.fixture()
def zlab(tiny_ckpt, tmp_path):
    target = tiny_ckpt("target_moe")
    t = load_file(str(target / "model.safetensors"))
    return write_zlab_dflash(tmp_path / "zlab"), target, t["model.embed_tokens.weight"], t["lm_head.weight"]


def cfg_for(ckpt, target, **kw):
    return DrafterConfig(family="dflash", checkpoint=ckpt, target_checkpoint=target, dtype="float64", **kw)


def test_reads_the_layout_and_matches_the_reference_forward(zlab):
    ckpt, target, embed, head = zlab
    p = build_proposer(cfg_for(ckpt, target))
    assert isinstance(p, DFlashProposer)
    c = p.model.cfg
    assert (c.qk_norm, c.mask_token_id, c.context_layernorm, c.anchor_predicts_next) == (True, 63, False, False)
    assert p.info.hidden_layers == (0, 2) and p.info.max_block_size == 4  # block 5 = anchor + 4 drafts
    torch.testing.assert_close(p.model.embed_tokens.weight.float(), embed, rtol=0, atol=0)  # the target's
    feats = torch.randn(7, 2 * H, generator=torch.Generator().manual_seed(1))
    seq = [5, 9, 2, 11, 40, 3, 7, 21]  # 7 rows, anchor 21 at position 7
    p.start("s", seq, feats, SamplingParams())
    block = p.propose("s", len(seq), [], None, 4)  # fills the session's context K/V; greedy: the argmax
    assert list(block.token_ids) == reference_block(ckpt, embed, head, feats, 21).argmax(-1).tolist()
    kv = p.session("s").family_state.kv
    assert kv[0][0].shape[0] == 7
    for given in ((), (4,), (4, 60)):
        got = p.model.block_logits(torch.tensor([21]), 7, kv, given=torch.tensor(given, dtype=torch.int64))
        want = reference_block(ckpt, embed, head, feats, 21, given)
        assert got.shape == want.shape == (4, V)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_rollback_matches_fresh_drafter(zlab):
    ckpt, target, _, _ = zlab
    loaded = build_proposer(cfg_for(ckpt, target))

    def make():
        return DFlashProposer(loaded.model, cfg_for(ckpt, target), loaded.info.hidden_layers, loaded.info.vocab_hash)

    rollback_matches_fresh(make, FakeFeatures(V, 2 * H), V, steps=8, sampled=True)


def test_two_pass_draws_follow_the_reported_q(zlab):
    """With 2 passes (serve-time --denoise-steps 2) token 2 is drawn given token 1 from the q the block
    reports, over 1500 sessions (one pass would draw both tokens from rows that ignore each other)."""
    ckpt, target, _, _ = zlab
    p = build_proposer(cfg_for(ckpt, target, denoise_steps=2))
    seq = [1, 2, 3, 4, 5, 6]
    check_two_draws_follow_q(p, seq, FakeFeatures(V, 2 * H).rows(seq, 0, 5), 1500)


def test_a_wrong_layout_names_what_is_missing(zlab, tiny_ckpt, tmp_path):
    ckpt, target, _, _ = zlab
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(DrafterConfigError, match=r"lacks tensor layers\.1\.self_attn\.k_norm\.weight$"):
        build_proposer(cfg_for(ckpt, target))

    def config_error(edit) -> str:
        out = write_zlab_dflash(tmp_path / f"c{len(list(tmp_path.iterdir()))}")
        raw = json.loads((out / "config.json").read_text())
        edit(raw)
        (out / "config.json").write_text(json.dumps(raw))
        with pytest.raises(DrafterConfigError) as e:
            build_proposer(cfg_for(out, target))
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "lacks dflash_config.mask_token_id" in config_error(lambda r: r["dflash_config"].pop("mask_token_id"))
    assert "target_layer_ids (or num_target_layers)" in config_error(
        lambda r: r["dflash_config"].pop("target_layer_ids")
    )
    assert "lacks block_size" in config_error(lambda r: r.pop("block_size"))
    assert "lacks dflash_config" in config_error(lambda r: r.pop("dflash_config"))
    assert "only full_attention" in config_error(lambda r: r.update(layer_types=["sliding_attention"] * 2))
    assert "rope_type 'yarn' is not supported" in config_error(
        lambda r: r.update(rope_parameters={"rope_type": "yarn"})
    )
    assert "mask_token_id 64 outside [0, 64)" in config_error(lambda r: r["dflash_config"].update(mask_token_id=64))
    # what the loader said before it knew this layout, now with the layout it expected
    assert "or architectures ['DFlashDraftModel'] (z-lab's), got model_type 'qwen3'" in config_error(
        lambda r: r.pop("architectures")
    )
    with pytest.raises(DrafterConfigError, match="give the target checkpoint"):
        build_proposer(DrafterConfig(family="dflash", checkpoint=write_zlab_dflash(tmp_path / "nt")))
    wrong = write_zlab_dflash(tmp_path / "w", hidden_size=16)  # the target's embeddings are [64, 32]
    with pytest.raises(
        DrafterConfigError, match=r"model\.embed_tokens\.weight .* shape \(64, 32\), expected \(64, 16\)"
    ):
        build_proposer(cfg_for(wrong, target))


def test_taps_spread_over_the_target_when_the_config_names_none(zlab, tmp_path):
    assert spread_target_layers(36, 5) == (1, 9, 17, 25, 33)  # 1 .. L - 3, evenly
    assert spread_target_layers(28, 1) == (14,)
    _, target, _, _ = zlab
    out = write_zlab_dflash(tmp_path / "n")
    raw = json.loads((out / "config.json").read_text())
    raw["dflash_config"] = {"mask_token_id": 63, "num_target_layers": 3}
    (out / "config.json").write_text(json.dumps(raw))
    assert build_proposer(cfg_for(out, target)).info.hidden_layers == (1, 0)  # 3 layers: 1 .. 0, rounded
    raw.pop("rope_theta")  # transformers 5 configs keep it in rope_parameters
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    (out / "config.json").write_text(json.dumps(raw))
    assert build_proposer(cfg_for(out, target)).model.cfg.rope_theta == 500.0
