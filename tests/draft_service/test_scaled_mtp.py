"""The shipped demo's MTP layer scaled to a demo@ target (models/scaled_mtp.py), CPU float32 at reduced width
(the small- shapes, hidden 512): it has the target's layer shape, computes the demo-size layer's function padded (its
block's output and logits to 1e-5 / 1e-4, the null experts chosen with weight 0, the padded vocabulary never a
token), and proposes exactly the demo-size layer's chains at every step of a greedy speculation whose output equals
target-only's (the int4 shape: the int4-quantized demo's, target and layer); each piece of the construction it
needs, broken, moves the block (negative controls); `generate --model demo@... --draft mtp` drafts with it."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from demo_helpers import demo_prompts
from draft_helpers import first_draft_q, lockstep

from specserve.contract.types import SamplingParams
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.registry import build_proposer
from specserve.models.attn_metadata import AttentionBatch
from specserve.models.kv_cache import PagedKVCache
from specserve.models.scaled_demo import build_scaled_demo, load_demo
from specserve.models.scaled_int4 import quantize_layer_experts_, quantized_demo
from specserve.paths import demo_checkpoint
from specserve.target_service.engine.engine import TargetEngine

SHAPES = ("demo@small-moonlight", "demo@small-kimi-k2.6")
PROMPT_TOKENS = 40
NEW_TOKENS = 12
HD = 256  # the demo's hidden: the channel's dim


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return demo_prompts(2, PROMPT_TOKENS)


def _mtp(target) -> object:
    return build_proposer(
        DrafterConfig(family="mtp", checkpoint=demo_checkpoint("mtp"), target_checkpoint=target, max_block_size=8)
    )


@pytest.fixture(scope="module", params=SHAPES)
def pair(request):
    """(spec, (demo target, demo@ target), (demo-size MTP, scaled MTP)), float32 on the CPU; the int4 shape's
    references are the int4-quantized demo and the int4-quantized demo-size MTP layer."""
    spec = request.param
    wide, wc = build_scaled_demo(spec, demo_checkpoint("target"), dtype=torch.float32)
    demo, dc = load_demo(demo_checkpoint("target"), "cpu")
    demo_mtp, wide_mtp = _mtp(demo_checkpoint("target")), _mtp(spec)
    if wc.quantization is not None:
        quantized_demo(demo, wc)
        quantize_layer_experts_(demo_mtp.layer.block, demo_mtp.spec.block, wide_mtp.spec.block)
    engines = tuple(TargetEngine(m, c, None, num_blocks=64, block_size=16) for m, c in ((demo, dc), (wide, wc)))
    return spec, engines, (demo_mtp, wide_mtp)


def _rows(engine, proposer, prompt) -> torch.Tensor:  # [L - 1, H] the target's last-layer rows of the prompt
    rows = engine.prefill("r", prompt, SamplingParams(), proposer.info.hidden_layers).hidden[: len(prompt) - 1]
    engine.release("r")
    return rows


@torch.no_grad()
def _step(layer, prompt, rows) -> tuple[torch.Tensor, torch.Tensor]:  # ([L - 1, H] block output, [L - 1, V] logits)
    """One MTP step over a prompt from an empty cache: entry j reads token j + 1 and the target's final row j."""
    t = len(prompt) - 1
    cache = PagedKVCache(1, 4, 16, layer.config.kv_entry_shape, torch.float32, torch.device("cpu"))
    attn = AttentionBatch.contiguous([t], [0], [list(range(4))], 16)
    h = layer.step(torch.tensor(prompt[1:]), layer.target_norm(rows), torch.arange(t), attn, cache)
    return h, layer.logits(h)


def test_scaled_mtp_has_the_targets_layer_shape(pair):
    """Its block is the wide target's MoE layer, parameter for parameter; eh_proj [H, 2H]; the target's vocabulary;
    it reads the target's last layer (layer N - 1: the demo's last layer moved there)."""
    spec, (_, target), (_, mtp) = pair
    wc = target.model.config
    layer = dict(target.model.model.layers[wc.num_layers - 1].named_parameters())
    block = dict(mtp.layer.block.named_parameters())
    assert {n: p.shape for n, p in block.items()} == {n: p.shape for n, p in layer.items()}
    assert mtp.layer.eh_proj.weight.shape == (wc.hidden_size, 2 * wc.hidden_size)
    assert mtp.layer.shared_head["head"].weight.shape == target.model.lm_head.weight.shape
    assert mtp.info.hidden_layers == (wc.num_layers - 1,) and mtp.info.vocab_size == wc.vocab_size == 8192


def test_scaled_mtp_step_computes_the_demo_layers_function(pair, prompts):
    """One step over a prompt's real target rows (each target's own): the block's output is the demo's padded (a
    positive channel, zeros past it), the logits the demo's, the padded ids -inf; every token routes to the null
    experts, with weight 0."""
    spec, engines, mtps = pair
    routed = []
    gate = mtps[1].layer.block.mlp.gate
    hook = gate.register_forward_hook(lambda m, i, out: routed.append(out))
    try:
        (hd, ld), (hw, lw) = (_step(p.layer, prompts[0], _rows(e, p, prompts[0])) for e, p in zip(engines, mtps))
    finally:
        hook.remove()
    torch.testing.assert_close(hw[:, :HD], hd, rtol=0, atol=1e-5)
    assert (hw[:, HD] > 0).all() and (hw[:, HD + 1 :] == 0).all()
    torch.testing.assert_close(lw[:, :4096], ld, rtol=0, atol=1e-4)
    assert torch.isneginf(lw[:, 4096:]).all()
    ((ids, weights),) = routed
    wm, dm = gate.cfg, mtps[0].layer.block.mlp.gate.cfg
    nulls = dm.n_group * (wm.num_experts // wm.n_group) + torch.arange(wm.top_k - dm.top_k)
    is_null = (ids[..., None] == nulls).any(-1)  # [T, K]
    assert (is_null.sum(-1) == len(nulls)).all() and (weights[is_null] < 1e-30).all()


def _silence_channel(layer) -> None:
    layer.embed_tokens.weight[:, HD] = 0.0


def _unscaled_enorm(layer) -> None:
    layer.enorm.weight[:HD] *= math.sqrt(layer.config.hidden_size / HD)


def _eh_proj_column(layer) -> None:
    layer.eh_proj.weight[:HD, layer.config.hidden_size] *= 1.01  # hnorm's first dim, 1% off


@pytest.mark.parametrize(
    "break_it", [_silence_channel, _unscaled_enorm, _eh_proj_column], ids=["no-channel", "unscaled-enorm", "eh-proj"]
)
def test_a_broken_scaled_weight_moves_the_block(pair, prompts, break_it):
    """Negative control for the step test: with one scaled weight broken (the channel gone: the null experts get
    score 1/2 and the demo's weights are renormalised; enorm not rescaled; one eh_proj weight 1% off) the block's
    output leaves the demo's by far more than that test's tolerance."""
    spec, engines, mtps = pair
    broken = copy.deepcopy(mtps[1].layer)
    with torch.no_grad():
        break_it(broken)
    (hd, _), (hw, _) = (
        _step(layer, prompts[0], _rows(e, p, prompts[0])) for e, p, layer in zip(engines, mtps, (mtps[0].layer, broken))
    )
    assert (hw[:, :HD] - hd).abs().max() > 1e-3


def test_scaled_mtp_gives_the_demo_size_distribution(pair, prompts):
    """The law of a sampled drafted token: the demo-size layer's to 1e-5, no mass past the demo's ids."""
    spec, engines, mtps = pair
    for prompt in prompts:
        demo, wide = (first_draft_q(e, p, prompt) for e, p in zip(engines, mtps))
        torch.testing.assert_close(wide[:4096], demo, rtol=0, atol=1e-5)
        assert (wide[4096:] == 0).all()


def test_scaled_mtp_proposes_the_demo_size_chains_and_is_lossless(pair, prompts):
    spec, engines, mtps = pair
    for prompt in prompts:
        emitted = lockstep(engines, mtps, prompt, 4, NEW_TOKENS)
        assert emitted == engines[1].generate_greedy(prompt, NEW_TOKENS)  # lossless: target-only's tokens


def test_generate_with_a_demo_at_target_drafts_with_the_scaled_mtp(capsys):
    """`specserve generate --model demo@small-moonlight --draft mtp` (no --draft-model): the demo's mtp/ scaled to
    it; output equal to target-only's and its drafts accepted."""
    from specserve.cli.main import main

    flags = [
        "generate",
        "--model",
        "demo@small-moonlight",
        "--prompt",
        "def read_config(path):\n    ",
        "--max-new-tokens",
        "16",
        "--json",
        "--num-speculative-tokens",
        "2",
        "--device",
        "cpu",
    ]
    outputs = {}
    for draft in ("none", "mtp"):
        assert main([*flags, "--draft", draft]) == 0
        outputs[draft] = json.loads(capsys.readouterr().out)
    assert outputs["mtp"]["token_ids"] == outputs["none"]["token_ids"]
    assert outputs["mtp"]["stats"]["mean_accepted_length"] > 1.0  # drafts were accepted
