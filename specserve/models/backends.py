"""Backend selection for the model's two hot spots, in one place: routed experts and paged attention.

On CUDA: routed experts run through specserve.kernels.fused_moe (Triton; grouped_mm for long prefills) and
attention through FlashInfer where `attn_backend.flashinfer_unsupported` finds nothing against it. Elsewhere, or
when asked: the plain-torch paths (moe_reference, models/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.moe_reference import moe_reference_fixed_rows
from specserve.models.attn_backend import (
    ATTENTION_BACKENDS,
    AttentionBackendError,
    make_attention_backend,
    paged_torch_unsupported,
    select_attention_backend,
    triton_paged_unsupported,
)
from specserve.models.moe import moe_reference

MOE_BACKENDS = ("auto", "torch", "fused")
# attention backends whose row results depend on neither the step's row count nor its context length (invariant=True)
INVARIANT_ATTENTION = ("triton_paged", "paged_torch")


@dataclass(frozen=True)
class BackendChoice:
    attention: str  # "torch" | "flashinfer" | "triton_paged" | "paged_torch" | "reference"
    moe: str  # "torch" | "fused"
    fused_layers: bool = False  # CausalLM.set_fused_layers: Triton norm / RoPE + cache write / router kernels
    invariant: bool = False  # token-count invariant steps: the attention and torch MoE below in their invariant form
    skinny_gemm: bool = False  # with the fused layers: their projections through the skinny GEMM, else cuBLAS
    moe_block: bool = True  # with the fused layers: the gate GEMM in the router's kernel, shared experts routed
    fold_epilogues: bool = True  # with the fused layers: MoE top-k sum in the next norm, MLA's W_UV in its merge

    def __post_init__(self) -> None:
        if self.attention not in ("torch", "flashinfer", "triton_paged", "paged_torch", "reference"):
            raise AttentionBackendError(f"unknown attention backend {self.attention!r}")
        if self.moe not in ("torch", "fused"):
            raise AttentionBackendError(f"unknown MoE backend {self.moe!r}")
        if self.invariant and self.attention not in INVARIANT_ATTENTION:
            raise AttentionBackendError(
                f"invariant steps need one of the attention backends {INVARIANT_ATTENTION}, not {self.attention!r}"
            )


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


def invariant_attention(config, device: torch.device | str, requested: str) -> str:
    """The attention backend of invariant steps for `requested` ('auto': Triton paged on CUDA where it runs, else the
    paged torch attention); '' when the request is a backend that is not invariant or cannot run this model."""
    if requested == "auto":
        if not triton_paged_unsupported(config, device):
            return "triton_paged"
        return "" if paged_torch_unsupported(config) else "paged_torch"
    return requested if requested in INVARIANT_ATTENTION else ""


def select_backends(
    config,
    device: torch.device | str,
    dtype: torch.dtype,
    attention: str = "auto",
    moe: str = "auto",
    fused_layers: bool | None = None,
    invariant: bool | None = False,
    skinny_gemm: bool = False,
    moe_block: bool = True,
    fold_epilogues: bool = True,
) -> BackendChoice:
    """'auto' takes the fast backend where it can run; asking for a fast backend where it cannot is an error.
    fused_layers None: on with the fused MoE (bf16 / fp16 on CUDA); True: on (CUDA, any dtype); False: off.
    invariant (token-count invariant steps): None = on CUDA where the attention asked for allows it (auto picks an
    INVARIANT_ATTENTION backend), off on the CPU (where the steps pad to 64 rows: target_service/factory.py);
    True = required (an error where it cannot be had); False = off."""
    if moe not in MOE_BACKENDS:
        raise AttentionBackendError(f"MoE backend must be one of {MOE_BACKENDS}, got {moe!r}")
    if attention not in ATTENTION_BACKENDS + ("reference",):
        raise AttentionBackendError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {attention!r}")
    if invariant is None and torch.device(device).type != "cuda":
        invariant = False
    if invariant is not False:
        inv = invariant_attention(config, device, attention)
        if invariant and not inv:
            raise AttentionBackendError(
                f"invariant steps need the attention backend auto or one of "
                f"{INVARIANT_ATTENTION} that runs this model, not {attention!r}"
            )
        invariant, attention = bool(inv), inv or attention
    att = "reference" if attention == "reference" else select_attention_backend(config, device, dtype, attention)
    why = fused_moe_unsupported(device, dtype) if moe != "torch" else "asked for torch"
    if moe == "fused" and why:
        raise AttentionBackendError(f"the fused MoE cannot run here: {why}")
    why_layers = fused_layers_unsupported(device)
    if fused_layers and why_layers:
        raise AttentionBackendError(f"the fused layers cannot run here: {why_layers}")
    fused = (not why) if fused_layers is None else fused_layers
    return BackendChoice(
        attention=att,
        moe="torch" if why else "fused",
        fused_layers=fused,
        invariant=invariant,
        skinny_gemm=skinny_gemm,
        moe_block=moe_block,
        fold_epilogues=fold_epilogues,
    )


def install_backends(
    model, choice: BackendChoice, block_size: int, device: torch.device | str, dtype: torch.dtype
) -> None:
    """Point the model's MoE layers and attention layers at the chosen implementations."""
    if choice.moe == "fused":  # fixed tiles at a fixed row count and a fixed-order top-k sum: invariant as it is
        from specserve.kernels.fused_moe import fused_moe

        model.set_experts_fn(fused_moe)
    else:
        model.set_experts_fn(moe_reference_fixed_rows if choice.invariant else moe_reference)
    model.set_fused_layers(
        choice.fused_layers,
        skinny_gemm=choice.skinny_gemm,
        moe_block=choice.moe_block,
        fold_epilogues=choice.fold_epilogues,
    )
    model.set_attention_backend(
        make_attention_backend(model, choice.attention, block_size, device, dtype, invariant=choice.invariant)
    )
