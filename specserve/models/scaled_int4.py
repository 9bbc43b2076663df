"""The int4 side of the demo at real size (models/scaled_demo.py), for a published shape with int4 routed experts
(Kimi-K2.6): the demo's experts quantized at the shape's group size (quantize_int4), and the reference the wide int4
model reproduces (quantized_demo: the demo with its experts replaced by their int4 round trip)."""

from __future__ import annotations

import torch

from specserve.kernels.quant_reference import dequant_int4, pack_int4
from specserve.models.causal_lm import CausalLM
from specserve.models.config import ModelConfig


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] (C a multiple of group_size) -> (packed [R, C / 8] int32, scale [R, C / group_size] bf16): symmetric
    groups, scale = max |w| / 7 rounded to bf16, q = round(w / scale) in [-8, 7]; an all-zero group has scale 0."""
    rows, cols = w.shape
    groups = w.float().view(rows, cols // group_size, group_size)
    scale = (groups.abs().amax(-1) / 7.0).to(torch.bfloat16)  # [R, C / G]
    s = scale.float()[..., None]
    q = torch.where(s > 0, (groups / torch.where(s > 0, s, 1.0)).round(), 0.0).clamp(-8, 7).to(torch.int8)
    return pack_int4(q.view(rows, cols)), scale


def int4_roundtrip(w: torch.Tensor, group_size: int) -> torch.Tensor:  # [R, C] -> [R, C] float32
    """What the int4 experts compute with: w quantized (quantize_int4) and dequantized."""
    packed, scale = quantize_int4(w, group_size)
    return dequant_int4(packed, scale, group_size, w.shape[1])


@torch.no_grad()
def quantized_demo(demo: CausalLM, wide: ModelConfig) -> CausalLM:
    """The demo itself with its routed experts replaced, in place, by the int4 round trip the wide int4 model holds:
    gate / up as they are, down quantized as the wide model stores it (times demo rsf / wide rsf) and divided back.
    This is the reference a wide int4 model reproduces."""
    for layer in demo.model.layers:
        quantize_layer_experts_(layer, demo.config, wide)
    return demo


@torch.no_grad()
def quantize_layer_experts_(layer, demo: ModelConfig, wide: ModelConfig) -> None:
    """One demo decoder layer's routed experts replaced, in place, by the int4 round trip (`quantized_demo`); a dense
    layer is left as it is."""
    if not layer.is_moe:
        return
    group = wide.quantization.group_size
    down = demo.moe.routed_scaling_factor / wide.moe.routed_scaling_factor
    ex = layer.mlp.experts
    for e in range(ex.w13.shape[0]):
        ex.w13.data[e] = int4_roundtrip(ex.w13.data[e], group).to(ex.w13.dtype)
        ex.w2.data[e] = (int4_roundtrip(ex.w2.data[e].float() * down, group) / down).to(ex.w2.dtype)
