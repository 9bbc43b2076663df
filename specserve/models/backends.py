"""Backend selection for the model's two hot spots, in one place: routed experts and paged attention.

On CUDA: routed experts run through specserve.kernels.fused_moe (Triton; grouped_mm for long prefills) and
attention through FlashInfer where `attn_backend.flashinfer_unsupported` finds nothing against it. Elsewhere, or
when asked: the plain-torch paths (moe_reference, models/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.models.attn_backend import (
    ATTENTION_BACKENDS,
    AttentionBackendError,
    make_attention_backend,
    select_attention_backend,
)
from specserve.models.moe import moe_reference

MOE_BACKENDS = ("auto", "torch", "fused")


@dataclass(frozen=True)
class BackendChoice:
    attention: str  # "torch" | "flashinfer" | "triton_paged" | "paged_torch" | "reference"
    moe: str  # "torch" | "fused"
    fused_layers: bool = False  # CausalLM.set_fused_layers: Triton norm / RoPE + cache write / router kernels

    def __post_init__(self) -> None:
        if self.attention not in ("torch", "flashinfer", "triton_paged", "paged_torch", "reference"):
            raise AttentionBackendError(f"unknown attention backend {self.attention!r}")
        if self.moe not in ("torch", "fused"):
            raise AttentionBackendError(f"unknown MoE backend {self.moe!r}")


def fused_moe_unsupported(device: torch.device | str, dtype: torch.dtype) -> str:
    """Why the Triton fused MoE cannot run here ('' when it can)."""
    from specserve.kernels.fused_moe import HAS_TRITON

    if torch.device(device).type != "cuda":
        return f"device {device} is not CUDA"
    if not HAS_TRITON:
        return "triton is not installed"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (the fused MoE needs bf16 or fp16)"
    return ""


def fused_layers_unsupported(device: torch.device | str) -> str:
    """Why the fused layers' Triton kernels cannot run here ('' when they can)."""
    from specserve.kernels.norm import HAS_TRITON

    if torch.device(device).type != "cuda":
        return f"device {device} is not CUDA"
    return "" if HAS_TRITON else "triton is not installed"


def select_backends(config, device: torch.device | str, dtype: torch.dtype, attention: str = "auto",
                    moe: str = "auto", fused_layers: bool | None = None) -> BackendChoice:
    """'auto' takes the fast backend where it can run; asking for a fast backend where it cannot is an error.
    fused_layers None: on with the fused MoE (bf16 / fp16 on CUDA); True: on (CUDA, any dtype); False: off."""
    if moe not in MOE_BACKENDS:
        raise AttentionBackendError(f"MoE backend must be one of {MOE_BACKENDS}, got {moe!r}")
    if attention not in ATTENTION_BACKENDS + ("reference",):
        raise AttentionBackendError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {attention!r}")
    att = "reference" if attention == "reference" else select_attention_backend(config, device, dtype, attention)
    why = fused_moe_unsupported(device, dtype) if moe != "torch" else "asked for torch"
    if moe == "fused" and why:
        raise AttentionBackendError(f"the fused MoE cannot run here: {why}")
    why_layers = fused_layers_unsupported(device)
    if fused_layers and why_layers:
        raise AttentionBackendError(f"the fused layers cannot run here: {why_layers}")
    fused = (not why) if fused_layers is None else fused_layers
    return BackendChoice(attention=att, moe="torch" if why else "fused", fused_layers=fused)


def install_backends(model, choice: BackendChoice, block_size: int, device: torch.device | str,
                     dtype: torch.dtype) -> None:
    """Point the model's MoE layers and attention layers at the chosen implementations."""
    if choice.moe == "fused":
        from specserve.kernels.fused_moe import fused_moe

        model.set_experts_fn(fused_moe)
    else:
        model.set_experts_fn(moe_reference)
    model.set_fused_layers(choice.fused_layers)
    model.set_attention_backend(make_attention_backend(model, choice.attention, block_size, device, dtype))
