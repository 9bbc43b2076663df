"""The shipped demo drafters at a demo@ target's size: built at load time from the demo-size checkpoints by the
construction of models/scaled_demo.py, so that each proposes exactly what it proposes at demo size.

A demo@ target's residual stream is the demo's padded with zeros, plus a constant channel kappa at dim H_demo
(`constant_channel`: kappa^2 + eps_wide * H_wide = eps_demo * H_demo). The drafters that read it are embedded the
same way:

- **EAGLE-3** (`scaled_eagle3_head`): the head at the target's width (hidden = the target's hidden, a llama layer of
  128-dim heads, a 32000-token draft vocabulary with `d2t`; `EAGLE3_SHAPES`). Every demo matrix sits in a corner of
  its wide one, the rest zero. The head's residual stream (its feature f) carries the target's channel: fc copies
  channel dim H_demo of the first fused layer to its own dim H_demo, so f = [demo f, kappa, 0...]; the token
  embeddings (the target's, demo rows in the corner, kappa in the channel) carry it too. So every norm of the head
  (its eps the target's wide eps, weights times sqrt(H_demo / H_wide), zero on the channel) gives the demo head's
  output padded, exactly as the target's norms do. Attention: demo q head j (kv head j // g) is wide head
  (j // g) * g_wide + j % g, on kv head j // g; rope dims (half-split layout) i -> rho * i and
  D/2 + i -> D_wide/2 + rho * i (rho = D_wide / D), same theta, so both see the same frequencies; q scaled by
  sqrt(D_wide / D) for the softmax scale. The draft vocabulary: the demo's draft ids first (its d2t), then ids that
  map to target ids past the demo's and can never win: their logits are -inf (`Eagle3Config.draft_vocab_limit`),
  as the target's padded vocabulary is. The fused target layers follow the demo layers to their new positions
  (`demo_positions`): demo hidden layer L (the output of layer L) is wide layer demo_positions[L]'s output.
  Its token embeddings are the target's for the demo's ids; rows past them (ids the target never emits, random
  in the target) are zero plus the channel here.
- **The draft LM** (`scaled_draft_lm`): a llama at a realistic draft size (`DRAFT_LM_SHAPES`: ~0.5 B parameters
  for the full-size targets, the target's 163840-token vocabulary, embeddings tied as the demo's are). It reads no
  target rows, so it needs no channel: its residual stream is the demo's padded with zeros, and every norm (eps
  eps_demo * H_demo / H_wide, weights times sqrt(H_demo / H_wide)) gives the demo's output padded. Heads and rope
  dims map as for EAGLE-3 (head_dim 48 -> 96: pair i -> pair 2i, same theta); the demo's two layers are the first
  and the last (`demo_positions`), the others random layers whose output and down projections are zero (a real
  layer's bytes and kernels, nothing added to the stream); logits past the demo's ids are -inf
  (`ModelConfig.logits_vocab_limit`).
- **DFlash** (`scaled_dflash`): at the target's width (`DFLASH_SHAPES`; its embeddings and lm_head the target's,
  `shared_target_head`), its block size the demo's (the block's queries attend to each other). Its streams (the
  block's and the fused context) carry no channel: the fused context is normed before the layers read it, so a
  channel could not stay constant there; its copy of the target's embeddings leaves the channel out, fc ignores
  the target rows' channel, and every norm is rescaled as the draft LM's are. The demo's three layers spread over
  five (`demo_positions`), the others silent; the three fused target layers follow the demo's; logits past the
  demo's ids are -inf (`DFlashConfig.logits_vocab_limit`).

With a demo@ target the registry's factories (eagle3.py, model_drafter.py, dflash.py) build these from the
drafter's demo-size checkpoint; given the shipped demo target folder instead, the same checkpoints load at demo
size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from specserve.models.config import GQAConfig, ModelConfig
from specserve.models.errors import ModelConfigError
from specserve.models.model_names import ModelName
from specserve.models.scaled_shapes import constant_channel, demo_positions, parse_scaled_spec
from specserve.models.scaled_weights import (
    check_gqa,
    corner,
    gqa_,
    mlp_,
    plain_norm,
    project,
    residual_norm,
    wide_default_dtype,
)


@dataclass(frozen=True)
class Eagle3Shape:
    """An EAGLE-3 head's shape at a target's width (its hidden is the target's)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int


EAGLE3_SHAPES: Mapping[str, Eagle3Shape] = MappingProxyType(
    {
        "moonlight-16b-a3b": Eagle3Shape(32, 4, 128, 6144, 32000),
        "kimi-k2.6": Eagle3Shape(64, 8, 128, 18432, 32000),
        # CPU sizes (hidden 512, vocabulary 8192): the draft vocabulary still padded past the demo's 4096
        "small-moonlight": Eagle3Shape(8, 2, 128, 1024, 6144),
        "small-kimi-k2.6": Eagle3Shape(8, 2, 128, 1024, 6144),
    }
)


# ---------------------------------------------------------------- EAGLE-3


def scaled_eagle3_layers(demo_layers: tuple[int, ...], target: ModelConfig, demo: ModelConfig) -> tuple[int, ...]:
    """The wide target's hidden layers (outputs) of the demo head's: demo layer L -> demo_positions[L]."""
    positions = demo_positions(target.num_layers, demo.num_layers)
    return tuple(positions[i] for i in demo_layers)


@torch.no_grad()
def scaled_eagle3_head(demo, head_dir: str | Path, target: ModelName, device: str | torch.device, dtype: torch.dtype):
    """The demo-size EAGLE-3 head `demo` (loaded from `head_dir` on the CPU in float32, made for the demo that
    `target` embeds) at `target`'s width, on `device` in `dtype`: a module of demo's class (module docstring)."""
    name, _ = parse_scaled_spec(target.name)
    shape = EAGLE3_SHAPES[name]
    tc, dc = target.config(), target.demo_config()
    d = demo.cfg
    hd, hw = d.hidden_size, tc.hidden_size
    if d.target_hidden_size != dc.hidden_size or hd != dc.hidden_size:
        raise ModelConfigError(
            f"a demo@ target scales the demo's EAGLE-3 head (hidden {dc.hidden_size} over the demo's layers); the head "
            f"at {head_dir} has hidden {hd} over target layers of {d.target_hidden_size}"
        )
    a = d.attention
    wa = GQAConfig(num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, bias=False)
    bad = check_gqa(a, wa, "attention") + [
        f"{what} {x} > {y}"
        for what, x, y in (
            ("hidden", hd + 1, hw),
            ("intermediate", d.intermediate_size, shape.intermediate_size),
            ("draft vocabulary", d.draft_vocab_size, shape.draft_vocab_size),
            ("draft vocabulary", shape.draft_vocab_size, tc.vocab_size),
        )
        if x > y
    ]
    if d.rope.rope_type != "default":
        bad.append(f"rope {d.rope.rope_type} (default only)")
    if bad:
        raise ModelConfigError(f"the demo's EAGLE-3 head does not scale to {target.name}: {', '.join(bad)}")
    kappa, _ = constant_channel(dc, hw)
    eps = (d.rms_norm_eps * hd - kappa * kappa) / hw
    if eps <= 0:
        raise ModelConfigError(f"the demo's EAGLE-3 eps {d.rms_norm_eps} leaves no room for the constant channel")
    layers = scaled_eagle3_layers(tuple(i - 1 for i in d.aux_layers), tc, dc) if d.aux_layers else None
    raw = dict(
        d.raw or {},
        hidden_size=hw,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=wa.num_heads,
        num_key_value_heads=wa.num_kv_heads,
        head_dim=wa.head_dim,
        rms_norm_eps=eps,
        vocab_size=tc.vocab_size,
        draft_vocab_size=shape.draft_vocab_size,
        target_hidden_size=hw,
        draft_vocab_limit=d.draft_vocab_size,
    )
    if layers is not None:
        raw["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in layers]
    cfg = type(d)(
        hidden_size=hw,
        intermediate_size=shape.intermediate_size,
        vocab_size=tc.vocab_size,
        draft_vocab_size=shape.draft_vocab_size,
        target_hidden_size=hw,
        rms_norm_eps=eps,
        attention=wa,
        rope=dataclasses.replace(d.rope, dim=wa.head_dim),
        aux_layers=tuple(i + 1 for i in layers) if layers is not None else None,
        raw=raw,
        draft_vocab_limit=d.draft_vocab_size,
    )
    wide = wide_default_dtype(dtype, device, lambda: type(demo)(cfg, with_embeddings=True))
    _embed_eagle3(wide, demo, kappa)
    return wide.eval()


def _embed_eagle3(wide, demo, kappa: float) -> None:
    d, w = demo.cfg, wide.cfg
    hd, hw = d.hidden_size, w.hidden_size
    emb = wide.embed_tokens.weight
    corner(emb, demo.embed_tokens.weight)
    emb[:, hd] = kappa  # the target's constant channel (models/scaled_demo.py)
    fc = wide.fc.weight  # [Hw, 3 Hw]
    fc.zero_()
    for b in range(3):
        fc[:hd, b * hw : b * hw + hd] = demo.fc.weight[:, b * hd : (b + 1) * hd].to(fc.dtype)
    fc[hd, hd] = 1.0  # the feature carries the channel: that of the first fused layer
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm"):
        residual_norm(getattr(wide, norm).weight, getattr(demo, norm).weight, hw)
    gqa_(wide, demo, d.attention, w.attention, cols=torch.cat([torch.arange(hd), hw + torch.arange(hd)]))
    mlp_(wide, demo)
    corner(wide.lm_head.weight, demo.lm_head.weight)
    vd = d.draft_vocab_size
    wide.d2t.zero_()  # padded draft id i -> target id i (past the demo's ids; never drafted)
    wide.d2t[:vd] = demo.d2t.to(wide.d2t.device)
    wide.t2d.zero_()
    wide.t2d[wide.draft_to_target()] = True
    padded = wide.draft_to_target()[vd:]
    if len(padded) and int(padded.min()) < d.vocab_size:
        raise ModelConfigError("the padded draft ids would map onto the demo's target ids")


# ---------------------------------------------------------------- the draft LM


@dataclass(frozen=True)
class DraftLMShape:
    """A llama draft LM's shape (its vocabulary the target's)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


DRAFT_LM_SHAPES: Mapping[str, DraftLMShape] = MappingProxyType(
    {
        # ~0.55 B parameters with the 163840-token tied embeddings: a small same-tokenizer draft for either target
        "moonlight-16b-a3b": DraftLMShape(1536, 12, 16, 4, 96, 4096),
        "kimi-k2.6": DraftLMShape(1536, 12, 16, 4, 96, 4096),
        "small-moonlight": DraftLMShape(384, 4, 4, 2, 96, 1024),
        "small-kimi-k2.6": DraftLMShape(384, 4, 4, 2, 96, 1024),
    }
)


@torch.no_grad()
def scaled_draft_lm(
    checkpoint: str | Path, target: ModelName, device: str | torch.device, dtype: torch.dtype, seed: int = 0
):
    """(model, config): the demo-size llama draft LM of `checkpoint` at the DRAFT_LM_SHAPES size for `target`, on
    `device` in `dtype` (module docstring)."""
    from specserve.models.causal_lm import build_model
    from specserve.models.loader import load_model
    from specserve.models.presets import init_random_

    name, _ = parse_scaled_spec(target.name)
    shape, tc = DRAFT_LM_SHAPES[name], target.config()
    try:
        demo, dc = load_model(checkpoint, "cpu", torch.float32, progress=False)
    except (ValueError, RuntimeError) as e:
        raise ModelConfigError(f"cannot load the draft model {checkpoint}: {e}") from e
    a = dc.attention
    wa = GQAConfig(num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)
    bad = [] if isinstance(a, GQAConfig) else ["a GQA attention"]
    bad += check_gqa(a, wa, "attention") if not bad else []
    bad += [
        f"{n} {x} > {y}"
        for n, x, y in (
            ("hidden", dc.hidden_size, shape.hidden_size),
            ("layers", dc.num_layers, shape.num_layers),
            ("intermediate", dc.intermediate_size, shape.intermediate_size),
            ("vocab", dc.vocab_size, tc.vocab_size),
        )
        if x > y
    ]
    if dc.moe is not None or dc.rope.rope_type != "default":
        bad.append("a dense llama with default rope")
    if bad:
        raise ModelConfigError(f"the draft LM {checkpoint} does not scale to {target.name}: {', '.join(bad)}")
    hd, hw = dc.hidden_size, shape.hidden_size
    config = dataclasses.replace(
        dc,
        hidden_size=hw,
        num_layers=shape.num_layers,
        intermediate_size=shape.intermediate_size,
        attention=wa,
        rope=dataclasses.replace(dc.rope, dim=shape.head_dim),
        rms_norm_eps=dc.rms_norm_eps * hd / hw,
        vocab_size=tc.vocab_size,
        logits_vocab_limit=dc.vocab_size,
    )
    model = wide_default_dtype(dtype, device, lambda: build_model(config))
    init_random_(model, seed)
    d, w = demo.model, model.model
    emb = w.embed_tokens.weight  # rows past the demo's ids stay random (their logits are -inf)
    emb[: dc.vocab_size] = 0.0
    emb[: dc.vocab_size, :hd] = d.embed_tokens.weight.to(emb.dtype)
    if model.lm_head is not None:
        head = model.lm_head.weight
        head[: dc.vocab_size] = 0.0
        head[: dc.vocab_size, :hd] = (demo.lm_head.weight if demo.lm_head is not None else d.embed_tokens.weight).to(
            head.dtype
        )
    plain_norm(w.norm.weight, d.norm.weight, hw)
    positions = demo_positions(config.num_layers, dc.num_layers)
    for i, layer in enumerate(w.layers):
        if i in positions:
            dl = d.layers[positions.index(i)]
            plain_norm(layer.input_layernorm.weight, dl.input_layernorm.weight, hw)
            plain_norm(layer.post_attention_layernorm.weight, dl.post_attention_layernorm.weight, hw)
            gqa_(layer.self_attn, dl.self_attn, a, wa)
            mlp_(layer.mlp, dl.mlp)
        else:  # a real layer that adds nothing
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model.eval(), config


# ---------------------------------------------------------------- DFlash


@dataclass(frozen=True)
class DFlashShape:
    """A DFlash drafter's shape at a target's width (its hidden is the target's)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


DFLASH_SHAPES: Mapping[str, DFlashShape] = MappingProxyType(
    {
        "moonlight-16b-a3b": DFlashShape(5, 32, 4, 128, 6144),
        "kimi-k2.6": DFlashShape(5, 64, 8, 128, 18432),
        "small-moonlight": DFlashShape(4, 8, 2, 128, 1024),
        "small-kimi-k2.6": DFlashShape(4, 8, 2, 128, 1024),
    }
)


@torch.no_grad()
def scaled_dflash(
    demo, checkpoint: str | Path, target: ModelName, device: str | torch.device, dtype: torch.dtype, seed: int = 0
):
    """The demo-size DFlash drafter `demo` (loaded from `checkpoint` on the CPU in float32, made for the demo `target`
    embeds, sharing its head) at the DFLASH_SHAPES size for `target`, on `device` in `dtype`: a module of demo's class
    (module docstring)."""
    name, _ = parse_scaled_spec(target.name)
    shape, tc, dc = DFLASH_SHAPES[name], target.config(), target.demo_config()
    d = demo.cfg
    da = GQAConfig(num_heads=d.num_attention_heads, num_kv_heads=d.num_key_value_heads, head_dim=d.head_dim)
    wa = GQAConfig(num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)
    hd, hw = d.hidden_size, tc.hidden_size
    bad = check_gqa(da, wa, "attention") + [
        f"{n} {x} > {y}"
        for n, x, y in (
            ("layers", d.num_hidden_layers, shape.num_layers),
            ("hidden", hd, hw),
            ("intermediate", d.intermediate_size, shape.intermediate_size),
        )
        if x > y
    ]
    if d.target_hidden_size != dc.hidden_size or d.vocab_size != dc.vocab_size:
        bad.append(
            f"it reads target rows of {d.target_hidden_size} and a vocabulary of {d.vocab_size}, not the "
            f"demo's {dc.hidden_size} and {dc.vocab_size}"
        )
    if not d.shared_target_head or d.qk_norm or d.mask_token_id is not None:
        bad.append("it must share the target's head, with a learned mask embedding and no qk norm")
    if bad:
        raise ModelConfigError(f"the DFlash drafter {checkpoint} does not scale to {target.name}: {', '.join(bad)}")
    positions = demo_positions(tc.num_layers, dc.num_layers)
    cfg = dataclasses.replace(
        d,
        hidden_size=hw,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=wa.num_heads,
        num_key_value_heads=wa.num_kv_heads,
        head_dim=wa.head_dim,
        intermediate_size=shape.intermediate_size,
        vocab_size=tc.vocab_size,
        target_hidden_size=hw,
        rms_norm_eps=d.rms_norm_eps * hd / hw,
        target_layer_ids=tuple(positions[i] for i in d.target_layer_ids),
        logits_vocab_limit=d.vocab_size,
    )
    model = wide_default_dtype(dtype, device, lambda: type(demo)(cfg))
    gen = torch.Generator(device=model.fc.weight.device).manual_seed(seed)
    for p in model.parameters():  # the silent layers' random weights (everything else is written below)
        p.normal_(0.0, 0.02, generator=gen)
    _embed_dflash(model, demo, demo_positions(shape.num_layers, d.num_hidden_layers), da, wa)
    return model.eval()


def _embed_dflash(wide, demo, positions: tuple[int, ...], da: GQAConfig, wa: GQAConfig) -> None:
    d, w = demo.cfg, wide.cfg
    hd, hw, ht = d.hidden_size, w.hidden_size, d.target_hidden_size
    corner(wide.embed_tokens.weight, demo.embed_tokens.weight)  # the target's, the channel left out
    corner(wide.lm_head.weight, demo.lm_head.weight)  # the target's (zero past the demo's ids; -inf there)
    wide.mask_embedding.zero_()
    wide.mask_embedding[:hd] = demo.mask_embedding.to(wide.mask_embedding.dtype)
    taps = len(d.target_layer_ids)
    cols = torch.cat([b * w.target_hidden_size + torch.arange(ht) for b in range(taps)])  # the channel ignored
    project(wide.fc.weight, demo.fc.weight, None, cols)
    plain_norm(wide.context_norm.weight, demo.context_norm.weight, hw)
    plain_norm(wide.norm.weight, demo.norm.weight, hw)
    for i, layer in enumerate(wide.layers):
        if i in positions:
            dl = demo.layers[positions.index(i)]
            plain_norm(layer.input_layernorm.weight, dl.input_layernorm.weight, hw)
            plain_norm(layer.post_attention_layernorm.weight, dl.post_attention_layernorm.weight, hw)
            gqa_(layer, dl, da, wa)
            mlp_(layer, dl)
        else:  # a real layer that adds nothing to the block's stream (it still attends over the context)
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
            layer.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()
