"""The demo at real size (models/scaled_demo.py), on the CPU in float32 at reduced width (the `small-` shapes, hidden
512): the wide model gives the shipped demo's greedy tokens on the pinned held-out prompts and its logits to 1e-4
(the int4 shape: those of the int4-quantized demo), and the full-size shapes' parameters and per-token bytes are
within 5% of the published models' (from their configs, on the meta device)."""

from __future__ import annotations

import pytest
import torch
from demo_helpers import demo_prompts

from specserve.bench.model_bytes import model_bytes
from specserve.contract.types import DraftBlock
from specserve.errors import SpecserveError
from specserve.models.causal_lm import build_model
from specserve.models.presets import PRESETS
from specserve.models.scaled_demo import build_scaled_demo, load_demo
from specserve.models.scaled_int4 import quantized_demo
from specserve.models.scaled_shapes import SHAPES, demo_positions, scaled_config
from specserve.paths import demo_checkpoint
from specserve.target_service.engine.engine import TargetEngine
from specserve.target_service.factory import EngineConfig

PROMPTS = 3  # pinned: the first held-out prompts, cut to PROMPT_TOKENS
PROMPT_TOKENS = 48
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return demo_prompts(PROMPTS, PROMPT_TOKENS)


def _engine(model, config) -> TargetEngine:
    return TargetEngine(model, config, None, num_blocks=64, block_size=16)


def _scores(engine: TargetEngine, prompt: list[int], block: tuple[int, ...]) -> torch.Tensor:  # [len(block)+1, V]
    engine.prefill("s", prompt)
    try:
        return engine.score_block("s", DraftBlock(token_ids=block))
    finally:
        engine.release("s")


def _check_same_function(spec: str, prompts: list[list[int]], quantized: bool) -> None:
    wide, wc = build_scaled_demo(spec, demo_checkpoint("target"), dtype=torch.float32)
    demo, dc = load_demo(demo_checkpoint("target"), "cpu")
    if quantized:
        assert wc.quantization is not None
        plain = _engine(*load_demo(demo_checkpoint("target"), "cpu"))
        quantized_demo(demo, wc)
    ref, ours = _engine(demo, dc), _engine(wide, wc)
    for prompt in prompts:
        assert ours.generate_greedy(prompt, NEW_TOKENS) == ref.generate_greedy(prompt, NEW_TOKENS)
        block = tuple(prompt[5:13])
        a, b = _scores(ref, prompt, block), _scores(ours, prompt, block)
        assert b.shape == (len(block) + 1, wc.vocab_size) and a.shape[1] == dc.vocab_size
        torch.testing.assert_close(b[:, : dc.vocab_size], a, rtol=0, atol=1e-4)
        assert torch.isneginf(b[:, dc.vocab_size :]).all()  # the padded vocabulary is never a token
        if quantized:  # negative control: the int4 round trip is real (the plain demo is measurably elsewhere)
            assert (_scores(plain, prompt, block) - a).abs().max() > 1e-3


def test_moonlight_shape_gives_the_demos_tokens_and_logits(prompts):
    _check_same_function("demo@small-moonlight", prompts, quantized=False)


def test_k26_shape_with_int4_experts_gives_the_int4_demos_tokens_and_logits(prompts):
    _check_same_function("demo@small-kimi-k2.6", prompts, quantized=True)


def test_more_layers_only_move_the_demo_layers(prompts):
    """At another depth the demo's layers land elsewhere and the silent layers still add nothing."""
    assert demo_positions(27, 5) == (0, 1, 9, 18, 26)
    assert demo_positions(9, 5) == (0, 1, 3, 6, 8)
    _check_same_function("demo@small-moonlight:9", prompts[:1], quantized=False)


def test_silent_layers_are_real_layers():
    """No layer is skipped: every wide layer has random attention and router weights, and the silent ones differ
    from the demo's only in their zero output / down projections."""
    wide, wc = build_scaled_demo("demo@small-moonlight", demo_checkpoint("target"), dtype=torch.float32)
    positions = demo_positions(wc.num_layers, 5)
    for i, layer in enumerate(wide.model.layers):
        attn = layer.self_attn
        assert attn.q_b_proj.weight.abs().sum() > 0 and attn.kv_a_proj_with_mqa.weight.abs().sum() > 0
        silent = i not in positions
        assert (attn.o_proj.weight.abs().sum() == 0) == silent
        if layer.is_moe:
            # random router, or on a demo layer (small-moonlight: 4 experts a group) the demo's rows, zeros past them
            assert bool(layer.mlp.gate.weight[:16, 257:].abs().sum() > 0) == silent
            assert (layer.mlp.experts.w2.abs().sum(dim=(1, 2)) == 0).sum() == (
                wc.moe.num_experts if silent else wc.moe.top_k - 4
            )  # silent: every down is zero; demo: the nulls


def _bytes(config) -> tuple[int, int, int]:
    """(every parameter's bytes, a decode token's bytes (dense + one embedding row + top_k experts per MoE layer),
    dense bytes per layer (attention, norms, router, shared experts; the first layer's dense MLP and the
    embeddings / lm_head left out))."""
    with torch.device("meta"):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = build_model(config)
        finally:
            torch.set_default_dtype(old)
    mb = model_bytes(model, config)
    per_token = mb.dense_total + mb.embedding_row_bytes + config.moe.top_k * mb.expert_bytes * mb.num_moe_layers
    layer = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if n.startswith("model.layers.1.") and ".experts." not in n
    )
    return mb.param_bytes_total, per_token, layer + config.moe.top_k * mb.expert_bytes


def _within(a: float, b: float, rel: float = 0.05) -> bool:
    return abs(a - b) <= rel * b


def test_moonlight_shape_has_the_published_parameters_and_bytes():
    demo = _demo_config()
    ours = _bytes(scaled_config("demo@moonlight-16b-a3b", demo))
    published = _bytes(PRESETS[SHAPES["moonlight-16b-a3b"].published])
    assert 15e9 < published[0] / 2 < 17e9  # Moonlight-16B-A3B: ~16 B parameters ...
    assert 2.5e9 < published[1] / 2 < 3.5e9  # ... about 3 B of them read per decode token
    assert _within(ours[0], published[0]) and _within(ours[1], published[1]), (ours, published)


def test_k26_width_has_the_published_per_layer_bytes():
    ours = _bytes(scaled_config("demo@kimi-k2.6", _demo_config()))
    published = _bytes(PRESETS[SHAPES["kimi-k2.6"].published])
    assert _within(ours[2], published[2]), (ours[2], published[2])


def _demo_config():
    from specserve.models.config import ModelConfig

    return ModelConfig.from_file(demo_checkpoint("target"))


@pytest.mark.parametrize(
    "spec, words",
    [
        ("demo@nope", "unknown demo size 'nope'"),
        ("demo@moonlight-16b-a3b:x", "layer count must be a positive integer"),
    ],
)
def test_bad_names_are_one_line_errors(spec, words):
    with pytest.raises(SpecserveError, match=words):
        EngineConfig(model=spec)


def test_too_few_layers_is_refused():
    from specserve.models.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match="at least as many"):
        scaled_config("demo@moonlight-16b-a3b:3", _demo_config())
