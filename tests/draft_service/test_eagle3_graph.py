"""EAGLE-3 chains and trees as CUDA graphs (draft_service/eagle3_graph.py, eagle3_tree_graph.py): catch-up, chain and
tree, greedy and sampled.

On the CPU the graphs' bodies run eagerly over the same static buffers (a fixed window with device-side masks, ctx
and catch-up tokens staged in one copy, entries written in place): greedy, a session driven through random accept
patterns and rollbacks drafts what a fresh eager drafter drafts, and two sessions taking turns on one window draft
what they draft alone, and the tree body builds tree.py's trees; sampled, the blocks (tokens and q) sync like fresh
ones reseeded alike, q is the sampling transform of the head's logits and the draws follow it (with a negative
control), a tree's siblings are draws without replacement and its cut keeps the first draws. On a GPU (marked gpu): in float32
the captured graphs draft what the eager chain drafts on the shipped demo and the output equals target-only; a sampled
chain or tree replayed from its graphs equals the same one run through the bodies eagerly, seed for seed, and greedy
trees equal tree.py's.
"""

from __future__ import annotations

import pytest
import torch
from draft_helpers import (
    FakeFeatures,
    check_graphs_draft_as_eager,
    check_sessions_take_turns,
    check_two_draws_follow_q,
    rollback_matches_fresh,
    skipped_catch_up_keys,
)
from eagle3_helpers import TARGET_H, VOCAB, save_tiny_eagle3

from specserve.contract.types import SamplingParams, TreeSpec
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.eagle3 import Eagle3Proposer
from specserve.draft_service.registry import build_proposer
from specserve.loop.stats import SpecStats
from specserve.paths import demo_checkpoint
from specserve.target_service.factory import EngineConfig, build_engine
from specserve.train.acceptance import speculative_greedy


def _acceptance(stats: SpecStats) -> dict:
    """What a drafter decides (steps, drafted and accepted per position), without the timings."""
    return {k: v for k, v in stats.as_dict().items() if not k.endswith("_s")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eagle3_chain_graphs_draft_what_the_eager_chain_drafts():
    target = demo_checkpoint("target")
    engine = build_engine(EngineConfig(model=target, device="cuda", dtype="float32", cuda_graphs=False))
    proposers = {
        window: build_proposer(
            DrafterConfig(
                "eagle3",
                checkpoint=demo_checkpoint("eagle3"),
                target_checkpoint=target,
                device="cuda",
                dtype="float32",
                max_block_size=4,
                graph_window=window,
            )
        )
        for window in (0, 1024)
    }
    assert proposers[0].chain_graphs is None and proposers[1024].chain_graphs is not None
    tok = engine.tokenizer
    prompts = [
        tok.encode(t).ids for t in ("def parse_args(argv):\n", "class Stack:\n    def push(self, x):", "import os\n")
    ]
    for i, prompt in enumerate(prompts):
        want = engine.generate_greedy(prompt, 40)
        per_step = {}
        for window, proposer in proposers.items():
            stats = SpecStats()
            got = speculative_greedy(engine, proposer, f"p{i}-{window}", prompt, 4, 40, stats)
            assert got[:40] == want, f"window {window}: speculative output differs from target-only"
            per_step[window] = _acceptance(stats)
        assert per_step[1024] == per_step[0]
        assert per_step[0]["mean_accepted_length"] > 1.0  # the head drafts something the target keeps


def test_static_window_passes_match_the_eager_chain_on_cpu():
    """The graph's passes (fixed window, masks from device scalars, keys written in place) run eagerly here: the
    same drafted blocks as the eager chain, step for step (runs in CI)."""
    from specserve.draft_service.eagle3_graph import Eagle3ChainGraphs

    target = demo_checkpoint("target")
    engine = build_engine(EngineConfig(model=target))
    eager = build_proposer(
        DrafterConfig("eagle3", checkpoint=demo_checkpoint("eagle3"), target_checkpoint=target, max_block_size=4)
    )
    windowed = build_proposer(
        DrafterConfig("eagle3", checkpoint=demo_checkpoint("eagle3"), target_checkpoint=target, max_block_size=4)
    )
    assert eager.chain_graphs is None  # CPU: no graphs unless given
    windowed.chain_graphs = Eagle3ChainGraphs(windowed.head, windowed.d2t_ids, window=256, k_max=4)
    prompt = engine.tokenizer.encode("def parse_args(argv):\n").ids
    per_step = {}
    for name, proposer in (("eager", eager), ("windowed", windowed)):
        stats = SpecStats()
        speculative_greedy(engine, proposer, name, prompt, 4, 32, stats)
        per_step[name] = _acceptance(stats)
    assert per_step["windowed"] == per_step["eager"]
    assert per_step["eager"]["mean_accepted_length"] > 1.0


# ---------------------------------------------------------------- CPU: the graphs' bodies on a tiny head
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _, hdir, tdir = save_tiny_eagle3(tmp_path_factory.mktemp("eagle3_graph"))
    cfg = DrafterConfig(family="eagle3", checkpoint=hdir, target_checkpoint=tdir, dtype="float64", max_block_size=5)
    loaded = build_proposer(cfg)
    return cfg, loaded


@pytest.fixture(scope="module")
def sharp(tiny):
    """The tiny head with sharpened logits and a stronger attention output: its q_2 depends on drafted token 1 enough
    for a test to tell two of them apart, and its greedy chains do not repeat one token."""
    cfg, _ = tiny
    loaded = build_proposer(cfg)
    with torch.no_grad():
        loaded.head.lm_head.weight.mul_(4.0)
        loaded.head.o_proj.weight.mul_(3.0)
    return cfg, loaded


def _proposer(tiny, graphs: bool, window: int = 64) -> Eagle3Proposer:
    cfg, loaded = tiny
    p = Eagle3Proposer(loaded.head, loaded.info.hidden_layers, cfg, loaded.info.vocab_hash)  # own sessions, one head
    assert p.chain_graphs is None  # CPU: no graphs unless given
    if graphs:
        p.chain_graphs = p.build_chain_graphs(window, p.info.max_block_size)
    return p


FEATS = FakeFeatures(VOCAB, 3 * TARGET_H)


@pytest.mark.parametrize("live", ["graphs", "eager"])
def test_graph_bodies_draft_what_the_eager_chain_drafts(tiny, live):
    """Greedy: a long-lived session on one path drafts, after every random accept / rollback step, the block a fresh
    session on the other path drafts (catch-up graphs for short catch-ups, the eager one for the prompt)."""
    made = []

    def make():
        first = not made
        made.append(1)
        return _proposer(tiny, graphs=first == (live == "graphs"))

    rollback_matches_fresh(make, FEATS, VOCAB, steps=14, k=5, sampled=False)


def test_sampled_graph_chains_sync_like_fresh_ones(tiny):
    rollback_matches_fresh(lambda: _proposer(tiny, graphs=True), FEATS, VOCAB, steps=10, k=4, sampled=True)


def test_window_follows_the_session_that_drafts(tiny):
    """Two sessions take turns on one window (each turn copies its entries in), greedy, against eager."""
    check_sessions_take_turns(_proposer(tiny, graphs=False), _proposer(tiny, graphs=True), FEATS, VOCAB)


def test_sampled_graph_q_is_the_sampling_transform_of_the_head_logits(sharp):
    """q of drafted token 1 equals the eager chain's (same head logits, the target sampler's transform); a sampled
    request whose q is one-hot (top_k = 1) drafts the greedy chain, so every later q row follows the drafted tokens."""
    eager, graphs = _proposer(sharp, graphs=False), _proposer(sharp, graphs=True)
    seq = [10, 20, 30, 40, 2, 8]
    rows = FEATS.rows(seq, 0, 5)
    sampling = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=0)
    blocks = {}
    for name, p in (("eager", eager), ("graphs", graphs)):
        p.start("s", seq, rows, sampling)
        blocks[name] = p.propose("s", 6, [], None, 4)
        p.start("one", seq, rows, SamplingParams(temperature=1.0, top_k=1, seed=0))
        p.start("g", seq, rows, SamplingParams())
        one, greedy = p.propose("one", 6, [], None, 4), p.propose("g", 6, [], None, 4)
        assert one.token_ids == greedy.token_ids and len(set(greedy.token_ids)) > 1, name
        assert torch.equal(one.probs, torch.nn.functional.one_hot(torch.tensor(one.token_ids), VOCAB).float())
    got, want = blocks["graphs"], blocks["eager"]
    assert got.probs.shape == (4, VOCAB) and got.probs.dtype == torch.float32
    torch.testing.assert_close(got.probs[0], want.probs[0], atol=1e-6, rtol=1e-5)
    assert all(got.probs[i, t] > 0 for i, t in enumerate(got.token_ids))
    torch.testing.assert_close(got.probs.sum(-1), torch.ones(4))


def test_sampled_graph_draws_follow_their_q(sharp):
    """Token 1 follows q_1, token 2 follows the q_2 reported with it, and another token 1's q_2 is rejected."""
    p = _proposer(sharp, graphs=True, window=8)  # small window: fast
    seq = [1, 2, 3, 4, 5, 6]
    check_two_draws_follow_q(p, seq, FEATS.rows(seq, 0, 5), runs=1200)


def test_chain_past_the_window_drafts_eagerly(tiny):
    eager, graphs = _proposer(tiny, graphs=False), _proposer(tiny, graphs=True, window=4)
    seq = [1, 2, 3, 4, 5, 6, 7]  # 6 confirmed entries > the window's 4
    assert not graphs.chain_graphs.fits(6, 4) and graphs.chain_graphs.fits(4, 4)
    for p in (eager, graphs):
        p.start("s", seq, FEATS.rows(seq, 0, 6), SamplingParams())
    assert graphs.propose("s", 7, [], None, 4) == eager.propose("s", 7, [], None, 4)


TREES = [
    TreeSpec(num_nodes=10, top_k=3, depth=4),
    TreeSpec(num_nodes=3, top_k=4, depth=2),
    TreeSpec(num_nodes=40, top_k=2, depth=5),
    TreeSpec(num_nodes=5, top_k=1, depth=4),
]


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"{t.num_nodes}-{t.top_k}-{t.depth}")
@pytest.mark.parametrize("live", ["graphs", "eager"])
def test_tree_body_builds_the_tree_the_eager_builder_builds(sharp, tree, live):
    """Greedy: through random accepted paths and rollbacks, the tree body's trees (tokens and parents) equal tree.py's
    on a fresh session of the other path, for trees whose cut keeps part of a level or every node."""
    made = []

    def make():
        first = not made
        made.append(1)
        return _proposer(sharp, graphs=first == (live == "graphs"))

    rollback_matches_fresh(make, FEATS, VOCAB, tree=tree, steps=8, sampled=False)


@pytest.mark.parametrize("tree", TREES[:2], ids=lambda t: f"{t.num_nodes}-{t.top_k}-{t.depth}")
def test_sampled_tree_bodies_sync_like_fresh_ones(sharp, tree):
    rollback_matches_fresh(lambda: _proposer(sharp, graphs=True), FEATS, VOCAB, tree=tree, steps=8, sampled=True)


def test_sampled_tree_body_declares_draws_without_replacement(sharp):
    """Siblings are distinct draws; a later sibling's declared q excludes the earlier ones and is q renormalised; a
    request whose q has fewer tokens than top_k (top_k = 2 < the tree's 3) keeps only real draws."""
    p = _proposer(sharp, graphs=True)
    seq = [10, 20, 30, 40, 2, 8]
    for sampling, spec in (
        (SamplingParams(temperature=1.0, seed=3), TreeSpec(num_nodes=12, top_k=3, depth=3)),
        (SamplingParams(temperature=1.0, top_k=2, seed=3), TreeSpec(num_nodes=12, top_k=3, depth=3)),
    ):
        p.start("s", seq, FEATS.rows(seq, 0, 5), sampling)
        block = p.propose("s", 6, [], None, 0, spec)
        p.release("s")
        assert block.probs.shape == (len(block), VOCAB)
        if sampling.top_k == 2:
            assert len(block) == 2 + 2 * 2 + 3 * 2  # two children of the root, two of each of its 2, then of the best 3
        else:
            assert len(block) == 12
        for i, parent in enumerate(block.parents):
            earlier = [j for j in range(i) if block.parents[j] == parent]
            assert len({block.token_ids[j] for j in earlier + [i]}) == len(earlier) + 1  # distinct siblings
            for j in earlier:
                assert float(block.probs[i, block.token_ids[j]]) == 0.0
            assert float(block.probs[i, block.token_ids[i]]) > 0.0
            torch.testing.assert_close(block.probs[i].sum(), torch.tensor(1.0))


def test_sampled_tree_cut_keeps_the_first_draws(sharp):
    """A cut that keeps 3 of 4 drawn children of the root must keep the first 3 drawn (a node's own q must not decide
    whether it survives: tree.py): the first kept child declares q itself, each later one q without exactly the
    earlier kept ones; keeping the 3 likeliest (skipping a draw) breaks this for some seed."""
    graphs, eager = _proposer(sharp, graphs=True), _proposer(sharp, graphs=False)
    seq = [10, 20, 30, 40, 2, 8]
    eager.start("e", seq, FEATS.rows(seq, 0, 5), SamplingParams(temperature=1.0, seed=0))
    q = eager.propose("e", 6, [], None, 1).probs[0]  # the root's q (same head logits)
    for seed in range(40):
        graphs.start("s", seq, FEATS.rows(seq, 0, 5), SamplingParams(temperature=1.0, seed=seed))
        block = graphs.propose("s", 6, [], None, 0, TreeSpec(num_nodes=3, top_k=4, depth=2))
        graphs.release("s")
        roots = [i for i, parent in enumerate(block.parents) if parent == -1]
        torch.testing.assert_close(block.probs[roots[0]], q, atol=1e-6, rtol=1e-5)
        for j, i in enumerate(roots):
            removed = {t for t in range(VOCAB) if q[t] > 0 and block.probs[i, t] == 0}
            assert removed == {block.token_ids[r] for r in roots[:j]}, f"seed {seed}: child {j} of the root"


# ---------------------------------------------------------------- GPU: captured graphs
def _demo_proposer(window: int):  # the shipped demo's head, float32 on the GPU
    return build_proposer(
        DrafterConfig(
            "eagle3",
            checkpoint=demo_checkpoint("eagle3"),
            target_checkpoint=demo_checkpoint("target"),
            device="cuda",
            dtype="float32",
            max_block_size=4,
            graph_window=window,
        )
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_sampled_chain_equals_its_bodies_run_eagerly():
    """The same sessions (same seeds, same syncs and rollbacks) through replays and through the bodies: tokens equal,
    q close; every graph captured."""
    replayed, eager_bodies = _demo_proposer(1024), _demo_proposer(1024)
    assert replayed.chain_graphs.capture_errors == {}
    built = len(replayed.chain_graphs._keys())  # chains, catch-ups and every catch-up + chain block, at build
    assert replayed.chain_graphs.captured == built
    eager_bodies.chain_graphs._graphs.clear()  # the bodies then run eagerly over the same buffers ...
    eager_bodies.chain_graphs._pool = None  # ... and no catch-up + chain graph is captured on first use
    width = 3 * replayed.head.cfg.target_hidden_size
    feats = torch.randn(64, width, generator=torch.Generator().manual_seed(0))
    seq = list(range(20, 60))
    sampling = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=3)
    blocks = {}
    for name, p in (("replayed", replayed), ("eager", eager_bodies)):
        p.start("s", seq, feats[: len(seq) - 1], sampling)
        got = [p.propose("s", len(seq), [], None, 4)]  # the prompt's catch-up runs eagerly
        got.append(p.propose("s", len(seq), [7], feats[len(seq) - 1 : len(seq)], 3))  # a catch-up graph of 1
        got.append(p.propose("s", len(seq) - 1, [9, 11], feats[len(seq) - 2 : len(seq)], 4))  # a rollback
        got.append(p.propose("s", len(seq) + 1, [13, 15, 17], feats[len(seq) : len(seq) + 3], 4))  # catch-up of 3
        blocks[name] = got
    for a, b in zip(blocks["replayed"], blocks["eager"]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.probs, b.probs, atol=1e-5, rtol=1e-4)
    assert replayed.chain_graphs.captured == built  # nothing captured on first use
    assert replayed.chain_graphs.capture_errors == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_trees_draft_what_the_eager_builder_drafts():
    """float32 on the demo: every greedy tree from the captured tree graphs (tokens and parents) equals tree.py's on
    the eager path, and speculation through them gives target-only's tokens; a sampled tree replayed equals its body
    run eagerly, seed for seed."""
    engine = build_engine(EngineConfig(model=demo_checkpoint("target"), device="cuda", dtype="float32"))
    graphs, eager = _demo_proposer(1024), _demo_proposer(0)
    tree = TreeSpec(num_nodes=16, top_k=2, depth=4)
    check_graphs_draft_as_eager(engine, graphs, eager, ("def parse_args(argv):\n", "import os\n"), "float32", tree=tree)
    assert graphs.chain_graphs.trees.captured == 1 and graphs.chain_graphs.trees.capture_errors == {}
    bodies = _demo_proposer(1024)
    bodies.chain_graphs.trees._pool = None  # never captured: the body runs eagerly over the same buffers
    width = 3 * graphs.head.cfg.target_hidden_size
    feats = torch.randn(64, width, generator=torch.Generator().manual_seed(0))
    seq = list(range(20, 60))
    for p in (graphs, bodies):
        p.start("t", seq, feats[: len(seq) - 1], SamplingParams(temperature=0.8, top_k=50, seed=3))
    for step, spec in enumerate((tree, TreeSpec(num_nodes=6, top_k=4, depth=2))):
        a, b = (
            p.propose("t", len(seq) + step, [7 + step], feats[len(seq) - 1 + step : len(seq) + step], 0, spec)
            for p in (graphs, bodies)
        )
        assert (a.token_ids, a.parents) == (b.token_ids, b.parents)
        torch.testing.assert_close(a.probs, b.probs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("sampled", [False, True])
def test_every_shape_a_chain_propose_replays_is_captured_with_the_others(tiny, sampled):
    """No request pays a capture: every graph key a chain propose runs (catch-up + chain blocks of each catch-up
    size, chains, catch-ups), through random accepts and rollbacks at every k, is among the keys capture() captures
    when the drafter is built (before: the catch-up + chain blocks were captured on first use, mid-request)."""
    proposers = []

    def make():
        p = _proposer(tiny, graphs=True)
        ran = p.chain_graphs.ran = []
        inner = p.chain_graphs._run
        p.chain_graphs._run = lambda key: (ran.append(key), inner(key))[1]
        proposers.append(p)
        return p

    for k in (1, 3, 5):
        rollback_matches_fresh(make, FEATS, VOCAB, steps=6, k=k, seed=k, sampled=sampled)
    ran = {key for p in proposers for key in p.chain_graphs.ran}
    assert any(key[0] == "block" for key in ran)
    captured = set(proposers[0].chain_graphs._keys())
    assert ran <= captured, sorted(ran - captured)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_built_drafter_captured_every_block_and_captures_nothing_while_drafting():
    """On CUDA: the catch-up + chain blocks are captured when the drafter is built (none failed), and a request's
    proposes replay them without capturing more (before: each (n, k) captured on first use, mid-request)."""
    target = demo_checkpoint("target")
    engine = build_engine(EngineConfig(model=target, device="cuda", dtype="float32", cuda_graphs=False))
    proposer = build_proposer(
        DrafterConfig(
            "eagle3",
            checkpoint=demo_checkpoint("eagle3"),
            target_checkpoint=target,
            device="cuda",
            dtype="float32",
            max_block_size=4,
        )
    )
    graphs = proposer.chain_graphs
    assert graphs is not None and not graphs.capture_errors, graphs.capture_errors
    assert graphs.captured == len(graphs._keys())
    prompt = engine.tokenizer.encode("def parse_args(argv):\n").ids
    want = engine.generate_greedy(prompt, 40)
    for k in (1, 4):
        assert speculative_greedy(engine, proposer, f"k{k}", prompt, k, 40, SpecStats())[:40] == want
    assert graphs.captured == len(graphs._keys())


@pytest.mark.parametrize("skipped", [7, 17, 40])
def test_a_long_catch_up_runs_as_catch_up_replays_and_drafts_what_an_eager_drafter_drafts(tiny, skipped):
    """Steps skipped while adaptive drafting was off leave the drafter `skipped` tokens behind (their rows sent in one
    call): the catch-up runs as replays of the captured catch-up sizes (largest first, the last part with the chain),
    not eagerly at a new length (a first use mid-request: the H200's EAGLE-3 probes paid 14-17 ms), and the block
    equals a fresh eager drafter's over the same S."""
    live = _proposer(tiny, graphs=True)
    ran = skipped_catch_up_keys(live, _proposer(tiny, graphs=False), FEATS, VOCAB, skipped)
    assert all(key[0] != "catch_up" or key[1] in live.chain_graphs.long_sizes or key[1] <= 6 for key in ran)
    if skipped > 6:
        assert ran[0][0] == "catch_up" and ran[-1][0] == "block", ran
