"""Rotary position embeddings (default, linear, llama3, yarn), numerically as transformers computes them."""

from __future__ import annotations

import math

import torch

from specserve.models.config import RopeConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_scale(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """[dim // 2] float32 inverse frequencies and the factor cos/sin are multiplied by."""
    dim = rope.dim
    base_inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "default":
        return base_inv, 1.0
    if rope.rope_type == "linear":
        return base_inv / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, base_inv), 1.0
    return _yarn(rope)


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    old_ctx = rope.original_max_position_embeddings
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, base, factor = rope.dim, rope.theta, rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def softmax_scale_multiplier(rope: RopeConfig) -> float:
    """MLA: scaled rope (DeepSeek YaRN) multiplies the softmax scale by mscale(factor, mscale_all_dim)^2."""
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        return m * m
    return 1.0


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for positions; interleaved=False rotates halves, True rotates adjacent pairs."""

    def __init__(self, rope: RopeConfig) -> None:
        super().__init__()
        self.rope = rope
        inv_freq, self.scale = inv_freq_and_scale(rope)
        self._inv_freq = {inv_freq.device: inv_freq}  # per device; not a checkpoint tensor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, dim // 2] (already multiplied by the attention factor)."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[positions.device] = next(iter(self._inv_freq.values())).to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, dim/2]
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)

    def table(self, num_positions: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_positions, dim // 2] for positions 0..num_positions-1: row p is cos_sin's row for p (the
        fused RoPE kernels look tokens' rows up by position)."""
        return self.cos_sin(torch.arange(num_positions, device=device), dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """x [T, heads, dim]; cos/sin [T, dim/2]. Interleaved output is laid out [even pairs', odd pairs']
        (transformers' layout); both q and k get it, so the dot products are those of true pair rotation."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        if interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
