"""The shipped demo DSpark drafter at a demo@ target's size (draft_service/dspark.py), proposing exactly what it
proposes at demo size.

Its block is DFlash's scaled (scaled_drafters.scaled_dflash of its block: at the target's width, the demo's layers
spread over silent ones, every norm rescaled so the block's final-normed rows z are the demo's padded with zeros, the
target's embeddings without the channel, logits past the demo's ids -inf). The two heads read only z, those embeddings
and the drafted token's log q, so they embed as corners: the Markov head's h_proj / e_proj [r, H] and out [V, r] and
the confidence head's w_z [1, H] / w_u [1, r] hold the demo's in their top-left corners, zero elsewhere, at the rank of
DSPARK_MARKOV_RANKS (a realistic head for the target: the rank's extra units read 0 and add 0). So u, the logits
(padded ids at -inf, the Markov correction 0 there) and c are the demo's, padded.

As the other scaled drafters, it takes the loaded demo-size drafter (the family's factory loads it) and builds the wide
one of its class, so nothing here imports draft_service; a drafter that does not scale is a ModelConfigError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from specserve.models.errors import ModelConfigError
from specserve.models.model_names import ModelName
from specserve.models.scaled_drafters import scaled_dflash
from specserve.models.scaled_shapes import parse_scaled_spec
from specserve.models.scaled_weights import corner, wide_default_dtype

DSPARK_MARKOV_RANKS: Mapping[str, int] = MappingProxyType(
    {
        "moonlight-16b-a3b": 256,
        "kimi-k2.6": 256,
        "small-moonlight": 64,
        "small-kimi-k2.6": 64,
    }
)


@torch.no_grad()
def scaled_dspark(
    demo, checkpoint: str | Path, target: ModelName, device: str | torch.device, dtype: torch.dtype, seed: int = 0
):
    """The demo-size DSpark drafter `demo` (loaded from `checkpoint` on the CPU in float32) at `target`'s size, on
    `device` in `dtype`: a module of demo's class (module docstring)."""
    name, _ = parse_scaled_spec(target.name)
    rank = DSPARK_MARKOV_RANKS[name]
    if demo.spark_cfg.markov_rank > rank:
        raise ModelConfigError(
            f"the DSpark drafter {checkpoint} does not scale to {target.name}: markov_rank "
            f"{demo.spark_cfg.markov_rank} > {rank}"
        )
    block = scaled_dflash(demo.block, checkpoint, target, device, dtype, seed)
    cfg = dataclasses.replace(demo.spark_cfg, block=block.cfg, markov_rank=rank)
    wide = wide_default_dtype(dtype, device, lambda: type(demo)(cfg, block))
    for part in ("h_proj", "e_proj", "out"):
        corner(getattr(wide.markov, part).weight, getattr(demo.markov, part).weight)
    corner(wide.confidence.w_z.weight, demo.confidence.w_z.weight)
    corner(wide.confidence.w_u.weight, demo.confidence.w_u.weight)
    wide.confidence.w_z.bias.copy_(demo.confidence.w_z.bias)
    wide.confidence.w_lp.copy_(demo.confidence.w_lp)
    return wide.eval()
