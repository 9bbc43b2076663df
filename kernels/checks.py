"""Argument checking shared by the kernel wrappers: every bad input becomes a KernelArgumentError naming it."""

from __future__ import annotations

import os
from typing import Sequence

import torch


class KernelArgumentError(ValueError):
    """A kernel wrapper was given a tensor of the wrong shape, dtype, device, layout or value range."""


def triton_interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require(cond: bool, message: str) -> None:
    """Raise KernelArgumentError(message) unless cond holds."""
    if not cond:
        raise KernelArgumentError(message)


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    contiguous: bool = True,
) -> torch.Tensor:
    """Check that `t` is a tensor with `ndim` dims, one of `dtypes`, and (optionally) contiguous."""
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise KernelArgumentError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise KernelArgumentError(f"{name} has dtype {t.dtype}; expected one of: {allowed}")
    if contiguous and not t.is_contiguous():
        raise KernelArgumentError(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")
    return t


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """Check t.shape[dim] == expected, naming `what` the size should match."""
    if t.shape[dim] != expected:
        raise KernelArgumentError(
            f"{name}.shape[{dim}] is {t.shape[dim]} but must equal {what} ({expected}); shape {tuple(t.shape)}"
        )


def check_same_device(names_and_tensors: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    """Check all tensors live on one device; return it."""
    first_name, first = names_and_tensors[0]
    for name, t in names_and_tensors[1:]:
        if t.device != first.device:
            raise KernelArgumentError(f"{name} is on {t.device} but {first_name} is on {first.device}")
    return first.device
