"""Building blocks whose parameters know how to load (and later tensor-parallel shard) themselves.

Every parameter carries ``param.weight_loader(param, loaded, **kwargs)``; at tp_size=1 it is a checked
copy. Column-parallel layers split the output dim across tp ranks, row-parallel ones the input dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.checkpoint_slice import CheckpointSlice, materialize
from specserve.models.config import ParallelConfig


class WeightShapeError(ValueError):
    """A checkpoint tensor does not fit the parameter (slice) it is loaded into."""


def new_param(shape: tuple[int, ...], dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def copy_checked(dst: torch.Tensor, src: torch.Tensor | CheckpointSlice) -> None:
    """Copy (converting dtype and device) after checking the shape; a CheckpointSlice is read only now."""
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightShapeError(f"expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(materialize(src))


def all_reduce(x: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """Sum x over the tp ranks (in place; the default process group holds exactly the tp ranks).
    A no-op only for a benchmark shard running alone (ParallelConfig.collectives=False)."""
    if parallel.tp_size > 1 and parallel.collectives:
        torch.distributed.all_reduce(x)
    return x


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


def linear(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
    skinny: torch.Tensor | None = None,  # the model's skinny-GEMM counters (set_fused_layers); None: F.linear
    add: torch.Tensor | None = None,  # [T, out] added to the result (fused into the kernel's epilogue)
) -> torch.Tensor:  # [T, out]
    """x W^T (+ bias) (+ add): the skinny GEMM (kernels/skinny_gemm.py, one launch, row-count invariant) for a
    step's few rows when the fused layers gave the module their counters and it can take the call, else F.linear."""
    if skinny is not None:
        from specserve.kernels.skinny_gemm import can_run, skinny_linear

        if can_run(x, weight):
            return skinny_linear(x, weight, bias, add=add, counters=skinny)
    y = F.linear(x, weight, bias)
    return y if add is None else y + add


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    copy_checked(param.data, loaded)


@torch.no_grad()
def merge_linears(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum(out), in] weight (and bias) for linears that read the same input, so one GEMM computes all of them.

    Each linear's weight (and bias) becomes a view into the merged tensor: no memory is duplicated, and loading a
    checkpoint into a linear afterwards still lands in the merged weight. Biases: all or none."""
    with_bias = [m.bias is not None for m in linears]
    if any(with_bias) and not all(with_bias):
        raise WeightShapeError("merge_linears needs a bias on all of the linears or on none")
    weight = torch.cat([m.weight.data for m in linears])
    bias = torch.cat([m.bias.data for m in linears]) if all(with_bias) else None
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = weight[start : start + rows]
        if bias is not None:
            m.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = new_param((size,))
        self.weight.weight_loader = default_weight_loader
        self.eps = eps
        self.use_kernel = False  # CausalLM.set_fused_layers: one Triton launch (kernels/norm.py) on CUDA

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        if self.use_kernel and x.dim() in (2, 3):
            from specserve.kernels.norm import head_rms_norm, rms_norm

            return rms_norm(x, self.weight, self.eps) if x.dim() == 2 else head_rms_norm(x, self.weight, self.eps)
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
        self.skinny = None  # CausalLM.set_fused_layers: the counters of the skinny GEMM for a step's few rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.skinny)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across tp ranks (each rank yields its output slice).

    ``shards=(index, count)`` overrides the split: W is cut into `count` parts and this rank holds part
    `index` (GQA with fewer kv heads than ranks: several ranks hold the same kv head).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: ParallelConfig,
        bias: bool = False,
        shards: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.shard_index, self.num_shards = shards if shards is not None else (parallel.tp_rank, parallel.tp_size)
        local_out = divide(out_features, self.num_shards, "output features")
        self.weight = new_param((local_out, in_features))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = new_param((local_out,))
            self.bias.weight_loader = self.weight_loader
        self.skinny = None  # CausalLM.set_fused_layers: the counters of the skinny GEMM for a step's few rows

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        copy_checked(param.data, shard(loaded, 0, self.shard_index, self.num_shards))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.skinny)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across tp ranks; partial sums are all-reduced
    (``reduce_results=False``: the caller reduces, e.g. once for routed + shared experts)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: ParallelConfig,
        bias: bool = False,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.reduce_results = reduce_results
        if bias and not reduce_results and parallel.tp_size > 1:
            raise WeightShapeError("a row-parallel bias needs reduce_results=True (it is added once, after the sum)")
        local_in = divide(in_features, parallel.tp_size, "input features")
        self.weight = new_param((out_features, local_in))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = new_param((out_features,))
            self.bias.weight_loader = default_weight_loader
        self.skinny = None  # CausalLM.set_fused_layers: the counters of the skinny GEMM for a step's few rows

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: replicated, added once after the reduction
            copy_checked(param.data, loaded)
        else:
            copy_checked(param.data, shard(loaded, 1, self.parallel.tp_rank, self.parallel.tp_size))

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:  # add [T, out]: summed in
        """x [T, in_local] -> [T, out]; `add` (a partial sum of this rank's, e.g. the routed experts') is added before
        the all-reduce, in the GEMM's epilogue on the kernel path."""
        out = linear(x, self.weight, None, self.skinny, add)
        if self.reduce_results:
            all_reduce(out, self.parallel)
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

    def __init__(
        self, hidden: int, intermediate: int, parallel: ParallelConfig, bias: bool = False, reduce_results: bool = True
    ) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, parallel, bias)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, parallel, bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, parallel, bias, reduce_results)
        self.gate_up = None  # fuse(): one [2I, H] weight (and bias) for gate and up, so one GEMM computes both

    def fuse(self, enabled: bool) -> None:
        """gate and up in one GEMM over their weights merged in place (merge_linears), or two GEMMs."""
        self.gate_up = merge_linears([self.gate_proj, self.up_proj]) if enabled else None

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:  # x, add [T, H] -> [T, H]
        """down(silu(gate(x)) * up(x)) (+ add, before down's all-reduce: the routed experts' partial output)."""
        if self.gate_up is not None:
            weight, bias = self.gate_up  # [2I, H], [2I] or None
            if self.down_proj.skinny is not None:
                from specserve.kernels.skinny_gemm import can_run, skinny_linear

                if can_run(x, weight):  # SiLU * up in the gate/up GEMM's epilogue
                    act = skinny_linear(x, weight, bias, epilogue="silu_mul", counters=self.down_proj.skinny)
                    return self.down_proj(act, add)
            gu = F.linear(x, weight, bias)  # [T, 2I]
            inter = gu.shape[1] // 2
            return self.down_proj(F.silu(gu[:, :inter]) * gu[:, inter:], add)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x), add)


def vocab_range(vocab_size: int, parallel: ParallelConfig) -> tuple[int, int]:
    """[start, end) of the vocabulary rows this rank scores: ceil(V / tp) per rank, the last may be short."""
    part = -(-vocab_size // parallel.tp_size)
    start = min(vocab_size, parallel.tp_rank * part)
    return start, min(vocab_size, start + part)


def gather_vocab(local: torch.Tensor, vocab_size: int, parallel: ParallelConfig) -> torch.Tensor:
    """[N, ceil(V/tp)] logits of this rank's vocab rows (short rank zero-padded) -> [N, V] on every rank."""
    if parallel.tp_size == 1:
        return local
    if not parallel.collectives:  # benchmark shard alone: the other ranks' columns are zeros (same cat, no gather)
        return torch.cat([local] + [torch.zeros_like(local)] * (parallel.tp_size - 1), dim=-1)[:, :vocab_size]
    parts = [torch.empty_like(local) for _ in range(parallel.tp_size)]
    torch.distributed.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)[:, :vocab_size]


class ParallelLMHead(nn.Module):
    """Output projection [V, H] split by vocabulary rows; logits gathered to [N, V] on every rank.

    Each rank holds ceil(V / tp) rows (the last rank's tail is zero padding), so any V works.
    """

    def __init__(self, hidden: int, vocab_size: int, parallel: ParallelConfig) -> None:
        super().__init__()
        self.parallel, self.vocab_size = parallel, vocab_size
        self.start, self.end = vocab_range(vocab_size, parallel)
        self.weight = new_param((-(-vocab_size // parallel.tp_size), hidden))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.vocab_size:
            raise WeightShapeError(f"expected [{self.vocab_size}, hidden], got {tuple(loaded.shape)}")
        n = self.end - self.start
        param.data.zero_()
        copy_checked(param.data[:n], loaded.narrow(0, self.start, n))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        return gather_vocab(F.linear(hidden, self.weight).float(), self.vocab_size, self.parallel)
