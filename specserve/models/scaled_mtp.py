"""The shipped demo's MTP layer (draft_service/mtp.py, demo_model/mtp/) at a demo@ target's size, built at load time
by the construction of models/scaled_demo.py, so that it proposes exactly what it proposes at demo size.

Its shape is a DeepSeek-V3 MTP layer of the wide target: enorm, hnorm, eh_proj [H, 2H], one decoder layer of the
target's layer shape (MLA attention, the routed and shared experts: int4 experts where the target has them), and the
target's embedding and head (a copy: DeepSeek-V3 shares them; here the drafter holds its own). It is layer N of the
wide target (N its layer count): it reads the target's last layer, through the target's final norm.

- **Widths.** Every demo matrix sits in the top-left corner of its wide one (eh_proj: both input halves), the rest
  zero; the embedding and head are the demo's rows in the corner, the head's rows past the demo's ids zero and their
  logits -inf (`ModelConfig.logits_vocab_limit`). The block's layer is written by `embed_decoder_layer` (the
  target's: attention heads, rope pair mapping, q scaling, latent norms, MoE routing with the null-expert group).
- **The channel.** The target's constant channel (dim H_demo) cannot reach the layer's own streams: each of them
  (the embedding through enorm, the target row through the final norm, the block's output through hnorm) passes an
  RMSNorm, whose output has no constant dim. But the null experts' routers need only a positive input, not a
  constant one. So the embedding holds a tiny tau = CHANNEL at dim H_demo; enorm passes it (weight 1) as
  tau / rms(e) > 0; eh_proj copies it to the block's dim H_demo, which no later weight writes or reads except the
  null experts' routers (post-attention norm weight 1 / tau there, router weight -NULL_LOGIT: their score is 0
  and the demo's renormalised weights are unchanged). Every other norm has weight 0 on the channel.
- **Norms.** The layer's streams carry no constant channel, so their norms are rescaled as the draft LM's are:
  weights times sqrt(H_demo / H_wide), eps eps_demo * H_demo / H_wide. The channel's tau^2 / rms(e)^2 (about
  1e-8 of a stream's square norm) is all that differs from the demo's mean square: below float32 rounding. The
  target's final norm is the target's (its eps, zero on the channel): the target row it reads carries the
  constant channel, so that norm is exact.

With a demo@ target the registry's mtp factory (mtp.py) builds this from the demo-size MTP folder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from specserve.models.config import ModelConfig
from specserve.models.errors import ModelConfigError
from specserve.models.model_names import ModelName
from specserve.models.scaled_embed import embed_decoder_layer
from specserve.models.scaled_weights import corner, plain_norm, project, residual_norm, wide_default_dtype

CHANNEL = 2.0**-20  # tau: the embedding's channel value (exact in bf16); its square is far below float32 rounding


def scaled_mtp_config(target: ModelConfig, demo_block: ModelConfig) -> ModelConfig:
    """The wide MTP layer's config: the target's layer shape (as layer 0 of one), the demo block's eps rescaled to the
    target's width, logits past the demo's ids -inf."""
    moe = dataclasses.replace(target.moe, layers=(0,)) if target.moe is not None else None
    hd, hw = demo_block.hidden_size, target.hidden_size
    return dataclasses.replace(
        target,
        num_layers=1,
        moe=moe,
        rms_norm_eps=demo_block.rms_norm_eps * hd / hw,
        logits_vocab_limit=demo_block.vocab_size,
    )


@torch.no_grad()
def scaled_mtp_layer(
    demo,
    demo_spec,
    folder: str | Path,
    target: ModelName,
    device: str | torch.device,
    dtype: torch.dtype,
    seed: int = 0,
):
    """(layer, spec): the demo-size MTP layer `demo` with its spec `demo_spec` (loaded from `folder`, layer N of the
    demo that `target` embeds, in float32 on `device`: the MoE routers are written by index_put_, which takes values
    on the destination's device only) at `target`'s size, on `device` in `dtype`: a layer of demo's class and a spec
    of demo_spec's (module docstring)."""
    from specserve.models.presets import init_random_

    tc, dc = target.config(), target.demo_config()
    db = demo_spec.block
    block = scaled_mtp_config(tc, db)
    bad = [
        f"{what} {x} vs {y}"
        for what, x, y in (
            ("the demo's layers", demo_spec.num_target_layers, dc.num_layers),
            ("hidden", db.hidden_size, dc.hidden_size),
            ("MoE", bool(db.moe_layers), bool(block.moe_layers)),
        )
        if x != y
    ]
    if bad:
        raise ModelConfigError(f"the MTP layer {folder} does not scale to {target.name}: {', '.join(bad)}")
    wide = wide_default_dtype(dtype, device, lambda: type(demo)(block, target_eps=tc.rms_norm_eps))
    init_random_(wide, seed)  # the experts no token is routed to keep random weights and routers (a real layer's)
    _embed_mtp(wide, demo, db, block)
    return wide.eval(), dataclasses.replace(demo_spec, num_target_layers=tc.num_layers, block=block)


def _embed_mtp(wide, demo, dc: ModelConfig, wc: ModelConfig) -> None:
    hd, hw = dc.hidden_size, wc.hidden_size
    emb = wide.embed_tokens.weight
    corner(emb, demo.embed_tokens.weight)
    emb[:, hd] = CHANNEL
    plain_norm(wide.enorm.weight, demo.enorm.weight, hw)  # weight 1 on the channel: tau / rms(e) passes
    residual_norm(wide.hnorm.weight, demo.hnorm.weight, hw)
    project(wide.eh_proj.weight, demo.eh_proj.weight, None, torch.cat([torch.arange(hd), hw + torch.arange(hd)]))
    wide.eh_proj.weight[hd, hd] = 1.0  # the block's channel: enorm's
    embed_decoder_layer(wide.block, demo.block, dc, wc, CHANNEL)
    residual_norm(wide.shared_head["norm"].weight, demo.shared_head["norm"].weight, hw)
    corner(wide.shared_head["head"].weight, demo.shared_head["head"].weight)
    residual_norm(wide.target_norm.weight, demo.target_norm.weight, hw)
