"""MTP chains as CUDA graphs (draft_service/mtp_graph.py).

On the CPU the graphs' bodies run eagerly over the same static buffers (block table, lengths and slots set on the
device, the paged torch attention over a fixed window, the chosen experts gathered, tokens written in place): a
session driven through random accept patterns and rollbacks drafts what a fresh eager drafter drafts (greedy), or
what a fresh one through the bodies drafts (sampled, reseeded alike); the sampled q is the eager chain's; on the
shipped demo (and the demo@small-moonlight layer) the bodies draft every block the eager chain drafts in a greedy
speculation equal to target-only. On a GPU (marked gpu): the captured graphs do the same on the demo and at full size
(demo@moonlight-16b-a3b), float32.
"""

from __future__ import annotations

import pytest
import torch
from draft_helpers import (
    FakeFeatures,
    check_graphs_draft_as_eager,
    check_two_draws_follow_q,
    rollback_matches_fresh,
    skipped_catch_up_keys,
    with_graph_bodies,
)

from specserve.contract.types import SamplingParams
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.mtp import MTPProposer
from specserve.draft_service.mtp_graph import gathered_experts
from specserve.draft_service.registry import build_proposer
from specserve.kernels.moe_reference import moe_reference
from specserve.paths import demo_checkpoint

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
V, H = 64, 32
PROMPTS = ("def parse_args(argv):\n", "class Stack:\n    def push(self, x):", "import os\n")


def config(target, **kw):
    kw = dict(dict(dtype="float64", kv_num_blocks=64, max_block_size=6, kv_block_size=4), **kw)
    return DrafterConfig(family="mtp", target_checkpoint=target, **kw)


def test_gathered_experts_compute_the_moe_reference():
    """Fresh random experts and routing (repeated experts within a batch, across its tokens); both accumulate the
    weighted expert outputs in float32 (in another order), so they agree to float32 rounding."""
    g = torch.Generator().manual_seed(0)
    t, h, e, i, k = 7, 16, 6, 12, 3
    x = torch.randn(t, h, generator=g, dtype=torch.float64)
    w13, w2 = (
        torch.randn(e, 2 * i, h, generator=g, dtype=torch.float64),
        torch.randn(e, h, i, generator=g, dtype=torch.float64),
    )
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        gathered_experts(x, w13, w2, ids, weights), moe_reference(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-4
    )  # outputs ~ 50


def test_cpu_drafter_has_no_graphs_unless_given(tiny_ckpt):
    p = build_proposer(config(tiny_ckpt("target_mtp")))
    assert p.chain_graphs is None
    g = with_graph_bodies(build_proposer(config(tiny_ckpt("target_mtp"))))
    assert g.chain_graphs.captured == 0 and g.chain_graphs.window == 256


def _maker(target, graphs: str):
    """make() for rollback_matches_fresh: the first proposer (the live one) through the graph bodies when graphs is
    'live', every one when 'all'; the others eager."""
    loaded = build_proposer(config(target))
    made = []

    def make():
        p = MTPProposer(loaded.layer, loaded.spec, config(target), loaded.info.vocab_hash)
        if graphs == "all" or not made:
            with_graph_bodies(p)
        made.append(p)
        return p

    return make


def test_graph_bodies_draft_what_the_eager_chain_drafts(tiny_ckpt):
    """Greedy: a long-lived session through the bodies, after every random accept / rollback step, drafts the block a
    fresh eager session drafts (feed bodies for short catch-ups, the eager catch-up for the prompt)."""
    rollback_matches_fresh(_maker(tiny_ckpt("target_mtp"), "live"), FakeFeatures(V, H), V, steps=14, k=5, sampled=False)


def test_sampled_graph_chains_sync_like_fresh_ones(tiny_ckpt):
    """Sampled: the noise follows the session's generator, so a live session's blocks (tokens and q) equal a fresh
    session's reseeded alike, through rollbacks."""
    rollback_matches_fresh(_maker(tiny_ckpt("target_mtp"), "all"), FakeFeatures(V, H), V, steps=10, k=4, sampled=True)


def test_sampled_graph_q_is_the_eager_chains(tiny_ckpt):
    """The first drafted token's q (the same state on both paths) is the eager chain's; each drafted token has q > 0;
    and the draws follow their q (chi-square, with its negative control)."""
    target = tiny_ckpt("target_mtp")
    prompt = [3, 17, 42, 3, 17, 8, 3, 17]
    rows = FakeFeatures(V, H).rows(prompt, 0, len(prompt) - 1)
    sampling = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=0)
    blocks = []
    for p in (build_proposer(config(target)), with_graph_bodies(build_proposer(config(target)))):
        p.start("s", prompt, rows, sampling)
        blocks.append(p.propose("s", len(prompt), [], None, 3))
    torch.testing.assert_close(blocks[1].probs[0], blocks[0].probs[0], rtol=1e-6, atol=1e-7)
    assert all(blocks[1].probs[i, t] > 0 for i, t in enumerate(blocks[1].token_ids))
    check_two_draws_follow_q(
        with_graph_bodies(build_proposer(config(target, kv_num_blocks=16)), window=16), prompt, rows, runs=1200
    )


def test_chain_past_the_window_drafts_eagerly(tiny_ckpt):
    """A chain that would reach past the window takes the eager path (and still drafts what it drafts)."""
    target = tiny_ckpt("target_mtp")
    eager, graphs = build_proposer(config(target)), with_graph_bodies(build_proposer(config(target)), window=8)
    seq = [1, 2, 3, 4, 5, 6, 7]
    rows = FakeFeatures(V, H).rows(seq, 0, len(seq) - 1)
    assert graphs.chain_graphs.fits(len(seq), 3) and not graphs.chain_graphs.fits(len(seq), 4)
    for p in (eager, graphs):
        p.start("s", seq, rows, SamplingParams())
    assert graphs.propose("s", len(seq), [], None, 4) == eager.propose("s", len(seq), [], None, 4)


def _demo_pair(target, device: str = "cpu", dtype: str = "float32", window: int = 1024):
    """(the shipped demo MTP through its graphs: bodies on a CPU, captured on CUDA; the same layer eager)."""

    def build(w):
        return build_proposer(
            DrafterConfig(
                family="mtp",
                checkpoint=demo_checkpoint("mtp"),
                target_checkpoint=target,
                device=device,
                dtype=dtype,
                max_block_size=4,
                graph_window=w,
            )
        )

    graphs, eager = build(window), build(0)
    if device == "cpu":
        graphs.chain_graphs = graphs.build_chain_graphs(window, 4)
    return graphs, eager


@pytest.mark.parametrize("target", ["demo", "demo@small-moonlight"])
def test_graph_bodies_on_the_shipped_mtp_draft_what_the_eager_chain_drafts(target):
    """The shipped demo's MTP layer (and its scaled version): every block the bodies draft in a greedy speculation is
    the eager chain's, and the output is target-only's, float32."""
    from specserve.target_service.factory import EngineConfig, build_engine

    model = demo_checkpoint("target") if target == "demo" else target
    engine = build_engine(EngineConfig(model=model, device="cpu", dtype="float32"))
    graphs, eager = _demo_pair(model)
    check_graphs_draft_as_eager(engine, graphs, eager, PROMPTS[:2], "float32", max_new=24)


# ---------------------------------------------------------------- GPU: captured graphs
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("target", ["demo", "demo@moonlight-16b-a3b"])
def test_captured_chains_draft_what_the_eager_chain_drafts(target):
    """Every feed and chain graph captured; both drafters get the same syncs and each step both draft on the same
    sequence, the captured graphs' blocks verified: every block equal and the output = target-only (float32)."""
    from specserve.target_service.factory import EngineConfig, build_engine

    model = demo_checkpoint("target") if target == "demo" else target
    engine = build_engine(EngineConfig(model=model, device="cuda", dtype="float32", cuda_graphs=False))
    graphs, eager = _demo_pair(model, "cuda")
    assert eager.chain_graphs is None and graphs.chain_graphs.capture_errors == {}
    assert graphs.chain_graphs.captured == 4 * 2 + 5  # chains k = 1..4 greedy and sampled, feeds 1..5
    check_graphs_draft_as_eager(engine, graphs, eager, PROMPTS, "float32")


@pytest.mark.gpu
@needs_cuda
def test_captured_chains_in_bf16_mostly_draft_as_eager():
    """bf16 on the demo (the fused MoE and the paged attention's float32 scores against the eager path's bf16 ones:
    near-ties may split): at least 90 % of the blocks equal, drafts accepted."""
    from specserve.target_service.factory import EngineConfig, build_engine

    engine = build_engine(EngineConfig(model=demo_checkpoint("target"), device="cuda", dtype="bfloat16"))
    graphs, eager = _demo_pair(demo_checkpoint("target"), "cuda", "bfloat16")
    assert graphs.chain_graphs.capture_errors == {} and graphs.chain_graphs.captured == 13
    check_graphs_draft_as_eager(engine, graphs, eager, PROMPTS, "bfloat16")


@pytest.mark.parametrize("skipped", [6, 40])
def test_a_long_catch_up_runs_as_feed_replays_and_drafts_what_an_eager_drafter_drafts(tiny_ckpt, skipped):
    """Steps skipped while adaptive drafting was off leave the drafter `skipped` tokens behind (their rows sent in one
    call): the catch-up runs as feed replays of feed_max entries, then the rest's with the chain, never eagerly at a
    length met for the first time mid-request, and the block equals a fresh eager drafter's over the same S."""
    target = tiny_ckpt("target_mtp")
    live = with_graph_bodies(build_proposer(config(target)))
    ran = skipped_catch_up_keys(live, build_proposer(config(target)), FakeFeatures(V, H), V, skipped)
    feed_max = live.chain_graphs.feed_max
    full = -(-skipped // feed_max) - 1  # feed_max-entry replays before the last feed (skipped entries to feed)
    assert [key for key in ran if key[0] == "feed"] == [("feed", feed_max)] * full + [
        ("feed", skipped - full * feed_max)
    ]
    assert all(key[0] in ("feed", "chain") for key in ran), ran
