"""Building blocks whose parameters know how to load (and later tensor-parallel shard) themselves.

Every parameter carries ``param.weight_loader(param, loaded, **kwargs)``; at tp_size=1 it is a checked
copy. Column-parallel layers split the output dim across tp ranks, row-parallel ones the input dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.target_service.models.config import ParallelConfig


class WeightShapeError(ValueError):
    """A checkpoint tensor does not fit the parameter (slice) it is loaded into."""


def new_param(shape: tuple[int, ...], dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightShapeError(f"expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


def shard(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """The rank-th of `size` equal slices of `tensor` along `dim`."""
    if size == 1:
        return tensor
    if tensor.shape[dim] % size:
        raise WeightShapeError(f"dim {dim} of shape {tuple(tensor.shape)} does not split into {size} ranks")
    part = tensor.shape[dim] // size
    return tensor.narrow(dim, rank * part, part)


def divide(n: int, size: int, what: str) -> int:
    if n % size:
        raise WeightShapeError(f"{what} = {n} is not divisible by tp_size {size}")
    return n // size


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    copy_checked(param.data, loaded)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = new_param((size,))
        self.weight.weight_loader = default_weight_loader
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class ReplicatedLinear(nn.Module):
    """Full weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = new_param((out_features, in_features))
        self.weight.weight_loader = default_weight_loader
        self.bias = None
        if bias:
            self.bias = new_param((out_features,))
            self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across tp ranks (each rank yields its output slice)."""

    def __init__(self, in_features: int, out_features: int, parallel: ParallelConfig, bias: bool = False) -> None:
        super().__init__()
        self.parallel = parallel
        local_out = divide(out_features, parallel.tp_size, "output features")
        self.weight = new_param((local_out, in_features))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = new_param((local_out,))
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        copy_checked(param.data, shard(loaded, 0, self.parallel.tp_rank, self.parallel.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across tp ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, parallel: ParallelConfig, bias: bool = False) -> None:
        super().__init__()
        self.parallel = parallel
        local_in = divide(in_features, parallel.tp_size, "input features")
        self.weight = new_param((out_features, local_in))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = new_param((out_features,))
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: replicated, added once after the reduction
            copy_checked(param.data, loaded)
        else:
            copy_checked(param.data, shard(loaded, 1, self.parallel.tp_rank, self.parallel.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.parallel.tp_size > 1:
            torch.distributed.all_reduce(out)
        return out if self.bias is None else out + self.bias


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden] (replicated; vocab sharding is a later addition)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = new_param((vocab_size, hidden_size))
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return F.embedding(input_ids, self.weight)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); the dense FFN and the DeepSeek shared experts."""

    def __init__(self, hidden: int, intermediate: int, parallel: ParallelConfig, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, parallel, bias)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, parallel, bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, parallel, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
