"""The demo at real size on the GPU (skipped without CUDA): the full-size shapes build in under a minute, their
float32 greedy output is the shipped demo's (K2.6 width: the int4-quantized demo's), and speculation on them is
lossless for every drafter that runs against them: greedy equality, and the sampled first verified token against
the exact law (computed on the demo itself, which is the same function) with a negative control."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch
from demo_helpers import chisquare_pvalue, demo_prompts, exact_demo_laws

from specserve.contract.types import SamplingParams
from specserve.models.scaled_demo import build_scaled_demo, load_demo
from specserve.models.scaled_int4 import quantized_demo
from specserve.paths import demo_checkpoint
from specserve.target_service.factory import EngineConfig, build_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MOONLIGHT = "demo@moonlight-16b-a3b"
K26 = "demo@kimi-k2.6:8"  # 8 of the shape's layers: float32 dense weights leave room beside the int4 experts
DRAFTERS = ("ngram", "model")  # the drafters that run against a demo@ target here
NEW_TOKENS = 24
SAMPLING = dict(temperature=1.0, top_k=8)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("spec", [MOONLIGHT, "demo@kimi-k2.6"])
def test_full_size_builds_in_under_a_minute(spec):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model, config = build_scaled_demo(spec, demo_checkpoint("target"), device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    print(f"{spec}: built in {seconds:.1f} s, {gib:.1f} GiB of weights")
    del model
    _free()
    assert seconds < 60


@pytest.fixture(scope="module")
def moonlight32():
    engine = build_engine(EngineConfig(model=MOONLIGHT, device="cuda", dtype="float32", num_kv_blocks=1024))
    demo = build_engine(
        EngineConfig(model=demo_checkpoint("target"), device="cuda", dtype="float32", num_kv_blocks=256)
    )
    yield engine, demo
    del engine, demo
    _free()


def test_moonlight_float32_greedy_is_the_demos(moonlight32):
    engine, demo = moonlight32
    for prompt in demo_prompts():
        assert engine.generate_greedy(prompt, NEW_TOKENS) == demo.generate_greedy(prompt, NEW_TOKENS)


def _proposer(family: str):
    from specserve.draft_service.drafter_config import DrafterConfig
    from specserve.draft_service.registry import build_proposer

    checkpoint = None if family == "ngram" else demo_checkpoint(family)
    return build_proposer(
        DrafterConfig(
            family=family,
            checkpoint=checkpoint,
            target_checkpoint=demo_checkpoint("target"),
            device="cuda",
            dtype="float32",
            max_block_size=9,
        )
    )


@pytest.mark.parametrize("family", DRAFTERS)
def test_moonlight_greedy_speculation_is_lossless(moonlight32, family):
    from specserve.loop.stats import SpecStats
    from specserve.train.acceptance import speculative_greedy

    engine, _ = moonlight32
    proposer, stats = _proposer(family), SpecStats()
    for i, prompt in enumerate(demo_prompts()):
        reference = engine.generate_greedy(prompt, NEW_TOKENS)
        spec = speculative_greedy(engine, proposer, f"g{i}", prompt, 4, NEW_TOKENS, stats)
        assert spec[:NEW_TOKENS] == reference
    assert stats.drafted > 0


@pytest.mark.parametrize("family", DRAFTERS)
def test_moonlight_sampled_first_verified_token_follows_the_demo(moonlight32, family):
    """The first token a verify emits, over many seeds, against the demo's exact law of that token;
    negative control: the same counts against the law of the token before it are rejected."""
    engine, _ = moonlight32
    prompt, sampling = demo_prompts(1)[0], SamplingParams(**SAMPLING)
    p1, p2 = exact_demo_laws(prompt, sampling)
    proposer, runs = _proposer(family), 240
    vocab = engine.model.config.vocab_size
    counts = np.zeros(vocab)
    for first in range(0, runs, 40):  # 40 sessions at a time: the draft LM's own cache holds that many
        items = []
        for i in range(first, first + 40):
            sid, s = f"c{i}", SamplingParams(seed=5000 + i, **SAMPLING)
            pre = engine.prefill(sid, prompt, s)
            proposer.start(sid, prompt + [pre.next_token], None, s)
            items.append((sid, proposer.propose(sid, len(prompt) + 1, [], None, 3)))
        for (sid, _), res in zip(items, engine.verify_batch(items)):
            counts[res.emitted[0]] += 1
            engine.release(sid), proposer.release(sid)
    expected, wrong = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
    expected[: p2.shape[0]], wrong[: p1.shape[0]] = p2, p1
    assert counts[(expected == 0).numpy()].sum() == 0, "emitted a token the target cannot sample"
    assert chisquare_pvalue(counts, expected) > 1e-3
    assert chisquare_pvalue(counts, wrong + 1e-9) < 1e-3  # negative control: another law is rejected


def test_k26_width_float32_greedy_is_the_int4_demos():
    engine = build_engine(EngineConfig(model=K26, device="cuda", dtype="float32", num_kv_blocks=128))
    demo_model, demo_config = load_demo(demo_checkpoint("target"), "cuda")
    quantized_demo(demo_model, engine.model.config)
    from specserve.target_service.engine.engine import TargetEngine

    demo = TargetEngine(demo_model, demo_config, None, num_blocks=128, block_size=16, device="cuda")
    try:
        for prompt in demo_prompts():
            assert engine.generate_greedy(prompt, NEW_TOKENS) == demo.generate_greedy(prompt, NEW_TOKENS)
    finally:
        del engine, demo, demo_model
        _free()
