"""DSpark drafter (draft_service/dspark.py): its block, Markov head and confidence head against a pure-torch reference
written out here, its checkpoint round trip, draws that follow the q it reports (with a negative control), its graph
bodies drafting as the eager drafter does, rollback/sync, and the batched training form against the proposer's."""

from __future__ import annotations

import math

import pytest
import torch
from draft_helpers import (
    FakeFeatures,
    check_sessions_take_turns,
    check_two_draws_follow_q,
    randomize_,
    rollback_matches_fresh,
)
from safetensors.torch import load_file, save_file

from specserve.contract.types import SamplingParams
from specserve.draft_service.dflash import DFlashConfig
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_errors import DrafterConfigError
from specserve.draft_service.dspark import DSparkConfig, DSparkModel, DSparkProposer, load_dspark, save_dspark
from specserve.draft_service.registry import build_proposer

VOCAB, TH, LAYERS, RANK = 40, 12, (0, 2), 6


def random_dspark(seed: int = 0, markov_from: int = 0) -> DSparkModel:
    block = DFlashConfig(
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
    model = randomize_(DSparkModel(DSparkConfig(block, RANK, markov_from)), seed)
    with torch.no_grad():
        model.markov.out.weight.mul_(8.0)  # a Markov correction that changes the argmax often
    return model


@pytest.fixture(scope="module", params=[0, 1], ids=["markov-from-0", "markov-from-1"])
def saved(tmp_path_factory, request):
    """(the random drafter, its folder), saved once for the module's tests (none of them changes the folder); its
    Markov correction from position 0 (the first checkpoints) or 1 (issue #43: position 1's is the block's input)."""
    model, path = random_dspark(markov_from=request.param), tmp_path_factory.mktemp("dspark")
    save_dspark(model, path)
    return model, path


def cfg_for(path, **kw):
    return DrafterConfig(family="dspark", checkpoint=path, max_block_size=8, **kw)


# ---------------------------------------------------------------- the pure-torch reference (formulas written out)
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [T, h, D] half-split rotary at positions pos [T]
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = pos.double()[:, None] * inv  # [T, D/2]
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@torch.no_grad()
def reference_rows(m: DSparkModel, feats: torch.Tensor, pending: int) -> torch.Tensor:  # [b, H] the block's z
    """The block over context rows feats [P, F] (positions 0..P-1), pending token at P: every layer written out."""
    blk, c = m.block, m.block.cfg
    P, b, d, g = feats.shape[0], c.block_size, c.head_dim, c.num_attention_heads // c.num_key_value_heads
    ctx = _rms(feats @ blk.fc.weight.T, blk.context_norm.weight, c.rms_norm_eps)  # [P, H]
    x = torch.cat([blk.embed_tokens.weight[pending][None], blk.mask_embedding[None].expand(b - 1, -1)])
    cpos, bpos = torch.arange(P), P + torch.arange(b)
    for L in blk.layers:
        hc, h = _rms(ctx, L.input_layernorm.weight, c.rms_norm_eps), _rms(x, L.input_layernorm.weight, c.rms_norm_eps)
        k = torch.cat(
            [
                _rope((hc @ L.k_proj.weight.T).view(P, -1, d), cpos, c.rope_theta),
                _rope((h @ L.k_proj.weight.T).view(b, -1, d), bpos, c.rope_theta),
            ]
        )  # [P + b, Hkv, D]
        v = torch.cat([(hc @ L.v_proj.weight.T).view(P, -1, d), (h @ L.v_proj.weight.T).view(b, -1, d)])
        q = _rope((h @ L.q_proj.weight.T).view(b, -1, d), bpos, c.rope_theta)  # [b, Hq, D]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d), dim=-1)  # every query sees all keys
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(b, -1) @ L.o_proj.weight.T
        y = _rms(x, L.post_attention_layernorm.weight, c.rms_norm_eps)
        x = x + (torch.nn.functional.silu(y @ L.gate_proj.weight.T) * (y @ L.up_proj.weight.T)) @ L.down_proj.weight.T
    return _rms(x, blk.norm.weight, c.rms_norm_eps)


@torch.no_grad()
def reference_chain(m: DSparkModel, z: torch.Tensor, pending: int, drawn: list[int] | None = None):
    """(tokens, confidences, logits [k, V]) of the Markov chain over rows z [k, H]: greedy, or the tokens `drawn`."""
    mk, ch, E = m.markov, m.confidence, m.block.embed_tokens.weight
    prev, tokens, conf, rows = pending, [], [], []
    for i in range(z.shape[0]):
        u = torch.nn.functional.silu(mk.h_proj.weight @ z[i] + mk.e_proj.weight @ E[prev])  # [r]
        logits = m.block.lm_head.weight @ z[i]  # [V]
        if i >= m.spark_cfg.markov_from:  # the correction from position markov_from on
            logits = logits + mk.out.weight @ u
        tok = int(logits.argmax()) if drawn is None else drawn[i]
        lp = float(torch.log_softmax(logits.double(), -1)[tok])
        s = float(ch.w_z.weight[0] @ z[i] + ch.w_z.bias[0] + ch.w_u.weight[0] @ u) + float(ch.w_lp[0]) * lp
        tokens.append(tok), conf.append(1 / (1 + math.exp(-s))), rows.append(logits)
        prev = tok
    return tokens, conf, torch.stack(rows)


def _start(p, seq, feats, sampling, sid="s"):
    p.start(sid, seq, feats.rows(seq, 0, len(seq) - 1), sampling)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-bodies"])
def test_block_markov_and_confidence_match_the_reference(saved, graphs):
    """Greedy: the block's rows, the drafted tokens and their confidences are the reference's; sampled: each q_i is
    the reference's softmax of logits_i given the tokens drawn before it (the Markov head reads the drawn token)."""
    model, path = saved
    p = build_proposer(cfg_for(path))
    if graphs:
        p.block_graphs = p.build_block_graphs(64, p.info.max_block_size)
    feats, seq = FakeFeatures(VOCAB, len(LAYERS) * TH), [3, 9, 14, 1, 7, 22, 5]
    z = reference_rows(model, feats.rows(seq, 0, len(seq) - 1), seq[-1])
    kv = model.block.context_kv(feats.rows(seq, 0, len(seq) - 1), torch.arange(len(seq) - 1))
    torch.testing.assert_close(model.block.block_hidden(torch.tensor(seq[-1:]), len(seq) - 1, kv), z, rtol=0, atol=1e-5)
    _start(p, seq, feats, SamplingParams())
    block = p.propose("s", len(seq), [], None, 5)
    want_tokens, want_conf, _ = reference_chain(model, z, seq[-1])
    assert list(block.token_ids) == want_tokens
    assert block.confidence == pytest.approx(want_conf, abs=1e-5)
    assert block.probs is None
    changed = [t != int((model.block.lm_head.weight @ z[i]).argmax()) for i, t in enumerate(want_tokens)]
    assert any(changed)  # the Markov head changed a token here (so the comparison covers it)
    for seed in range(4):
        _start(p, seq, feats, SamplingParams(temperature=0.8, top_k=20, seed=seed), sid=f"t{seed}")
        block = p.propose(f"t{seed}", len(seq), [], None, 5)
        _, conf, logits = reference_chain(model, z, seq[-1], list(block.token_ids))
        from specserve.models.probs import target_probs

        torch.testing.assert_close(
            block.probs, target_probs(logits, SamplingParams(temperature=0.8, top_k=20)), rtol=0, atol=1e-5
        )
        assert block.confidence == pytest.approx(conf, abs=1e-5)


def test_round_trip_info_and_a_missing_head_tensor(saved, tmp_path):
    model, _ = saved
    path = tmp_path / "dspark"
    save_dspark(model, path)
    p = build_proposer(cfg_for(path))
    assert isinstance(p, DSparkProposer) and p.info.family == "dspark"
    assert p.info.max_block_size == 5 and p.info.hidden_layers == LAYERS and p.info.has_probs
    for name, ref in model.state_dict().items():
        torch.testing.assert_close(p.spark.state_dict()[name], ref)
    tensors = load_file(str(path / "model.safetensors"))
    assert {"markov.out.weight", "confidence.w_lp", "layers.1.mlp.up_proj.weight"} <= set(tensors)
    del tensors["markov.e_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(DrafterConfigError, match="markov.e_proj.weight"):
        load_dspark(path)
    with pytest.raises(DrafterConfigError, match="denoise-steps 2 does not apply"):
        DSparkProposer(model, cfg_for(path, denoise_steps=2), LAYERS, "")


def test_sampled_draws_follow_the_reported_q(saved):
    """Token 1 follows q_1; token 2, given the commonest token 1, follows the q_2 reported with it; and the q_2 of
    another token 1 is told apart (the Markov head makes q_2 depend on token 1: the check has the power to fail)."""
    _, path = saved
    p = build_proposer(cfg_for(path))
    feats, seq = FakeFeatures(VOCAB, len(LAYERS) * TH), [3, 9, 14, 1, 7]
    check_two_draws_follow_q(p, seq, feats.rows(seq, 0, len(seq) - 1), runs=1500)


def test_graph_bodies_draft_as_the_eager_drafter_with_sessions_taking_turns(saved):
    _, path = saved
    eager, graphs = build_proposer(cfg_for(path)), build_proposer(cfg_for(path))
    graphs.block_graphs = graphs.build_block_graphs(64, graphs.info.max_block_size)
    check_sessions_take_turns(eager, graphs, FakeFeatures(VOCAB, len(LAYERS) * TH), VOCAB)


def test_rollback_matches_fresh_drafter(saved):
    """One session under random accept patterns and rollbacks proposes what a fresh drafter on the same S does."""
    model, path = saved
    feats = FakeFeatures(VOCAB, len(LAYERS) * TH)
    for sampled, steps, seed in ((True, 8, 0), (False, 6, 1)):
        rollback_matches_fresh(
            lambda: DSparkProposer(model, cfg_for(path), LAYERS, ""),
            feats,
            VOCAB,
            steps=steps,
            sampled=sampled,
            seed=seed,
        )


@torch.no_grad()
def test_training_form_is_the_proposers_on_greedy_chain_blocks(saved):
    """draft_dspark's batched logits (teacher-forced previous tokens) equal the proposer's chain where the sequence's
    tokens are the drafted ones, and its confidence logits the confidence head's."""
    from specserve.train.draft_dflash import blocks_hidden
    from specserve.train.draft_dspark import dspark_logits

    model, _ = saved
    feats, seq = FakeFeatures(VOCAB, len(LAYERS) * TH), [3, 9, 14, 1, 7, 22, 5]
    z = reference_rows(model, feats.rows(seq, 0, len(seq) - 1), seq[-1])
    tokens, conf, ref_logits = reference_chain(model, z, seq[-1])
    ids = torch.tensor([seq + tokens])  # [1, T]: the drafted chain written after the anchor
    anchor = len(seq) - 1
    feats_t = feats.rows(ids[0].tolist(), 0, ids.shape[1])[None]
    rows = blocks_hidden(model.block, ids, feats_t, torch.tensor([[anchor]]))
    torch.testing.assert_close(rows[0, 0], z, rtol=0, atol=1e-5)
    prev = ids[0, anchor : anchor + 5]
    u, delta = model.markov(rows[0, 0], model.block.embed_tokens(prev))
    delta[: model.spark_cfg.markov_from] = 0.0  # as the proposer: no correction before markov_from
    logits = model.block.lm_head(rows[0, 0]) + delta
    assert logits.argmax(-1).tolist() == tokens
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    _, u_train, train_logits = dspark_logits(model, ids, feats_t, torch.tensor([[anchor]]))  # draft_dspark's own form
    torch.testing.assert_close(train_logits[0, 0], ref_logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(u_train[0, 0], u, rtol=0, atol=1e-5)
    c = torch.sigmoid(model.confidence.logit(rows[0, 0], u, torch.log_softmax(logits, -1).max(-1).values))
    assert c.tolist() == pytest.approx(conf, abs=1e-5)


def test_a_broken_confidence_head_drafts_with_confidence_zero(saved):
    """NaN out of the confidence head (a broken checkpoint) gives confidence 0 (verify none of it), not a refused
    block or a crash; the tokens are unchanged."""
    model, path = saved
    p, feats, seq = build_proposer(cfg_for(path)), FakeFeatures(VOCAB, len(LAYERS) * TH), [3, 9, 14, 1, 7]
    _start(p, seq, feats, SamplingParams())
    want = p.propose("s", len(seq), [], None, 3)
    with torch.no_grad():
        p.spark.confidence.w_lp.fill_(float("nan"))
    _start(p, seq, feats, SamplingParams(), sid="n")
    got = p.propose("n", len(seq), [], None, 3)
    assert got.token_ids == want.token_ids and got.confidence == (0.0, 0.0, 0.0)


def test_markov_from_is_read_as_0_when_a_config_predates_it(saved, tmp_path):
    """The first checkpoints' config.json has no markov_from: their correction applies from position 0, as they were
    trained; one saved now says which."""
    import json

    model, path = saved
    raw = json.loads((path / "config.json").read_text())
    assert raw["markov_from"] == model.spark_cfg.markov_from
    del raw["markov_from"]
    assert DSparkConfig.from_dict(raw).markov_from == 0
    with pytest.raises(DrafterConfigError, match="markov_from"):
        DSparkConfig.from_dict(dict(raw, markov_from=-1))
