"""The draft LM's chains as CUDA graphs (draft_service/model_graph.py).

On the CPU the graphs' bodies run eagerly over the same static buffers (block table, lengths and slots set on the
device, the paged torch attention over a fixed window, tokens written in place): a session driven through random
accept patterns and rollbacks drafts what a fresh eager drafter drafts, greedy; sampled, q is the target sampler's
transform of the draft model's own logits and the tokens follow it. On a GPU (marked gpu): captured graphs draft what
the eager chain drafts on the shipped demo, the speculative output equals target-only, and a sampled chain replayed
from its graphs equals the same chain run through the bodies eagerly, seed for seed.
"""

from __future__ import annotations

import pytest
import torch
from draft_helpers import (
    check_graphs_draft_as_eager,
    check_two_draws_follow_q,
    rollback_matches_fresh,
    with_graph_bodies,
)

from specserve.contract.types import SamplingParams
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.model_drafter import ModelProposer
from specserve.draft_service.registry import build_proposer
from specserve.models.probs import target_probs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


DRAFT = "target_dense"  # a 3-layer llama: later layers' K/V depend on the causal mask among a feed's rows


def config(tiny_ckpt, **kw):
    kw = dict(dict(dtype="float64", kv_num_blocks=64, max_block_size=6, kv_block_size=4), **kw)
    return DrafterConfig(family="model", checkpoint=tiny_ckpt(DRAFT), target_checkpoint=tiny_ckpt("target_moe"), **kw)


def test_cpu_drafter_has_no_graphs_unless_given(tiny_ckpt):
    p = build_proposer(config(tiny_ckpt))
    assert p.chain_graphs is None and p.model.attn_backend is None
    g = with_graph_bodies(build_proposer(config(tiny_ckpt)))
    assert g.chain_graphs.captured == 0 and g.chain_graphs.window == 256


@pytest.mark.parametrize("live", ["graphs", "eager"])
def test_graph_bodies_draft_what_the_eager_chain_drafts(tiny_ckpt, live):
    """Greedy: a long-lived session on one path, after every random accept / rollback step, drafts the block a fresh
    session on the other path drafts (feed graph for short catch-ups, eager feed for the prompt)."""
    from specserve.models.loader import load_model

    cfg = config(tiny_ckpt)
    model, mcfg = load_model(cfg.checkpoint, dtype=torch.float64, progress=False)
    info = build_proposer(cfg).info
    made = []

    def make():
        p = ModelProposer(model, mcfg, cfg, info.vocab_size, info.vocab_hash)
        first = not made
        made.append(p)
        return with_graph_bodies(p) if first == (live == "graphs") else p

    rollback_matches_fresh(make, None, 64, steps=14, k=5, sampled=False)


def test_sampled_graph_chains_sync_like_fresh_ones(tiny_ckpt):
    """Sampled: the noise follows the session's generator, so a live session's blocks (tokens and q) equal a fresh
    session's reseeded alike, through rollbacks."""
    from specserve.models.loader import load_model

    cfg = config(tiny_ckpt)
    model, mcfg = load_model(cfg.checkpoint, dtype=torch.float64, progress=False)
    info = build_proposer(cfg).info
    rollback_matches_fresh(
        lambda: with_graph_bodies(ModelProposer(model, mcfg, cfg, info.vocab_size, info.vocab_hash)),
        None,
        64,
        steps=10,
        k=4,
        sampled=True,
    )


def test_sampled_graph_q_is_the_sampling_transform_of_the_draft_logits(tiny_ckpt):
    sampling = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=0)
    p = with_graph_bodies(build_proposer(config(tiny_ckpt)))
    seq = [5, 9, 2, 33, 7]
    p.start("s", seq, None, sampling)
    block = p.propose("s", len(seq), [], None, 3)
    assert block.probs.shape == (3, 64) and block.probs.dtype == torch.float32
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt(DRAFT), dtype=torch.float64)
    with torch.no_grad():
        logits = hf(torch.tensor([seq + list(block.token_ids[:2])])).logits[0, len(seq) - 1 :]
    torch.testing.assert_close(block.probs, target_probs(logits, sampling).float(), atol=1e-5, rtol=1e-4)
    assert all(block.probs[i, t] > 0 for i, t in enumerate(block.token_ids))


def test_sampled_graph_draws_follow_their_q(tiny_ckpt):
    p = with_graph_bodies(build_proposer(config(tiny_ckpt, kv_num_blocks=16)), window=8)  # small window: fast
    check_two_draws_follow_q(p, [5, 9, 2, 33, 7], None, runs=1200)


def test_chain_past_the_window_drafts_eagerly(tiny_ckpt):
    """A chain that would reach past the window takes the eager path (and still drafts what it drafts)."""
    eager, graphs = build_proposer(config(tiny_ckpt)), with_graph_bodies(build_proposer(config(tiny_ckpt)), window=8)
    seq = [1, 2, 3, 4, 5, 6]
    assert graphs.chain_graphs.fits(len(seq), 3) and not graphs.chain_graphs.fits(len(seq), 4)
    for p in (eager, graphs):
        p.start("s", seq, None, SamplingParams())
    assert graphs.propose("s", len(seq), [], None, 4) == eager.propose("s", len(seq), [], None, 4)


def _interpreting() -> bool:
    from specserve.kernels.checks import triton_interpreting
    from specserve.kernels.paged_attention import HAS_TRITON

    return HAS_TRITON and triton_interpreting()


@pytest.mark.skipif(not _interpreting(), reason="needs triton and TRITON_INTERPRET=1 (runs the kernels on the CPU)")
@pytest.mark.parametrize("sampled", [False, True])
def test_triton_paged_graph_bodies_under_the_interpreter(tiny_ckpt, sampled):
    """The CUDA default: the Triton paged attention with its row metadata (int32 block table, kv lengths, new-token
    starts) set on the device, run through triton's interpreter. Greedy: a live session drafts what a fresh eager one
    does; sampled: what a fresh one reseeded alike does. (The fused RoPE + cache-write kernel is left off: triton's
    interpreter refuses its masks, tests/kernels/test_rope_cache_cpu.py; the GPU tests run it.)"""
    from specserve.models.loader import load_model

    cfg = config(tiny_ckpt, dtype="float32")
    model, mcfg = load_model(cfg.checkpoint, dtype=torch.float32, progress=False)
    info = build_proposer(cfg).info
    made = []

    def make():
        p = ModelProposer(model, mcfg, cfg, info.vocab_size, info.vocab_hash)
        if sampled or not made:
            with_graph_bodies(p)
            p.chain_graphs = p.build_chain_graphs(256, p.info.max_block_size, attention="triton_paged")
        made.append(p)
        return p

    rollback_matches_fresh(make, None, 64, steps=8, k=5, sampled=sampled)


# ---------------------------------------------------------------- GPU: captured graphs
def _demo_engine(dtype):
    from specserve.paths import demo_checkpoint
    from specserve.target_service.factory import EngineConfig, build_engine

    return build_engine(EngineConfig(model=demo_checkpoint("target"), device="cuda", dtype=dtype))


def _demo_proposer(dtype, window):
    from specserve.paths import demo_checkpoint

    return build_proposer(
        DrafterConfig(
            "model",
            checkpoint=demo_checkpoint("model"),
            target_checkpoint=demo_checkpoint("target"),
            device="cuda",
            dtype=dtype,
            max_block_size=4,
            graph_window=window,
        )
    )


PROMPTS = ("def parse_args(argv):\n", "class Stack:\n    def push(self, x):", "import os\n")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_chains_on_the_demo_draft_what_the_eager_path_drafts(dtype):
    """Both drafters get the same syncs; each step both draft on the same sequence and the captured graphs' blocks are
    verified. float32: every block equal and the output = target-only; bf16 (the graphs' attention keeps float32
    scores, the eager path bf16 ones, so near-ties may split): at least 90 % of the blocks equal."""
    from specserve.paths import demo_checkpoint
    from specserve.target_service.factory import EngineConfig, build_engine

    engine = build_engine(EngineConfig(model=demo_checkpoint("target"), device="cuda", dtype=dtype))
    graphs, eager = _demo_proposer(dtype, 1024), _demo_proposer(dtype, 0)
    assert eager.chain_graphs is None and graphs.chain_graphs.capture_errors == {}
    assert graphs.chain_graphs.captured == 4 * 2 + 5  # chains k = 1..4 greedy and sampled, feeds 1..5
    check_graphs_draft_as_eager(engine, graphs, eager, PROMPTS, dtype)


@pytest.mark.gpu
@needs_cuda
def test_captured_sampled_chain_equals_its_bodies_run_eagerly():
    """The same sessions (same seeds, same rollbacks) through replays and through the bodies: tokens equal, q close."""
    replayed = _demo_proposer("float32", 1024)
    eager_bodies = _demo_proposer("float32", 1024)
    eager_bodies.chain_graphs._graphs.clear()  # the bodies then run eagerly over the same buffers
    seq = list(range(20, 60))
    sampling = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=3)
    blocks = {}
    for name, p in (("replayed", replayed), ("eager", eager_bodies)):
        p.start("s", seq, None, sampling)
        got = [p.propose("s", len(seq), [], None, 4)]
        got.append(p.propose("s", len(seq) + 2, [7], None, 3))  # two drafted tokens accepted, then a feed of 1
        got.append(p.propose("s", len(seq) + 1, [9, 11], None, 4))  # a rollback: feed of 2 after a kept prefix
        blocks[name] = got
    for a, b in zip(blocks["replayed"], blocks["eager"]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.probs, b.probs, atol=1e-5, rtol=1e-4)
