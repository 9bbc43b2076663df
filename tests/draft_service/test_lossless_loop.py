"""Full loop through the real proposers and B's TargetEngine: prefill -> start -> propose -> verify.

- temperature 0: the output equals target-only greedy decoding, for chains and trees of every family;
- a `model` drafter that IS the target is accepted in full (its positions line up with the target's);
- temperature > 0: the first token emitted by a verify step follows the target's exact distribution
  (chi-square against transformers' probabilities) for every family, chains and trees. That test runs
  the loop's first step for many sessions with one batched verify, on a dense target (cheaper forwards;
  the verify rule does not depend on the architecture); a tree whose final cut drops drawn root
  children runs 1500 sessions, enough to reject a builder that ranks the cut by each node's own q
  (p = 4e-8 against that bug, 0.74 without it). A second test follows the token after it,
  through a second step where the first one emitted only one token (session sync under sampling), and
  through drafted token 2 and its q where the first accepted drafted token 1 (for these random
  drafters, 1 to 40 of 300 sessions: little power there; tests/draft_service/test_dflash.py checks
  DFlash's draws against its q directly).
- the published layouts (z-lab's DFlash, DeepSeek-V3's MTP layer, on a tiny DeepSeek-V3 target that
  carries one): greedy equality for k = 1..4 and both sampled tests (test_dflash_zlab.py and
  test_mtp.py check their draws against their q, with a control that the check can fail).
- the CUDA-graph drafters (model_graph.py, eagle3_graph.py, dflash_graph.py): `*_graphs` names run the graphs' bodies eagerly on the
  CPU; `*_cuda` names (marked gpu, skipped without CUDA) run the drafter on the GPU with its captured graphs against
  the CPU target. Both go through the greedy-equality and both sampled tests; EAGLE-3's tree graphs
  (eagle3_tree_graph.py) through the greedy one and the first sampled one (on the GPU with the cut tree too).
"""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from stats_helpers import suite_seed_key
from tiny_hf import save_zlab_dflash

from specserve.contract.types import DraftBlock, SamplingParams, TreeSpec
from specserve.draft_service.dflash import DFlashConfig, DFlashModel, save_dflash
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.dspark import DSparkConfig, DSparkModel, save_dspark
from specserve.draft_service.eagle3_head import (
    Eagle3Config,
    Eagle3Head,
    save_eagle3_head,
)
from specserve.draft_service.registry import build_proposer
from specserve.draft_service.target_tensors import read_target_tensors
from specserve.loop.step_loop import truncate_chain
from specserve.loop.step_observer import drafted_confidence
from specserve.loop.verify_length import StepCosts, best_length
from specserve.models.loader import load_model
from specserve.models.probs import target_probs
from specserve.target_service.engine.engine import TargetEngine

PROMPT = [3, 17, 42, 3, 17, 8, 3, 17]
VOCAB = 64
TREE = TreeSpec(num_nodes=8, top_k=2, depth=3)
# a tree whose final cut drops drawn children of the root: a builder that let a node's own q decide
# the cut (keeping the likelier siblings) would bias the first emitted token, and this tree shows it
CUT_TREE = TreeSpec(num_nodes=3, top_k=4, depth=2)


def _eagle3_dir(root, target_dir):
    torch.manual_seed(5)
    raw = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "draft_vocab_size": 48,
        "target_hidden_size": 32,
        "hidden_act": "silu",
    }
    head = Eagle3Head(Eagle3Config.from_dict(raw))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        keep = torch.sort(torch.randperm(VOCAB)[:48]).values
        head.d2t.copy_(keep - torch.arange(48))
        head.t2d[keep] = True
        # a head near the target: its feature is the target's last hidden row plus a small attention and MLP, read by
        # the target's own final norm and output rows, so drafted token 1 is accepted often (a random head's top-8 q
        # missed the target's in all but 2 of 300 sessions, and the second-token test had no drafted token 2 on trial)
        last = read_target_tensors(target_dir, {"norm": "model.norm.weight", "lm_head": "lm_head.weight"}, "test")
        head.fc.weight.zero_()
        head.fc.weight[:, 64:].copy_(torch.eye(32))  # the third fused layer (the last of the tiny target's)
        for proj in (head.o_proj, head.down_proj):
            proj.weight.mul_(0.1)
        head.norm.weight.copy_(last["norm"])
        head.lm_head.weight.copy_(last["lm_head"][keep])
    save_eagle3_head(head, root / "eagle3")  # embeddings come from the target checkpoint
    return root / "eagle3"


def _dspark_dir(root, num_layers):
    torch.manual_seed(7)
    cfg = DFlashConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=VOCAB,
        block_size=4,
        target_hidden_size=32,
        target_layer_ids=(0, num_layers - 1),
    )
    model = DSparkModel(DSparkConfig(cfg, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
    save_dspark(model, root / "dspark")
    return root / "dspark"


def _dflash_dir(root, num_layers, denoise_steps=1):
    torch.manual_seed(6)
    cfg = DFlashConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=VOCAB,
        block_size=4,
        target_hidden_size=32,
        target_layer_ids=(0, num_layers - 1),
        denoise_steps=denoise_steps,
    )
    model = DFlashModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
    save_dflash(model, root / f"dflash{denoise_steps}")
    return root / f"dflash{denoise_steps}"


@pytest.fixture(scope="module")
def world(tiny_ckpt, tmp_path_factory):
    """(engine factory, drafter configs by name, target dir) around a tiny target (MoE by default)."""
    return _world(tiny_ckpt, tmp_path_factory, "target_moe")


@pytest.fixture(scope="module")
def mtp_world(tiny_ckpt, tmp_path_factory):
    """The same around a tiny DeepSeek-V3 target (MLA + MoE) that carries a multi-token-prediction layer."""
    return _world(tiny_ckpt, tmp_path_factory, "target_mtp")


@pytest.fixture(scope="module")
def dense_world(tiny_ckpt, tmp_path_factory):
    """The same around a dense target: cheaper forwards for the many-sample distribution tests."""
    return _world(tiny_ckpt, tmp_path_factory, "target_dense")


def _world(tiny_ckpt, tmp_path_factory, kind):
    target = tiny_ckpt(kind)
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    root = tmp_path_factory.mktemp("drafters")
    model, mcfg = load_model(target, progress=False)

    def engine():
        return TargetEngine(model, mcfg, num_blocks=8192, block_size=4, seed_key=suite_seed_key())

    base = dict(target_checkpoint=target, max_block_size=4, kv_block_size=4, kv_num_blocks=8192)
    configs = {
        "ngram": DrafterConfig(family="ngram", ngram_min_n=1, ngram_max_n=3, **base),
        "model": DrafterConfig(family="model", checkpoint=tiny_ckpt("draft_llama"), **base),
        "model_is_target": DrafterConfig(family="model", checkpoint=target, **base),
        "eagle3": DrafterConfig(family="eagle3", checkpoint=_eagle3_dir(root, target), **base),
        "dflash": DrafterConfig(family="dflash", checkpoint=_dflash_dir(root, layers), **base),
        "dflash_denoise": DrafterConfig(family="dflash", checkpoint=_dflash_dir(root, layers, 2), **base),
        "dspark": DrafterConfig(family="dspark", checkpoint=_dspark_dir(root, layers), **base),
        "dflash_zlab": DrafterConfig(
            family="dflash", checkpoint=save_zlab_dflash(root / "zlab", (0, layers - 1)), **base
        ),
        "mtp": DrafterConfig(family="mtp", **base),  # the target's own layer (only mtp_world's target has one)
    }
    for name in GRAPH_DRAFTERS:  # on the GPU, with their captured graphs (built only by the tests that run there)
        configs[f"{name}_cuda"] = dataclasses.replace(configs[name], device="cuda")
    return engine, configs, target


GRAPH_DRAFTERS = ("model", "eagle3", "dflash", "dflash_denoise", "dspark")
GPU = (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))


def make_proposer(configs, name):
    """build_proposer; a `NAME_graphs` name: drafter NAME drafting through its CUDA graphs' bodies, run eagerly on the
    CPU (model_graph.py / eagle3_graph.py / dflash_graph.py)."""
    if not name.endswith("_graphs"):
        return build_proposer(configs[name])
    proposer = build_proposer(configs[name.removesuffix("_graphs")])
    if proposer.info.family in ("model", "eagle3"):
        proposer.chain_graphs = proposer.build_chain_graphs(1024, proposer.info.max_block_size)
    else:
        proposer.block_graphs = proposer.build_block_graphs(1024, proposer.info.max_block_size)
    return proposer


def _graph_variants(world_name=None):
    """(world_name, name) or name params of the graph drafters: CPU bodies, and captured graphs on a GPU."""
    names = [f"{n}_graphs" for n in GRAPH_DRAFTERS] + [pytest.param(f"{n}_cuda", marks=GPU) for n in GRAPH_DRAFTERS]
    if world_name is None:
        return names
    return [
        pytest.param(world_name, n.values[0], marks=n.marks) if hasattr(n, "values") else (world_name, n) for n in names
    ]


def run_loop(engine, proposer, sid, prompt, sampling, max_new, k=3, tree=None, steps=None):
    """The simple synchronous loop; returns (emitted tokens, drafted count, accepted count)."""
    layers = proposer.info.hidden_layers if proposer.info.needs_hidden_states else ()
    pre = engine.prefill(sid, prompt, sampling, layers)
    seq = list(prompt) + [pre.next_token]
    proposer.start(sid, seq, pre.hidden, sampling)
    out, known, hidden, drafted, accepted = [pre.next_token], len(seq), None, 0, 0
    while len(out) < max_new and (steps is None or steps > 0):
        block = proposer.propose(sid, known, seq[known:], hidden, k, tree)
        known = len(seq)
        res = engine.verify(sid, block)
        drafted, accepted, hidden = drafted + len(block), accepted + len(res.accepted_ids), res.hidden
        seq += res.emitted
        out += res.emitted
        steps = None if steps is None else steps - 1
    engine.release(sid)
    proposer.release(sid)
    return out, drafted, accepted


@pytest.mark.parametrize("name", ["ngram", "model", "eagle3", "dflash", "dflash_denoise", "dspark"] + _graph_variants())
def test_greedy_output_equals_target_only(world, name):
    engine_factory, configs, _ = world
    engine, proposer = engine_factory(), make_proposer(configs, name)
    want = engine.generate_greedy(PROMPT, 24)
    trees = [None, TREE] if proposer.info.supports_tree else [None]
    for tree in trees:
        got, drafted, _ = run_loop(engine, proposer, f"g-{tree}", PROMPT, SamplingParams(), 24, tree=tree)
        assert got[:24] == want, f"{name} tree={tree}"
        assert drafted > 0 or name == "ngram"


@pytest.mark.parametrize(
    "world_name,name", [("world", "dflash_zlab"), ("mtp_world", "dflash_zlab"), ("mtp_world", "mtp")]
)
def test_published_layouts_greedy_output_equals_target_only_for_k_1_to_4(request, world_name, name):
    engine_factory, configs, _ = request.getfixturevalue(world_name)
    engine, proposer = engine_factory(), build_proposer(configs[name])
    want = engine.generate_greedy(PROMPT, 24)
    for k in (1, 2, 3, 4):
        got, drafted, _ = run_loop(engine, proposer, f"g{k}", PROMPT, SamplingParams(), 24, k=k)
        assert got[:24] == want, f"{name} k={k}"
        assert drafted >= 23 * k // (k + 1)  # every step drafted k tokens
    assert proposer.active_sessions == 0


@pytest.mark.parametrize("name", ["model_is_target", "model_is_target_graphs"])
def test_target_as_its_own_draft_is_accepted_in_full(world, name):
    engine_factory, configs, _ = world
    engine, proposer = engine_factory(), make_proposer(configs, name)
    for tree in (None, TREE):
        _, drafted, accepted = run_loop(engine, proposer, "self", PROMPT, SamplingParams(), 40, k=4, tree=tree)
        depth = 3 if tree else None
        assert drafted > 0 and (accepted == drafted if tree is None else accepted > 0)
        if tree is not None:  # every step accepts a full-depth path
            steps = -(-39 // (depth + 1))
            assert accepted >= depth * (steps - 1)


def _chisquare_pvalue(counts: np.ndarray, expected: torch.Tensor, runs: int) -> float:
    """Cells with >= 5 expected draws, the rest pooled into one."""
    exp = expected.numpy() * runs
    big = exp >= 5
    obs_cells = np.append(counts[big], counts[~big].sum())
    exp_cells = np.append(exp[big], exp[~big].sum())
    keep = exp_cells > 0
    return chisquare(obs_cells[keep], exp_cells[keep] * obs_cells[keep].sum() / exp_cells[keep].sum()).pvalue


def _hf_float64(target_dir):
    """transformers' model of the target in float64 (its grouped-GEMM experts take no float64: eager)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64, experts_implementation="eager").eval()


def _exact_third_token_dist(target_dir, sampling) -> torch.Tensor:  # [V]
    """P(third emitted token) = sum_{e1, e2} p(e1 | prompt) p(e2 | prompt, e1) p(e3 | prompt, e1, e2)."""
    hf = _hf_float64(target_dir)
    with torch.no_grad():
        p1 = target_probs(hf(torch.tensor([PROMPT])).logits[0, -1:], sampling)[0].double()
        s1 = torch.nonzero(p1).flatten().tolist()
        p2 = target_probs(hf(torch.tensor([PROMPT + [e] for e in s1])).logits[:, -1], sampling).double()
        pairs = [(e1, e2) for i, e1 in enumerate(s1) for e2 in torch.nonzero(p2[i]).flatten().tolist()]
        weights = torch.tensor([float(p1[e1] * p2[s1.index(e1), e2]) for e1, e2 in pairs], dtype=torch.float64)
        p3 = target_probs(hf(torch.tensor([PROMPT + [e1, e2] for e1, e2 in pairs])).logits[:, -1], sampling)
    return (weights[:, None] * p3.double()).sum(0)


def _exact_second_token_dist(target_dir, sampling) -> torch.Tensor:  # [V]
    """P(second emitted token) = sum_e1 p(e1 | prompt) p(e2 | prompt, e1), from transformers."""
    hf = _hf_float64(target_dir)
    with torch.no_grad():
        p1 = target_probs(hf(torch.tensor([PROMPT])).logits[0, -1:], sampling)[0].double()
        support = torch.nonzero(p1).flatten()
        batch = torch.tensor([PROMPT + [int(e)] for e in support])
        p2 = target_probs(hf(batch).logits[:, -1], sampling).double()
    return (p1[support, None] * p2).sum(0)


@pytest.mark.parametrize(
    "world_name,name,tree",
    [
        ("dense_world", n, t)
        for n, t in [
            ("ngram", None),
            ("model", None),
            ("model", TREE),
            ("model", CUT_TREE),
            ("eagle3", None),
            ("eagle3", TREE),
            ("dflash", None),
            ("dflash_denoise", None),
            ("dflash_zlab", None),
            ("dspark", None),
        ]
    ]
    + [("mtp_world", "mtp", None)]
    + [
        pytest.param(*p.values, None, marks=p.marks) if hasattr(p, "values") else (*p, None)
        for p in _graph_variants("dense_world")
    ]
    + [("dense_world", "eagle3_graphs", TREE)]  # eagle3_tree_graph.py (its cut: test_eagle3_graph.py, in seconds)
    + [pytest.param("dense_world", "eagle3_cuda", t, marks=GPU) for t in (TREE, CUT_TREE)],
)
def test_sampled_first_verify_token_follows_target(request, world_name, name, tree):
    engine_factory, configs, target = request.getfixturevalue(world_name)
    sampling = dict(temperature=1.0, top_k=8)
    expected = _exact_second_token_dist(target, SamplingParams(**sampling))
    engine, proposer = engine_factory(), make_proposer(configs, name)
    layers = proposer.info.hidden_layers if proposer.info.needs_hidden_states else ()
    counts, drafted, accepted, items = np.zeros(VOCAB), 0, 0, []
    runs = 1500 if tree is CUT_TREE else 200  # the cut's bias is small: it needs the sample size
    for i in range(runs):  # the loop's first step for many sessions; one batched verify forward
        sid, s = f"c{i}", SamplingParams(seed=1000 + i, **sampling)
        pre = engine.prefill(sid, PROMPT, s, layers)
        proposer.start(sid, PROMPT + [pre.next_token], pre.hidden, s)
        items.append((sid, proposer.propose(sid, len(PROMPT) + 1, [], None, 3, tree)))
    for (sid, block), res in zip(items, engine.verify_batch(items)):
        counts[res.emitted[0]] += 1
        drafted, accepted = drafted + len(block), accepted + len(res.accepted_ids)
        engine.release(sid), proposer.release(sid)
    assert counts[(expected == 0).numpy()].sum() == 0, "emitted a token the target cannot sample"
    pval = _chisquare_pvalue(counts, expected, runs)
    assert pval > 1e-3, f"{name} tree={tree}: p={pval:.2e}, drafted {drafted}, accepted {accepted}"
    assert drafted > 0 and (name != "model" or accepted > 0)  # proposals were exercised


@pytest.mark.parametrize(
    "world_name,name",
    [("dense_world", n) for n in ["model", "eagle3", "dflash", "dflash_denoise", "dflash_zlab", "dspark"]]
    + [("mtp_world", "mtp")]
    + _graph_variants("dense_world"),
)
def test_sampled_second_verified_token_follows_target(request, world_name, name):
    """The second token a session emits after prefill: from the first verify when it accepted drafted
    token 1 (then drafted token 2 and its q were on trial), else from a second step."""
    engine_factory, configs, target = request.getfixturevalue(world_name)
    sampling = dict(temperature=1.0, top_k=8)
    expected = _exact_third_token_dist(target, SamplingParams(**sampling))
    engine, proposer = engine_factory(), make_proposer(configs, name)
    layers = proposer.info.hidden_layers if proposer.info.needs_hidden_states else ()
    counts, runs, items, seqs = np.zeros(VOCAB), 300, [], {}
    for i in range(runs):
        sid, s = f"t{i}", SamplingParams(seed=5000 + i, **sampling)
        pre = engine.prefill(sid, PROMPT, s, layers)
        seqs[sid] = PROMPT + [pre.next_token]
        proposer.start(sid, seqs[sid], pre.hidden, s)
        items.append((sid, proposer.propose(sid, len(seqs[sid]), [], None, 3)))
    again, first_accepted = [], 0
    for (sid, _), res in zip(items, engine.verify_batch(items)):
        if len(res.emitted) >= 2:
            counts[res.emitted[1]] += 1
            first_accepted += 1
            engine.release(sid), proposer.release(sid)
            continue
        known = len(seqs[sid])
        seqs[sid] += list(res.emitted)
        again.append((sid, proposer.propose(sid, known, seqs[sid][known:], res.hidden, 3)))
    for (sid, _), res in zip(again, engine.verify_batch(again) if again else []):
        counts[res.emitted[0]] += 1
        engine.release(sid), proposer.release(sid)
    assert counts[(expected == 0).numpy()].sum() == 0, "emitted a token the target cannot sample"
    pval = _chisquare_pvalue(counts, expected, runs)
    assert pval > 1e-3, f"{name}: p={pval:.2e}, first drafted token accepted in {first_accepted}/{runs}"
    assert first_accepted > 0  # drafted token 2 was on trial


# ---------------------------------------------------------------- per-step verify length (specserve/loop/verify_length.py)
VERIFY_LENGTH = [("world", n) for n in ("ngram", "model", "eagle3", "dflash", "dspark")] + [("mtp_world", "mtp")]


def _cut_by_rule(block, rnd: random.Random, used: set) -> DraftBlock:
    """The prefix the verify-length rule picks for this block on a random cost table (verify growing with the tokens,
    a random sunk draft time), from the block's own confidence (DSpark's head, else q), else random chances: any
    length 0..len(block) comes up."""
    conf = drafted_confidence(block)
    alpha = conf.tolist() if conf is not None and rnd.random() < 0.5 else [rnd.random() for _ in range(len(block))]
    growth = rnd.choice([0.0, 0.2, 1.0, 3.0])
    costs = StepCosts(tuple(1.0 + growth * k for k in range(len(block) + 1)), (0.0,) * (len(block) + 1))
    k = best_length(alpha, costs, sunk_ms=rnd.uniform(0.0, 2.0))
    used.add(k)
    return truncate_chain(block, k)


@pytest.mark.parametrize("world_name,name", VERIFY_LENGTH)
def test_greedy_output_with_per_step_verify_length_equals_target_only(request, world_name, name):
    engine_factory, configs, _ = request.getfixturevalue(world_name)
    engine, proposer = engine_factory(), make_proposer(configs, name)
    want = engine.generate_greedy(PROMPT, 24)
    rnd, used = random.Random(3), set()
    sid = "vl"
    layers = proposer.info.hidden_layers if proposer.info.needs_hidden_states else ()
    pre = engine.prefill(sid, PROMPT, SamplingParams(), layers)
    seq = list(PROMPT) + [pre.next_token]
    proposer.start(sid, seq, pre.hidden, SamplingParams())
    known, hidden = len(seq), None
    while len(seq) - len(PROMPT) < 24:
        block = _cut_by_rule(proposer.propose(sid, known, seq[known:], hidden, 4), rnd, used)
        known = len(seq)
        res = engine.verify(sid, block)
        seq, hidden = seq + list(res.emitted), res.hidden
    engine.release(sid), proposer.release(sid)
    assert seq[len(PROMPT) :][:24] == want
    assert 0 in used and max(used) >= 2 or name == "ngram"  # target-only steps and longer prefixes both came up


@pytest.mark.parametrize(
    "world_name,name",
    [("dense_world", n) for n in ("ngram", "model", "eagle3", "dflash", "dspark")] + [("mtp_world", "mtp")],
)
def test_sampled_first_token_with_per_step_verify_length_follows_target(request, world_name, name):
    """The first token a verify emits when each session's block is cut by the rule (from its q / confidence): the
    target's exact law; the same counts against the law at another temperature are refused (the negative control:
    the test has the power to fail)."""
    engine_factory, configs, target = request.getfixturevalue(world_name)
    sampling = dict(temperature=1.0, top_k=8)
    expected = _exact_second_token_dist(target, SamplingParams(**sampling))
    engine, proposer = engine_factory(), make_proposer(configs, name)
    layers = proposer.info.hidden_layers if proposer.info.needs_hidden_states else ()
    counts, items, rnd, used, runs = np.zeros(VOCAB), [], random.Random(5), set(), 300
    for i in range(runs):
        sid, s = f"v{i}", SamplingParams(seed=7000 + i, **sampling)
        pre = engine.prefill(sid, PROMPT, s, layers)
        proposer.start(sid, PROMPT + [pre.next_token], pre.hidden, s)
        items.append((sid, _cut_by_rule(proposer.propose(sid, len(PROMPT) + 1, [], None, 3), rnd, used)))
    for (sid, _), res in zip(items, engine.verify_batch(items)):
        counts[res.emitted[0]] += 1
        engine.release(sid), proposer.release(sid)
    assert counts[(expected == 0).numpy()].sum() == 0, "emitted a token the target cannot sample"
    pval = _chisquare_pvalue(counts, expected, runs)
    assert pval > 1e-3, f"{name}: p={pval:.2e}, lengths {sorted(used)}"
    other = _exact_second_token_dist(target, SamplingParams(temperature=0.25, top_k=8))  # a much sharper law
    assert _chisquare_pvalue(counts, other, runs) < 1e-3  # the negative control
    assert 0 in used and len(used) >= 3  # cut to nothing, and to several lengths
