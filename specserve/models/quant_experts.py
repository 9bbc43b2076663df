"""Routed experts kept as an int4 pack-quantized checkpoint stores them (Kimi-K2-Thinking, K2.5, K2.6).

``Int4StackedExperts`` holds, per local expert, the packed words and bf16 group scales (4.25 bits a weight
at group 32, instead of 16), and computes through the int4 member of the chosen experts family: the W4A16
Triton kernel (kernels/quant_moe.w4a16_moe) when the fused MoE was chosen and the tensors are on CUDA,
else the torch reference, which dequantizes each touched expert and computes (CPU).

Parameters (names shared with StackedExperts, so checkpoint names resolve the same way):
    w13 [E_local, 2 I_local, H / 8] int32, w13_scale [E_local, 2 I_local, H / G]   gate rows then up rows
    w2  [E_local, H, I_local / 8] int32,   w2_scale  [E_local, H, I_local / G]
Tensor parallel slices each expert's I (down's input columns: I_local must be a multiple of G); expert
parallel keeps whole experts. Each rank reads only its rows / groups of the packed words and scales.
"""

from __future__ import annotations

import torch

from specserve.kernels.moe_reference import moe_reference
from specserve.kernels.quant_reference import w4a16_moe_reference
from specserve.models.config import ModelConfig, ParallelConfig
from specserve.models.layers import WeightShapeError, copy_checked, new_param
from specserve.models.moe import ExpertsFn, StackedExperts
from specserve.models.quant import Int4PackConfig
from specserve.models.quant_sources import int4_packed

SCALE_DTYPE = torch.bfloat16


def packed_experts(config: ModelConfig, parallel: ParallelConfig) -> StackedExperts | None:
    """Int4StackedExperts for an int4 checkpoint whose routed experts split into whole groups on this
    placement; None (float experts, loaded dequantized) otherwise."""
    quant, moe = config.quantization, config.moe
    if not isinstance(quant, Int4PackConfig) or moe is None:
        return None
    inter = moe.intermediate_size if parallel.ep else moe.intermediate_size // max(1, parallel.tp_size)
    if inter % quant.group_size or config.hidden_size % quant.group_size or not quant.quantizes(
        "model.layers.0.mlp.experts.0.gate_proj"
    ):
        return None
    return Int4StackedExperts(moe, config.hidden_size, parallel, quant.group_size)


class Int4StackedExperts(StackedExperts):
    def __init__(self, cfg, hidden: int, parallel: ParallelConfig, group_size: int) -> None:
        self.group_size = group_size
        super().__init__(cfg, hidden, parallel)

    def _make_params(self, hidden: int) -> None:
        e, i, g = self.num_local, self.inter, self.group_size
        if i % g or hidden % g:
            raise WeightShapeError(f"int4 experts need H ({hidden}) and I per rank ({i}) in whole groups of {g}")
        self.w13 = new_param((e, 2 * i, hidden // 8), torch.int32)
        self.w13_scale = new_param((e, 2 * i, hidden // g), SCALE_DTYPE)
        self.w2 = new_param((e, hidden, i // 8), torch.int32)
        self.w2_scale = new_param((e, hidden, i // g), SCALE_DTYPE)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.w13_scale.loaded_with = self.w2_scale.loaded_with = "its packed weight"  # the loader needs no own tensor

    def weight_loader(self, param: torch.Tensor, loaded, expert: int | None = None, shard_id: str = "") -> None:
        """One expert's gate/up [I, H] or down [H, I] as a lazy int4 tensor: its packed words and scales
        (this rank's I-slice) are copied as stored."""
        if expert is None:
            raise WeightShapeError("int4 routed experts are stored one expert at a time, not fused")
        if expert not in self.local_experts():
            return
        local = expert - self.first_expert
        if shard_id == "down":
            words, scale = int4_packed(self._tp_slice(loaded, 1))
            copy_checked(self.w2.data[local], words)
            copy_checked(self.w2_scale.data[local], scale)
            return
        if shard_id not in ("gate", "up"):
            raise WeightShapeError(f"unknown int4 expert shard {shard_id!r}")
        rows = slice(0, self.inter) if shard_id == "gate" else slice(self.inter, 2 * self.inter)
        words, scale = int4_packed(self._tp_slice(loaded, 0))
        copy_checked(self.w13.data[local, rows], words)
        copy_checked(self.w13_scale.data[local, rows], scale)

    def run(self, experts_fn: ExpertsFn, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids / weights [T, K] (local) -> [T, H]."""
        args = (x, self.w13, self.w13_scale, self.w2, self.w2_scale, ids, weights, self.group_size)
        if experts_fn is not moe_reference and x.is_cuda:
            from specserve.kernels.quant_moe import w4a16_moe

            return w4a16_moe(*args)
        return w4a16_moe_reference(*args)
