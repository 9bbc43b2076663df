"""The shipped demo drafters scaled to a demo@ target (models/scaled_drafters.py), CPU float32 at reduced width
(demo@small-moonlight, hidden 512): each scaled drafter computes the demo-size drafter's function padded (its outputs
to 1e-4, its padded draft vocabulary never a token), and proposes exactly the demo-size drafter's blocks (chains and
trees) at every step of a greedy speculation whose output equals the target-only one, on pinned held-out prompts
(DSpark: its confidences too, to 1e-4)."""

from __future__ import annotations

import pytest
import torch
from demo_helpers import demo_prompts
from draft_helpers import first_draft_q, lockstep

from specserve.contract.types import SamplingParams, TreeSpec
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_errors import DrafterConfigError
from specserve.draft_service.registry import build_proposer
from specserve.models.scaled_demo import build_scaled_demo, load_demo
from specserve.models.scaled_shapes import constant_channel
from specserve.models.vocab import vocab_hash
from specserve.paths import demo_checkpoint
from specserve.target_service.engine.engine import TargetEngine

SCALED = "demo@small-moonlight"
PROMPT_TOKENS = 40
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return demo_prompts(2, PROMPT_TOKENS)


@pytest.fixture(scope="module")
def engines() -> tuple[TargetEngine, TargetEngine]:
    """(the demo target, the demo@small-moonlight target), float32 on the CPU."""
    demo = TargetEngine(*load_demo(demo_checkpoint("target"), "cpu"), None, num_blocks=64, block_size=16)
    wide = TargetEngine(
        *build_scaled_demo(SCALED, demo_checkpoint("target"), dtype=torch.float32), None, num_blocks=64, block_size=16
    )
    return demo, wide


def _drafters(family: str):
    """(the demo-size drafter for the demo target, the same checkpoint for the demo@ target: scaled)."""
    ckpt = demo_checkpoint(family)
    return tuple(
        build_proposer(DrafterConfig(family=family, checkpoint=ckpt, target_checkpoint=t, max_block_size=8))
        for t in (demo_checkpoint("target"), SCALED)
    )


@pytest.fixture(scope="module")
def built():
    cache: dict = {}
    return lambda family: cache.setdefault(family, _drafters(family))


@pytest.fixture(scope="module")
def eagle3(built):
    return built("eagle3")


def test_scaled_drafters_have_a_realistic_shape_and_the_demos_layers(built):
    """Each at the target's wire vocabulary and tokenizer; those that read target rows read the layers the demo's
    moved to: demo layers (1, 2, 4) of 5 sit at (1, 3, 6) of the 7-layer target (demo_positions: 0, 1, 3, 4, 6)."""
    for family in ("eagle3", "model", "dflash", "dspark"):
        demo, wide = built(family)
        assert (wide.info.vocab_size, wide.info.vocab_hash) == (8192, vocab_hash(demo_checkpoint("target")))
        assert demo.info.hidden_layers == ((1, 2, 4) if family != "model" else ())
        assert wide.info.hidden_layers == ((1, 3, 6) if family != "model" else ())
    cfg = built("eagle3")[1].head.cfg
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.draft_vocab_size, cfg.vocab_size) == (512, 512, 6144, 8192)
    assert (cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim) == (8, 2, 128)
    lm = built("model")[1].mcfg
    assert (lm.hidden_size, lm.num_layers, lm.attention.head_dim, lm.vocab_size, lm.logits_vocab_limit) == (
        384,
        4,
        96,
        8192,
        4096,
    )
    df = built("dflash")[1].model.cfg
    assert (df.hidden_size, df.num_hidden_layers, df.head_dim, df.block_size) == (512, 4, 128, 5)
    ds = built("dspark")[1].spark
    assert (ds.block.cfg.hidden_size, ds.block.cfg.num_hidden_layers, ds.spark_cfg.markov_rank) == (512, 4, 64)
    assert ds.markov.out.weight.shape == (8192, 64)


@torch.no_grad()
def test_scaled_eagle3_head_computes_the_demo_heads_function(eagle3, engines, prompts):
    """One head step over a prompt's real target rows (each target's own): the feature, the output and the logits
    are the demo head's padded (the constant channel where the target has it), the padded draft ids -inf."""
    (demo, wide), prompt = eagle3, prompts[0]
    rows = []
    for engine, p in zip(engines, eagle3):
        rows.append(engine.prefill("h", prompt, SamplingParams(), p.info.hidden_layers).hidden[: len(prompt) - 1])
        engine.release("h")
    kappa = constant_channel(engines[0].model.config, 512)[0]
    ids, t = torch.tensor(prompt[1:]), len(prompt) - 1
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    outs, logits = [], []
    for p, h in zip((demo, wide), rows):  # feature of position j - 1 with the token at j
        head, a = p.head, p.head.cfg.attention
        feats = head.fuse(h)
        empty = torch.zeros(0, a.num_kv_heads, a.head_dim)
        out, _, _ = head.step(head.embed(ids), feats, torch.arange(t), empty, empty, mask)
        outs.append((feats, out))
        logits.append(head.logits(out))
    for d, w in zip(outs[0], outs[1]):
        torch.testing.assert_close(w[:, :256], d, rtol=0, atol=1e-5)
        assert (w[:, 256] == kappa).all() and (w[:, 257:] == 0).all()
    torch.testing.assert_close(logits[1][:, :4096], logits[0], rtol=0, atol=1e-4)
    assert torch.isneginf(logits[1][:, 4096:]).all()


@pytest.mark.parametrize("family", ["eagle3", "model", "dflash", "dspark"])
def test_scaled_drafter_gives_the_demo_size_distribution(built, engines, prompts, family):
    """The law of a sampled drafted token: the demo-size drafter's to 1e-5, no mass past the demo's ids."""
    for prompt in prompts:
        demo, wide = (first_draft_q(e, p, prompt) for e, p in zip(engines, built(family)))
        torch.testing.assert_close(wide[:4096], demo, rtol=0, atol=1e-5)
        assert (wide[4096:] == 0).all()


@pytest.mark.parametrize(
    "family, tree",
    [
        ("eagle3", None),
        ("eagle3", TreeSpec(num_nodes=8, top_k=2, depth=4)),
        ("model", None),
        ("model", TreeSpec(num_nodes=8, top_k=2, depth=4)),
        ("dflash", None),
        ("dspark", None),
    ],
    ids=["eagle3-chain", "eagle3-tree", "model-chain", "model-tree", "dflash-chain", "dspark-chain"],
)
def test_scaled_drafter_proposes_the_demo_size_blocks(built, engines, prompts, family, tree):
    for prompt in prompts if tree is None else prompts[:1]:
        emitted = lockstep(engines, built(family), prompt, 4, NEW_TOKENS, tree)
        assert emitted == engines[1].generate_greedy(prompt, NEW_TOKENS)  # lossless: target-only's tokens


def test_a_drafter_that_does_not_fit_the_demo_is_one_line():
    """The demo target's MLA model as a draft LM for the demo@ target: refused, naming what does not fit."""
    with pytest.raises(DrafterConfigError, match="does not scale to demo@small-moonlight: a GQA attention"):
        build_proposer(DrafterConfig(family="model", checkpoint=demo_checkpoint("target"), target_checkpoint=SCALED))
