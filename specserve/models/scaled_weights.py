"""The pieces of the demo-scaling construction (models/scaled_demo.py, scaled_drafters.py, scaled_mtp.py): wide
tensors written in place from demo-size ones (corners, head and rope-dim maps, RMSNorm weights over a stream with or
without the constant channel), GQA and MLP layers projected into wide ones, and the wide module built where it runs."""

from __future__ import annotations

import math

import torch

from specserve.models.config import GQAConfig


def corner(wide: torch.Tensor, demo: torch.Tensor, scale: float = 1.0) -> None:
    """wide [R, C] = demo [r, c] * scale in its top-left corner, zero elsewhere."""
    wide.zero_()
    wide[: demo.shape[0], : demo.shape[1]] = (demo.float() * scale).to(wide.dtype)


def residual_norm(wide: torch.Tensor, demo: torch.Tensor, hidden_wide: int) -> None:
    """An RMSNorm weight over a stream that carries the constant channel at dim len(demo): the demo's times
    sqrt(H_demo / H_wide), zero on the channel (the demo's output, padded with zeros)."""
    hd = demo.shape[0]
    wide.fill_(1.0)
    wide[:hd] = (demo.float() * math.sqrt(hd / hidden_wide)).to(wide.dtype)
    wide[hd] = 0.0


def head_dims(head_dim: int, wide_dim: int) -> torch.Tensor:
    """[head_dim] wide dim of each demo dim of a half-split rope head: i -> rho * i, D/2 + i -> D_w/2 + rho * i."""
    rho, half = wide_dim // head_dim, head_dim // 2
    i = torch.arange(half)
    return torch.cat([rho * i, wide_dim // 2 + rho * i])


def heads(demo: GQAConfig, wide: GQAConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(wide q head of each demo q head [Hq], wide kv head of each demo kv head [Hkv]): kv groups kept."""
    g, gw = demo.num_heads // demo.num_kv_heads, wide.num_heads // wide.num_kv_heads
    j = torch.arange(demo.num_heads)
    return (j // g) * gw + j % g, torch.arange(demo.num_kv_heads)


def rows(heads: torch.Tensor, dims: torch.Tensor, wide_dim: int) -> torch.Tensor:
    """[heads * len(dims)] wide row of each demo row (head-major)."""
    return (heads[:, None] * wide_dim + dims[None, :]).flatten()


def project(
    wide: torch.Tensor,
    demo: torch.Tensor,
    rows: torch.Tensor | None = None,
    cols: torch.Tensor | None = None,
    scale: float = 1.0,
) -> None:
    """wide [R, C] zero but wide[rows[i], cols[j]] = demo[i, j] * scale (rows / cols default: the first ones)."""
    wide.zero_()
    r = (torch.arange(demo.shape[0]) if rows is None else rows).to(wide.device)
    c = (torch.arange(demo.shape[1]) if cols is None else cols).to(wide.device)
    wide[r[:, None], c[None, :]] = (demo.float() * scale).to(wide.dtype).to(wide.device)


def gqa_(wide, demo, d: GQAConfig, w: GQAConfig, cols: torch.Tensor | None = None) -> None:
    """q/k/v/o_proj of a GQA layer (half-split rope) into its wide one: heads by kv group, rope dims pair to pair,
    q scaled for the softmax scale; `cols`: the wide input column of each demo input column."""
    q_heads, kv_heads = heads(d, w)
    dims, v_dims = head_dims(d.head_dim, w.head_dim), torch.arange(d.head_dim)
    project(
        wide.q_proj.weight,
        demo.q_proj.weight,
        rows(q_heads, dims, w.head_dim),
        cols,
        math.sqrt(w.head_dim / d.head_dim),
    )
    project(wide.k_proj.weight, demo.k_proj.weight, rows(kv_heads, dims, w.head_dim), cols)
    project(wide.v_proj.weight, demo.v_proj.weight, rows(kv_heads, v_dims, w.head_dim), cols)
    project(wide.o_proj.weight, demo.o_proj.weight, None, rows(q_heads, v_dims, w.head_dim))


def mlp_(wide, demo) -> None:
    for proj in ("gate_proj", "up_proj", "down_proj"):
        project(getattr(wide, proj).weight, getattr(demo, proj).weight)


def plain_norm(wide: torch.Tensor, demo: torch.Tensor, hidden_wide: int) -> None:
    """An RMSNorm weight over a stream without the channel (the demo's padded with zeros; its eps
    eps_demo * H_demo / H_wide): the demo's times sqrt(H_demo / H_wide)."""
    hd = demo.shape[0]
    wide.fill_(1.0)
    wide[:hd] = (demo.float() * math.sqrt(hd / hidden_wide)).to(wide.dtype)


def check_gqa(d: GQAConfig, w: GQAConfig, what: str) -> list[str]:
    """Why the demo's attention `d` does not embed in `w` (nothing when it does)."""
    g, gw = d.num_heads // d.num_kv_heads, w.num_heads // w.num_kv_heads
    bad = [f"{n} {x} > {y}" for n, x, y in (("kv heads", d.num_kv_heads, w.num_kv_heads), ("kv group", g, gw)) if x > y]
    if w.head_dim % d.head_dim:
        bad.append(f"head_dim {w.head_dim} is not a whole multiple of {d.head_dim}")
    if d.bias or d.qk_norm or d.sliding_window:
        bad.append("bias / qk norm / sliding window")
    return [f"{what}: {b}" for b in bad]


def wide_default_dtype(dtype: torch.dtype, device, build):
    """build() with `device` and `dtype` the defaults (the wide module made where and how it runs)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return build()
    finally:
        torch.set_default_dtype(old)
