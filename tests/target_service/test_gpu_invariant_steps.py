"""Token-count invariant target steps on the GPU (issue #31; skipped without CUDA): in bf16, through the one padded
CUDA graph, a verify of k + 1 tokens gives bit for bit (torch.equal) the logits of k + 1 one-token decodes, k = 0..15,
and a tree's nodes those of their paths; greedy speculation then gives target-only's tokens. On the shipped demo
(MLA 64 + 16), the tiny presets, the mini Qwen3 preset (Qwen3-30B-A3B's attention widths), two layers of the real
Qwen3-30B-A3B shape and the int4 (W4A16) tiny Kimi. The negative control runs the option off and sees differences.
The kernels one by one: tests/kernels/test_invariant_kernels.py."""

from __future__ import annotations

import pytest
import torch
from invariance_helpers import chain_mismatches, engine_for, greedy_speculation, tree_mismatches

from specserve.paths import demo_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODELS = [
    "demo",
    "synthetic:tiny-qwen3-moe",
    "synthetic:tiny-kimi-k2",
    "synthetic:mini-qwen3-moe",
    "synthetic:qwen3-30b-a3b:2",
    "synthetic:tiny-kimi-k2-int4",
]
PROMPT = [5, 17, 101, 33, 64, 9, 150, 77, 3, 120, 41, 8, 199, 60, 21, 90, 14, 180, 2, 55] * 3


def _engine(spec: str, invariant: bool):
    return engine_for(str(demo_checkpoint("target")) if spec == "demo" else spec, "bfloat16", invariant, "cuda")


@pytest.mark.parametrize("spec", MODELS)
def test_a_verify_gives_the_logits_of_its_decodes_bit_for_bit(spec):
    engine = _engine(spec, invariant=True)
    runner = engine.runner
    assert runner.invariant_rows == 17 and runner.graph_for((1,)) is not None, runner.capture_errors
    before = runner.graph_steps
    assert chain_mismatches(engine, PROMPT) == []
    assert tree_mismatches(engine, PROMPT) == []
    assert runner.graph_steps > before + 30 and runner.eager_steps == 0  # every step replayed the padded graph


@pytest.mark.parametrize("spec", ["demo", "synthetic:mini-qwen3-moe"])
def test_greedy_speculation_gives_target_only_tokens(spec):
    engine = _engine(spec, invariant=True)
    reference = engine.generate_greedy(PROMPT, 40)
    for k in (1, 4, 8, 16):
        assert greedy_speculation(engine, PROMPT, reference, k) == reference, f"k = {k}"


def test_without_invariant_steps_a_verify_rounds_differently():
    """The negative control: with the option off (FlashInfer where it serves, per-size graphs) some row differs."""
    found = {}
    for spec in ("demo", "synthetic:mini-qwen3-moe", "synthetic:qwen3-30b-a3b:2"):
        engine = _engine(spec, invariant=False)
        assert engine.runner.invariant_rows == 0
        found[spec] = chain_mismatches(engine, PROMPT)
        del engine
        torch.cuda.empty_cache()
    assert any(found.values()), f"no row differed without invariant steps: {found}"
