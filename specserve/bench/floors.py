"""Memory-traffic floors of one target step, from bytes (pure arithmetic, no torch).

A decode/verify step of an MoE target is bound by the bytes it must read:

    dense    every weight read whatever the tokens: attention, norms, routers, dense MLP layers,
             shared experts, lm_head (the whole matrix: every forward computes logits)
    embedding  one row per token in the forward (pending + drafted)
    experts  the routed experts actually used: distinct (layer, expert) pairs the step's tokens
             routed to (VerifyResult.experts_touched) * bytes of one expert (3 * H * I * dtype bytes;
             int4 / fp8 checkpoints: the packed weights plus their scales, as stored)
    kv       the cached context: context_len * (one token's cache entry bytes) * layers

floor_ms = bytes / measured copy bandwidth. A measured step time divided into the floor gives the
achieved fraction of the memory-bound ideal (1.0 = at the floor).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

DENSE_ROLES = ("attention", "norm", "router", "dense_mlp", "shared_experts", "lm_head", "other")


class FloorError(ValueError):
    """Inputs to a floor computation that cannot describe a real step."""


@dataclass(frozen=True)
class ModelBytes:
    """What one forward of the target reads, by role (derived from the loaded model's parameters)."""

    dense_bytes: Mapping[str, int]  # role (DENSE_ROLES) -> bytes read every step
    embedding_row_bytes: int  # one embedding row (0 when tied: lm_head already reads the matrix)
    expert_bytes: int  # one routed expert of one layer (gate + up + down)
    num_moe_layers: int
    num_experts: int  # routed experts per MoE layer
    kv_entry_bytes: int  # one token's cache entry in one layer
    num_layers: int
    param_bytes_total: int = 0  # every parameter, for reference (dense + all experts + embedding)
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        unknown = set(self.dense_bytes) - set(DENSE_ROLES)
        if unknown:
            raise FloorError(f"unknown dense roles {sorted(unknown)}; known: {DENSE_ROLES}")
        for name in ("embedding_row_bytes", "expert_bytes", "num_moe_layers", "num_experts", "kv_entry_bytes"):
            if getattr(self, name) < 0:
                raise FloorError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_layers <= 0:
            raise FloorError(f"num_layers must be > 0, got {self.num_layers}")
        if any(v < 0 for v in self.dense_bytes.values()):
            raise FloorError("dense byte counts must be >= 0")
        object.__setattr__(self, "dense_bytes", MappingProxyType(dict(self.dense_bytes)))

    @property
    def dense_total(self) -> int:
        return sum(self.dense_bytes.values())

    @property
    def max_experts(self) -> int:
        return self.num_moe_layers * self.num_experts

    def as_dict(self) -> dict:
        return {
            "dense_bytes": dict(self.dense_bytes),
            "dense_total": self.dense_total,
            "embedding_row_bytes": self.embedding_row_bytes,
            "expert_bytes": self.expert_bytes,
            "num_moe_layers": self.num_moe_layers,
            "num_experts": self.num_experts,
            "kv_entry_bytes": self.kv_entry_bytes,
            "num_layers": self.num_layers,
            "param_bytes_total": self.param_bytes_total,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class StepBytes:
    dense: int
    embedding: int
    experts: int
    kv: int

    @property
    def total(self) -> int:
        return self.dense + self.embedding + self.experts + self.kv


def expert_bytes(hidden_size: int, intermediate_size: int, dtype_bytes: int) -> int:
    """One gated expert: gate [I, H] + up [I, H] + down [H, I]."""
    if min(hidden_size, intermediate_size, dtype_bytes) <= 0:
        raise FloorError("hidden_size, intermediate_size and dtype_bytes must be > 0")
    return 3 * hidden_size * intermediate_size * dtype_bytes


def int4_linear_bytes(out_features: int, in_features: int, group_size: int, scale_bytes: int = 2) -> int:
    """An int4 pack-quantized [out, in] weight: int32 words of 8 values + one (bf16) scale per group."""
    if min(out_features, in_features, group_size, scale_bytes) <= 0:
        raise FloorError("out_features, in_features, group_size and scale_bytes must be > 0")
    return out_features * (-(-in_features // 8) * 4 + -(-in_features // group_size) * scale_bytes)


def fp8_linear_bytes(out_features: int, in_features: int, block: tuple[int, int], scale_bytes: int = 4) -> int:
    """An fp8 block-scaled [out, in] weight: one byte per value + one (float32) scale per [bo, bi] block."""
    if min(out_features, in_features, *block, scale_bytes) <= 0:
        raise FloorError("out_features, in_features, block and scale_bytes must be > 0")
    return out_features * in_features + -(-out_features // block[0]) * -(-in_features // block[1]) * scale_bytes


def kv_bytes(context_len: int, kv_entry_bytes: int, num_layers: int) -> int:
    if context_len < 0:
        raise FloorError(f"context_len must be >= 0, got {context_len}")
    return context_len * kv_entry_bytes * num_layers


def step_bytes(model: ModelBytes, num_tokens: int, experts_touched: int, context_len: int) -> StepBytes:
    """Bytes one forward must read: num_tokens = pending + drafted tokens fed to the target."""
    if num_tokens <= 0:
        raise FloorError(f"a step feeds at least the pending token, got num_tokens={num_tokens}")
    if not 0 <= experts_touched <= model.max_experts:
        raise FloorError(f"experts_touched {experts_touched} outside [0, {model.max_experts}]")
    return StepBytes(
        dense=model.dense_total,
        embedding=num_tokens * model.embedding_row_bytes,
        experts=experts_touched * model.expert_bytes,
        kv=kv_bytes(context_len, model.kv_entry_bytes, model.num_layers),
    )


def floor_ms(num_bytes: int, bandwidth_bytes_per_s: float) -> float:
    if bandwidth_bytes_per_s <= 0:
        raise FloorError(f"bandwidth must be > 0, got {bandwidth_bytes_per_s}")
    if num_bytes < 0:
        raise FloorError(f"bytes must be >= 0, got {num_bytes}")
    return num_bytes / bandwidth_bytes_per_s * 1e3


def achieved_fraction(floor: float, measured_ms: float) -> float | None:
    """floor / measured (1.0 = the step ran at the memory floor); None when nothing was measured."""
    if measured_ms <= 0:
        return None
    return floor / measured_ms
