"""Map Hugging Face checkpoint tensor names onto our parameters (and the slice of them they fill)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Mixtral's original checkpoints call the MoE block `block_sparse_moe` and its projections w1/w3/w2.
_MODULE_ALIASES = ((".block_sparse_moe.", ".mlp."),)
_PROJ_TO_SHARD = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_SHARD_TO_PARAM = {"gate": "w13", "up": "w13", "gate_up": "w13", "down": "w2"}
_PER_EXPERT = re.compile(
    r"^(?P<prefix>model\.layers\.\d+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_FUSED = re.compile(r"^(?P<prefix>model\.layers\.\d+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: parameter name, weight_loader kwargs, and the pieces it fills."""

    param: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    pieces: tuple[Any, ...] = (None,)  # coverage keys; (None,) = the whole parameter


def resolve(name: str, num_layers: int, tied_embeddings: bool, num_experts: int) -> Target | None:
    """None = a tensor transformers would ignore too (rotary caches, MTP layers past num_layers, ...)."""
    if name.endswith(_IGNORED_SUFFIXES) or (tied_embeddings and name == "lm_head.weight"):
        return None
    layer = _LAYER.match(name)
    if layer and int(layer.group(1)) >= num_layers:  # e.g. DeepSeek-V3 multi-token-prediction layer 61
        return None
    for old, new in _MODULE_ALIASES:
        name = name.replace(old, new)
    m = _PER_EXPERT.match(name)
    if m:
        shard_id, expert = _PROJ_TO_SHARD[m["proj"]], int(m["expert"])
        return Target(
            f"{m['prefix']}.{_SHARD_TO_PARAM[shard_id]}",
            {"expert": expert, "shard_id": shard_id},
            ((expert, shard_id),),
        )
    m = _FUSED.match(name)
    if m:
        shard_id = "gate_up" if m["proj"] == "gate_up_proj" else "down"
        wanted = ("gate", "up") if shard_id == "gate_up" else ("down",)
        pieces = tuple((e, s) for e in range(num_experts) for s in wanted)
        return Target(f"{m['prefix']}.{_SHARD_TO_PARAM[shard_id]}", {"expert": None, "shard_id": shard_id}, pieces)
    return Target(name)


def required_pieces(param_name: str, local_experts: range | None) -> set[Any]:
    """Coverage keys a parameter needs before it is fully loaded."""
    if local_experts is None:
        return {None}
    shards = ("gate", "up") if param_name.endswith(".w13") else ("down",)
    return {(e, s) for e in local_experts for s in shards}


def checkpoint_name(param_name: str, piece: Any) -> str:
    """The per-expert checkpoint name of a missing piece (or the parameter name itself)."""
    if piece is None:
        return param_name
    expert, shard_id = piece
    prefix = param_name.rsplit(".", 1)[0]
    fused = "gate_up_proj" if shard_id in ("gate", "up") else "down_proj"
    return f"{prefix}.{expert}.{shard_id}_proj.weight (or fused {prefix}.{fused})"
