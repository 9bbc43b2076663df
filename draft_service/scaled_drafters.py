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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from specserve.draft_service.proposer import DrafterConfigError
from specserve.models.config import GQAConfig, ModelConfig
from specserve.models.model_names import ModelName
from specserve.models.scaled_demo import constant_channel, demo_positions, parse_scaled_spec


@dataclass(frozen=True)
class Eagle3Shape:
    """An EAGLE-3 head's shape at a target's width (its hidden is the target's)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int


EAGLE3_SHAPES: Mapping[str, Eagle3Shape] = MappingProxyType({
    "moonlight-16b-a3b": Eagle3Shape(32, 4, 128, 6144, 32000),
    "kimi-k2.6": Eagle3Shape(64, 8, 128, 18432, 32000),
    # CPU sizes (hidden 512, vocabulary 8192): the draft vocabulary still padded past the demo's 4096
    "small-moonlight": Eagle3Shape(8, 2, 128, 1024, 6144),
    "small-kimi-k2.6": Eagle3Shape(8, 2, 128, 1024, 6144),
})


# ---------------------------------------------------------------- pieces (wide tensors written in place)


def _corner(wide: torch.Tensor, demo: torch.Tensor, scale: float = 1.0) -> None:
    """wide [R, C] = demo [r, c] * scale in its top-left corner, zero elsewhere."""
    wide.zero_()
    wide[: demo.shape[0], : demo.shape[1]] = (demo.float() * scale).to(wide.dtype)


def _residual_norm(wide: torch.Tensor, demo: torch.Tensor, hidden_wide: int) -> None:
    """An RMSNorm weight over a stream that carries the constant channel at dim len(demo): the demo's times
    sqrt(H_demo / H_wide), zero on the channel (the demo's output, padded with zeros)."""
    hd = demo.shape[0]
    wide.fill_(1.0)
    wide[:hd] = (demo.float() * math.sqrt(hd / hidden_wide)).to(wide.dtype)
    wide[hd] = 0.0


def _head_dims(head_dim: int, wide_dim: int) -> torch.Tensor:
    """[head_dim] wide dim of each demo dim of a half-split rope head: i -> rho * i, D/2 + i -> D_w/2 + rho * i."""
    rho, half = wide_dim // head_dim, head_dim // 2
    i = torch.arange(half)
    return torch.cat([rho * i, wide_dim // 2 + rho * i])


def _heads(demo: GQAConfig, wide: GQAConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(wide q head of each demo q head [Hq], wide kv head of each demo kv head [Hkv]): kv groups kept."""
    g, gw = demo.num_heads // demo.num_kv_heads, wide.num_heads // wide.num_kv_heads
    j = torch.arange(demo.num_heads)
    return (j // g) * gw + j % g, torch.arange(demo.num_kv_heads)


def _rows(heads: torch.Tensor, dims: torch.Tensor, wide_dim: int) -> torch.Tensor:
    """[heads * len(dims)] wide row of each demo row (head-major)."""
    return (heads[:, None] * wide_dim + dims[None, :]).flatten()


def _qkv(wide: torch.Tensor, demo: torch.Tensor, rows: torch.Tensor, hd: int, hw: int, scale: float = 1.0) -> None:
    """A projection over concat(embedding, feature) [R, 2H]: demo row r -> wide row rows[r], its columns
    [0, hd) -> [0, hd) and [hd, 2hd) -> [hw, hw + hd)."""
    wide.zero_()
    src = (demo.float() * scale).to(wide.dtype)
    r = rows.to(wide.device)
    wide[r, :hd] = src[:, :hd]
    wide[r, hw: hw + hd] = src[:, hd:]


# ---------------------------------------------------------------- EAGLE-3


def scaled_eagle3_layers(demo_layers: tuple[int, ...], target: ModelConfig, demo: ModelConfig) -> tuple[int, ...]:
    """The wide target's hidden layers (outputs) of the demo head's: demo layer L -> demo_positions[L]."""
    positions = demo_positions(target.num_layers, demo.num_layers)
    return tuple(positions[i] for i in demo_layers)


@torch.no_grad()
def scaled_eagle3_head(head_dir: str | Path, target: ModelName, device: str | torch.device, dtype: torch.dtype):
    """The demo-size EAGLE-3 head of `head_dir` (made for the demo that `target` embeds) at `target`'s width, on
    `device` in `dtype` (module docstring)."""
    from specserve.draft_service.eagle3_head import Eagle3Config, Eagle3Head, load_eagle3_head

    name, _ = parse_scaled_spec(target.name)
    shape = EAGLE3_SHAPES[name]
    tc, dc = target.config(), target.demo_config()
    demo = load_eagle3_head(head_dir, target.folder, "cpu", torch.float32)
    d = demo.cfg
    hd, hw = d.hidden_size, tc.hidden_size
    if d.target_hidden_size != dc.hidden_size or hd != dc.hidden_size:
        raise DrafterConfigError(
            f"a demo@ target scales the demo's EAGLE-3 head (hidden {dc.hidden_size} over the demo's layers); the head "
            f"at {head_dir} has hidden {hd} over target layers of {d.target_hidden_size}")
    a = d.attention
    wa = GQAConfig(num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, bias=False)
    g, gw = a.num_heads // a.num_kv_heads, wa.num_heads // wa.num_kv_heads
    small = [f"{what} {x} > {y}" for what, x, y in (
        ("hidden", hd + 1, hw), ("kv heads", a.num_kv_heads, wa.num_kv_heads), ("kv group", g, gw),
        ("intermediate", d.intermediate_size, shape.intermediate_size),
        ("draft vocabulary", d.draft_vocab_size, shape.draft_vocab_size),
        ("draft vocabulary", shape.draft_vocab_size, tc.vocab_size)) if x > y]
    if small or a.bias or a.qk_norm or d.rope.rope_type != "default" or wa.head_dim % a.head_dim:
        raise DrafterConfigError(f"the demo's EAGLE-3 head does not scale to {target.name}: "
                                 f"{', '.join(small) or 'it needs default rope, no bias / qk norm, whole head dims'}")
    kappa, _ = constant_channel(dc, hw)
    eps = (d.rms_norm_eps * hd - kappa * kappa) / hw
    if eps <= 0:
        raise DrafterConfigError(f"the demo's EAGLE-3 eps {d.rms_norm_eps} leaves no room for the constant channel")
    layers = scaled_eagle3_layers(tuple(i - 1 for i in d.aux_layers), tc, dc) if d.aux_layers else None
    raw = dict(d.raw or {}, hidden_size=hw, intermediate_size=shape.intermediate_size, num_attention_heads=wa.num_heads,
               num_key_value_heads=wa.num_kv_heads, head_dim=wa.head_dim, rms_norm_eps=eps, vocab_size=tc.vocab_size,
               draft_vocab_size=shape.draft_vocab_size, target_hidden_size=hw, draft_vocab_limit=d.draft_vocab_size)
    if layers is not None:
        raw["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in layers]
    cfg = Eagle3Config(
        hidden_size=hw, intermediate_size=shape.intermediate_size, vocab_size=tc.vocab_size,
        draft_vocab_size=shape.draft_vocab_size, target_hidden_size=hw, rms_norm_eps=eps, attention=wa,
        rope=dataclasses.replace(d.rope, dim=wa.head_dim),
        aux_layers=tuple(i + 1 for i in layers) if layers is not None else None,
        raw=raw, draft_vocab_limit=d.draft_vocab_size,
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            wide = Eagle3Head(cfg, with_embeddings=True)
    finally:
        torch.set_default_dtype(old)
    _embed_eagle3(wide, demo, kappa)
    return wide.eval()


def _embed_eagle3(wide, demo, kappa: float) -> None:
    d, w = demo.cfg, wide.cfg
    hd, hw = d.hidden_size, w.hidden_size
    emb = wide.embed_tokens.weight
    _corner(emb, demo.embed_tokens.weight)
    emb[:, hd] = kappa  # the target's constant channel (models/scaled_demo.py)
    fc = wide.fc.weight  # [Hw, 3 Hw]
    fc.zero_()
    for b in range(3):
        fc[:hd, b * hw: b * hw + hd] = demo.fc.weight[:, b * hd: (b + 1) * hd].to(fc.dtype)
    fc[hd, hd] = 1.0  # the feature carries the channel: that of the first fused layer
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm"):
        _residual_norm(getattr(wide, norm).weight, getattr(demo, norm).weight, hw)
    a, wa = d.attention, w.attention
    q_heads, kv_heads = _heads(a, wa)
    dims = _head_dims(a.head_dim, wa.head_dim)
    _qkv(wide.q_proj.weight, demo.q_proj.weight, _rows(q_heads, dims, wa.head_dim), hd, hw,
         math.sqrt(wa.head_dim / a.head_dim))
    _qkv(wide.k_proj.weight, demo.k_proj.weight, _rows(kv_heads, dims, wa.head_dim), hd, hw)
    v_dims = torch.arange(a.head_dim)
    _qkv(wide.v_proj.weight, demo.v_proj.weight, _rows(kv_heads, v_dims, wa.head_dim), hd, hw)
    o = wide.o_proj.weight  # [Hw, heads_w * Dw]
    o.zero_()
    o[:hd, _rows(q_heads, v_dims, wa.head_dim).to(o.device)] = demo.o_proj.weight.to(o.dtype)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        _corner(getattr(wide, proj).weight, getattr(demo, proj).weight)
    _corner(wide.lm_head.weight, demo.lm_head.weight)
    vd = d.draft_vocab_size
    wide.d2t.zero_()  # padded draft id i -> target id i (past the demo's ids; never drafted)
    wide.d2t[:vd] = demo.d2t.to(wide.d2t.device)
    wide.t2d.zero_()
    wide.t2d[wide.draft_to_target()] = True
    padded = wide.draft_to_target()[vd:]
    if len(padded) and int(padded.min()) < d.vocab_size:
        raise DrafterConfigError("the padded draft ids would map onto the demo's target ids")
