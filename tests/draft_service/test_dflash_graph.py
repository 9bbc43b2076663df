"""DFlash blocks as CUDA graphs (draft_service/dflash_graph.py).

On the CPU the graphs' bodies run eagerly over the same static buffers (a fixed window of context rows with a
device-side length mask, the pending token and its position in device scalars, fixed tokens read in place, the new
rows' context K/V written into the window): a session driven through random accept patterns and rollbacks drafts
what a fresh eager drafter drafts (greedy, one pass and several); each propose computes the K/V of only its new rows;
sampled, q is each pass's row and the tokens follow it. On a GPU (marked gpu): captured graphs
draft what the eager proposer drafts on the shipped demo, the speculative output equals target-only, and a sampled
block replayed from its graph equals the same block run through the passes eagerly, seed for seed.
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
)

from specserve.contract.types import SamplingParams
from specserve.draft_service.dflash import DFlashConfig, DFlashModel, DFlashProposer, save_dflash
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.registry import build_proposer

VOCAB, TH, LAYERS = 40, 12, (0, 2)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module", params=[1, 3], ids=["one_pass", "three_passes"])
def ckpt(request, tmp_path_factory):
    torch.manual_seed(0)
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
        denoise_steps=request.param,
    )
    model = DFlashModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
    out = tmp_path_factory.mktemp("dflash_graph") / "d"
    save_dflash(model, out)
    return out


def proposer(path, graphs: bool, window: int = 64) -> DFlashProposer:
    p = build_proposer(DrafterConfig(family="dflash", checkpoint=path, dtype="float64", max_block_size=4))
    assert p.block_graphs is None  # CPU: no graphs unless given
    if graphs:
        p.block_graphs = p.build_block_graphs(window, p.info.max_block_size)
    return p


@pytest.mark.parametrize("live", ["graphs", "eager"])
def test_graph_passes_draft_what_the_eager_proposer_drafts(ckpt, live):
    made = []

    def make():
        first = not made
        made.append(1)
        return proposer(ckpt, graphs=first == (live == "graphs"))

    rollback_matches_fresh(make, FakeFeatures(VOCAB, len(LAYERS) * TH), VOCAB, steps=12, sampled=False)


def test_sampled_graph_blocks_sync_like_fresh_ones(ckpt):
    rollback_matches_fresh(
        lambda: proposer(ckpt, graphs=True), FakeFeatures(VOCAB, len(LAYERS) * TH), VOCAB, steps=8, sampled=True
    )


def test_window_rows_follow_the_session_that_drafts(ckpt):
    """Two sessions take turns on one window (each draft must copy its own rows in), greedy, against eager."""
    check_sessions_take_turns(
        proposer(ckpt, graphs=False), proposer(ckpt, graphs=True), FakeFeatures(VOCAB, len(LAYERS) * TH), VOCAB
    )


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_context_kv_is_extended_by_the_new_rows_not_recomputed(ckpt, graphs):
    """Each propose computes the context K/V of only the rows it adds (accepted tokens + the old pending one; graphs:
    in the extend body, straight into the window), writes them in place into the session's buffers (no reallocation,
    no copy of the older rows), and the cache equals the K/V of all rows computed at once."""
    feats = FakeFeatures(VOCAB, len(LAYERS) * TH)
    p = proposer(ckpt, graphs=graphs)
    rows = []
    context_kv = p.model.context_kv
    p.model.context_kv = lambda f, pos: rows.append(f.shape[0]) or context_kv(f, pos)
    seq = list(range(1, 11))
    p.start("s", seq, feats.rows(seq, 0, 9), SamplingParams())
    block = p.propose("s", 10, [], None, 4)
    fs = p.session("s").family_state
    buffers = [t.data_ptr() for t in fs.keys + fs.values]
    for step in range(5):
        accepted = list(block.token_ids[: step % 3])
        grown = seq + accepted + [(step * 5 + 3) % VOCAB]
        block = p.propose("s", len(seq), grown[len(seq) :], feats.rows(grown, len(seq) - 1, len(grown) - 1), 4)
        assert rows[-1] == len(accepted) + 1, f"step {step}: {rows}"
        seq = grown
    assert rows[0] == 9 and len(rows) == 6  # the prompt's rows once, then only the new ones
    assert [t.data_ptr() for t in fs.keys + fs.values] == buffers  # written in place
    with torch.no_grad():
        want = context_kv(feats.rows(seq, 0, len(seq) - 1).double(), torch.arange(len(seq) - 1))
    for (k, v), (wk, wv) in zip(fs.kv, want):
        torch.testing.assert_close(k, wk)
        torch.testing.assert_close(v, wv)
    if graphs:  # the window holds the same rows
        window = p.block_graphs
        for (k, v), keys, values in zip(fs.kv, window.keys, window.values):
            torch.testing.assert_close(keys[: len(seq) - 1], k)
            torch.testing.assert_close(values[: len(seq) - 1], v)


def test_a_rollback_recopies_the_window_rows_it_replaced(ckpt):
    """Context rows 8..10 replaced after a draft: the window must copy them again (q equal to a fresh session's)."""
    feats = FakeFeatures(VOCAB, len(LAYERS) * TH)
    sampling = SamplingParams(temperature=1.0, seed=0)
    seq, new = list(range(1, 13)), list(range(1, 9)) + [30, 31, 32, 33]
    live, fresh = proposer(ckpt, graphs=True), proposer(ckpt, graphs=True)
    live.start("s", seq, feats.rows(seq, 0, 11), sampling)
    live.propose("s", 12, [], None, 4)
    live.session("s").generator.manual_seed(1)
    got = live.propose("s", 8, new[8:], feats.rows(new, 8, 11), 4)
    fresh.start("f", new, feats.rows(new, 0, 11), sampling)
    fresh.session("f").generator.manual_seed(1)
    want = fresh.propose("f", 12, [], None, 4)
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(got.probs, want.probs, atol=1e-6, rtol=1e-5)


def test_sampled_graph_q_is_each_pass_row(ckpt):
    p = proposer(ckpt, graphs=True)
    feats = FakeFeatures(VOCAB, len(LAYERS) * TH)
    seq = [1, 2, 3, 4, 5, 6]
    p.start("s", seq, feats.rows(seq, 0, 5), SamplingParams(temperature=1.0, seed=3))
    block = p.propose("s", 6, [], None, 4)
    t, m, kv = list(block.token_ids), p.model, p.session("s").family_state.kv
    passes = p.passes
    with torch.no_grad():
        rows = [
            m.block_logits(torch.tensor([6]), 5, kv, given=torch.tensor(t[:n], dtype=torch.int64))
            for n in range(passes)
        ]
    want = torch.stack([rows[min(i, passes - 1)][i] for i in range(4)])  # token i: the row of the pass that fixed it
    torch.testing.assert_close(block.probs, torch.softmax(want.double(), -1).float(), rtol=1e-5, atol=1e-6)


def test_sampled_graph_draws_follow_their_q(ckpt):
    """Token 2 drawn given token 1 (several passes: its q depends on token 1, which the helper's control needs)."""
    p = proposer(ckpt, graphs=True, window=8)  # small window: fast
    if p.passes == 1:
        pytest.skip("one pass: q_2 does not depend on token 1 (test_sampled_graph_q_is_each_pass_row covers q)")
    feats = FakeFeatures(VOCAB, len(LAYERS) * TH)
    seq = [1, 2, 3, 4, 5, 6]
    check_two_draws_follow_q(p, seq, feats.rows(seq, 0, 5), runs=1200)


def test_context_past_the_window_drafts_eagerly(ckpt):
    feats = FakeFeatures(VOCAB, len(LAYERS) * TH)
    eager, graphs = proposer(ckpt, graphs=False), proposer(ckpt, graphs=True, window=4)
    seq = [1, 2, 3, 4, 5, 6]  # 5 context rows > the window's 4
    assert not graphs.block_graphs.fits(len(seq) - 1, 4) and graphs.block_graphs.fits(4, 4)
    for p in (eager, graphs):
        p.start("s", seq, feats.rows(seq, 0, 5), SamplingParams())
    assert graphs.propose("s", 6, [], None, 4) == eager.propose("s", 6, [], None, 4)


# ---------------------------------------------------------------- GPU: captured graphs
PROMPTS = ("def parse_args(argv):\n", "class Stack:\n    def push(self, x):", "import os\n")


def _demo_proposer(dtype, window):
    from specserve.paths import demo_checkpoint

    return build_proposer(
        DrafterConfig(
            "dflash",
            checkpoint=demo_checkpoint("dflash"),
            target_checkpoint=demo_checkpoint("target"),
            device="cuda",
            dtype=dtype,
            max_block_size=4,
            graph_window=window,
        )
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_blocks_on_the_demo_draft_what_the_eager_path_drafts(dtype):
    """Both drafters get the same syncs; each step both draft on the same sequence and the captured graphs' blocks are
    verified. float32: every block equal and the output = target-only; bf16 (the graphs attend over the whole masked
    window, so their sums round differently and near-ties may split): at least 90 % of the blocks equal."""
    from specserve.paths import demo_checkpoint
    from specserve.target_service.factory import EngineConfig, build_engine

    engine = build_engine(EngineConfig(model=demo_checkpoint("target"), device="cuda", dtype=dtype))
    graphs, eager = _demo_proposer(dtype, 1024), _demo_proposer(dtype, 0)
    assert eager.block_graphs is None and graphs.block_graphs.capture_errors == {}
    assert graphs.block_graphs.captured == 4 * 2 + 5  # blocks of 1..4, greedy and sampled; extensions by 1..5 rows
    check_graphs_draft_as_eager(engine, graphs, eager, PROMPTS, dtype)


@pytest.mark.gpu
@needs_cuda
def test_captured_sampled_block_equals_its_passes_run_eagerly():
    replayed, eager_passes = _demo_proposer("float32", 1024), _demo_proposer("float32", 1024)
    eager_passes.block_graphs._graphs.clear()  # the passes then run eagerly over the same buffers
    width = len(replayed.info.hidden_layers) * replayed.model.cfg.target_hidden_size
    feats = torch.randn(64, width, generator=torch.Generator().manual_seed(0))
    seq = list(range(20, 60))
    sampling = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=3)
    blocks = {}
    for name, p in (("replayed", replayed), ("eager", eager_passes)):
        p.start("s", seq, feats[: len(seq) - 1], sampling)
        got = [p.propose("s", len(seq), [], None, 4)]
        got.append(p.propose("s", len(seq), [7], feats[len(seq) - 1 : len(seq)], 3))
        got.append(p.propose("s", len(seq) - 1, [9, 11], feats[len(seq) - 2 : len(seq)], 4))  # a rollback
        blocks[name] = got
    for a, b in zip(blocks["replayed"], blocks["eager"]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.probs, b.probs, atol=1e-5, rtol=1e-4)
