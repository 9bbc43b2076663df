"""The two quantized checkpoint formats we read, parsed from config.json's ``quantization_config``.

- ``Int4PackConfig``: compressed-tensors ``pack-quantized`` (Kimi-K2-Thinking, K2.5, K2.6): 4-bit symmetric
  int weights in groups along the input dim, no zero points, activations unquantized (W4A16);
- ``Fp8BlockConfig``: ``quant_method: fp8`` with ``weight_block_size`` (DeepSeek-V3/R1, Qwen3 FP8): e4m3
  weights with one scale per [bo, bi] block, activations dynamic.

Any other method or variant is refused with one line naming it (``ModelConfigError``). Which Linears are
quantized is read from the tensors themselves (``weight_packed`` / ``weight_scale_inv`` next to a name);
the ignore lists here serve the byte floors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specserve.models.errors import ModelConfigError

SUPPORTED = (
    "compressed-tensors (pack-quantized int4, symmetric group weights) and fp8 (block-scaled, dynamic activations)"
)


_NEVER_QUANTIZED = ("lm_head", "mlp.gate", "embed_tokens")


def _matches(module: str, patterns: tuple[str, ...]) -> bool:
    """compressed-tensors ignore semantics: 're:<regex>' matched from the start, else the exact module name
    or (vLLM / transformers modules_to_not_convert) a name part of it."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif module == p or module.endswith("." + p) or f".{p}." in f".{module}.":
            return True
    return False


@dataclass(frozen=True)
class Int4PackConfig:
    group_size: int = 32
    ignore: tuple[str, ...] = ()  # module names / "re:" patterns left in bf16

    method = "compressed-tensors"

    def __post_init__(self) -> None:
        if self.group_size <= 0 or self.group_size % 8:
            raise ModelConfigError(f"int4 group_size must be a positive multiple of 8, got {self.group_size}")

    def quantizes(self, module: str) -> bool:
        """Whether `module` (checkpoint name, e.g. model.layers.3.mlp.experts.7.up_proj) is int4: a Linear
        (compressed-tensors' target; the router and embeddings are not Linears) outside the ignore list."""
        return not _matches(module, self.ignore) and not module.endswith(_NEVER_QUANTIZED)


@dataclass(frozen=True)
class Fp8BlockConfig:
    block: tuple[int, int] = (128, 128)  # (rows of out, columns of in) per scale
    not_converted: tuple[str, ...] = ()  # Qwen's modules_to_not_convert

    method = "fp8"

    def __post_init__(self) -> None:
        if len(self.block) != 2 or min(self.block) <= 0:
            raise ModelConfigError(f"fp8 weight_block_size must be two positive ints, got {list(self.block)}")

    def quantizes(self, module: str) -> bool:
        """Embeddings, norms, routers (mlp.gate) and lm_head stay unquantized."""
        return not _matches(module, self.not_converted) and not module.endswith(_NEVER_QUANTIZED)


QuantConfig = Int4PackConfig | Fp8BlockConfig


def parse_quantization(raw: Mapping[str, Any] | None) -> QuantConfig | None:
    """``quantization_config`` -> our config, or a one-line ModelConfigError naming what is not supported."""
    if not raw:
        return None
    if not isinstance(raw, Mapping):
        raise ModelConfigError(f"quantization_config must be a JSON object, got {type(raw).__name__}")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "fp8":
        return _fp8(raw)
    raise ModelConfigError(
        f"quantized checkpoints with quant_method {method!r} are not supported; supported: {SUPPORTED}"
    )


def _compressed_tensors(raw: Mapping[str, Any]) -> Int4PackConfig:
    groups = raw.get("config_groups") or {}
    if not groups:
        raise ModelConfigError("compressed-tensors quantization_config has no config_groups")
    sizes = set()
    for name, group in groups.items():
        fmt = group.get("format") or raw.get("format")
        weights = group.get("weights") or {}
        wanted = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        got = {k: weights.get(k) for k in wanted}
        if fmt != "pack-quantized" or got != wanted or group.get("input_activations") or weights.get("actorder"):
            raise ModelConfigError(
                f"compressed-tensors group {name!r} (format {fmt!r}, weights {got}, input_activations "
                f"{group.get('input_activations')!r}, actorder {weights.get('actorder')!r}) is not supported; "
                f"supported: {SUPPORTED}"
            )
        sizes.add(weights.get("group_size"))
    if len(sizes) != 1 or not isinstance(next(iter(sizes)), int):
        raise ModelConfigError(f"compressed-tensors groups need one integer group_size, got {sorted(map(str, sizes))}")
    return Int4PackConfig(group_size=sizes.pop(), ignore=tuple(raw.get("ignore") or ()))


def _fp8(raw: Mapping[str, Any]) -> Fp8BlockConfig:
    fmt = raw.get("fmt", "e4m3")
    scheme = raw.get("activation_scheme", "dynamic")
    block = raw.get("weight_block_size")
    if fmt != "e4m3" or scheme != "dynamic" or not block:
        raise ModelConfigError(
            f"fp8 checkpoints with fmt {fmt!r}, activation_scheme {scheme!r}, weight_block_size {block!r} are not "
            f"supported; supported: {SUPPORTED}"
        )
    if not (isinstance(block, (list, tuple)) and all(isinstance(b, int) for b in block)):
        raise ModelConfigError(f"fp8 weight_block_size must be two ints, got {block!r}")
    return Fp8BlockConfig(block=tuple(block), not_converted=tuple(raw.get("modules_to_not_convert") or ()))
