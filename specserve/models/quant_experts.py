"""Routed experts kept as a quantized checkpoint stores them, computed by the quantized member of the chosen
experts family: the Triton kernel (kernels/quant_moe) when the fused MoE was chosen and the tensors are on
CUDA, else the torch reference, which dequantizes each touched expert and computes (CPU).

``Int4StackedExperts`` (compressed-tensors pack-quantized: Kimi-K2-Thinking, K2.5, K2.6), 4.25 bits a weight:
    w13 [E_local, 2 I_local, H / 8] int32, w13_scale [E_local, 2 I_local, H / G] bf16   gate rows then up rows
    w2  [E_local, H, I_local / 8] int32,   w2_scale  [E_local, H, I_local / G] bf16
``Fp8StackedExperts`` (FP8 blocks [bo, bi]: DeepSeek-V3/R1, Qwen3 FP8), 8 bits a weight:
    w13 [E_local, 2 I_local, H] e4m3, w13_scale [E_local, 2 I_local / bo, ceil(H / bi)] float32
    w2  [E_local, H, I_local] e4m3,   w2_scale  [E_local, ceil(H / bo), ceil(I_local / bi)] float32
Parameter names are StackedExperts' (checkpoint names resolve the same way; the scales are filled with their
weight). Tensor parallel slices each expert's I, expert parallel keeps whole experts; each rank copies only
its rows / groups / blocks as stored. A placement whose slice of I would cut a group (int4) or a block
(fp8; and gate / up must not share a row block) keeps float experts instead, loaded dequantized.
"""

from __future__ import annotations

import torch

from specserve.kernels.moe_reference import moe_reference
from specserve.kernels.quant_gemv import W4A16_GEMV_MAX_TOKENS
from specserve.kernels.quant_reference import fp8_moe_reference, w4a16_moe_reference
from specserve.models.config import ModelConfig, ParallelConfig
from specserve.models.layers import WeightShapeError, copy_checked, new_param
from specserve.models.moe import ExpertsFn, StackedExperts
from specserve.models.quant import Fp8BlockConfig, Int4PackConfig
from specserve.models.quant_sources import fp8_packed, int4_packed


def packed_experts(config: ModelConfig, parallel: ParallelConfig) -> StackedExperts | None:
    """Quantized experts for this placement, or None (float experts, loaded dequantized)."""
    quant, moe = config.quantization, config.moe
    if quant is None or moe is None or not quant.quantizes("model.layers.0.mlp.experts.0.gate_proj"):
        return None
    split = parallel.tp_size > 1 and not parallel.ep
    inter = moe.intermediate_size // parallel.tp_size if split else moe.intermediate_size
    if split and moe.intermediate_size % parallel.tp_size:
        return None
    if isinstance(quant, Int4PackConfig):
        if inter % quant.group_size or config.hidden_size % quant.group_size:
            return None
        return Int4StackedExperts(moe, config.hidden_size, parallel, quant)
    if isinstance(quant, Fp8BlockConfig):
        bo, bi = quant.block
        if inter % bo or (split and inter % bi):
            return None
        return Fp8StackedExperts(moe, config.hidden_size, parallel, quant)
    return None


class _QuantizedExperts(StackedExperts):
    """Shared loading: a gate / up / down tensor of one expert arrives as a lazy quantized view."""

    def __init__(self, cfg, hidden: int, parallel: ParallelConfig, quant) -> None:
        self.quant = quant
        super().__init__(cfg, hidden, parallel)

    def _register(self, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor) -> None:
        self.w13, self.w13_scale, self.w2, self.w2_scale = w13, s13, w2, s2
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.w13_scale.loaded_with = self.w2_scale.loaded_with = "its weight"  # no checkpoint tensor of its own

    def _stored(self, view) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _scale_rows(self, rows: slice) -> slice:
        """w13_scale rows of w13 rows `rows`."""
        raise NotImplementedError

    def weight_loader(self, param: torch.Tensor, loaded, expert: int | None = None, shard_id: str = "") -> None:
        """One expert's gate/up [I, H] or down [H, I]: this rank's slice, copied as stored."""
        if expert is None:
            raise WeightShapeError("quantized routed experts are stored one expert at a time, not fused")
        if expert not in self.local_experts():
            return
        local = expert - self.first_expert
        if shard_id == "down":
            weight, scale = self._stored(self._tp_slice(loaded, 1))
            copy_checked(self.w2.data[local], weight)
            copy_checked(self.w2_scale.data[local], scale)
            return
        if shard_id not in ("gate", "up"):
            raise WeightShapeError(f"unknown quantized expert shard {shard_id!r}")
        rows = slice(0, self.inter) if shard_id == "gate" else slice(self.inter, 2 * self.inter)
        weight, scale = self._stored(self._tp_slice(loaded, 0))
        copy_checked(self.w13.data[local, rows], weight)
        copy_checked(self.w13_scale.data[local, self._scale_rows(rows)], scale)

    def _fast(self, experts_fn: ExpertsFn, x: torch.Tensor) -> bool:
        """The quantized Triton kernels (CUDA, bf16 / fp16 activations); float32 runs the dequantizing reference."""
        return experts_fn is not moe_reference and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


class Int4StackedExperts(_QuantizedExperts):
    # per-slot GEMV up to this many tokens (CausalLM.set_invariant_rows raises it to the invariant steps' row count)
    gemv_max_tokens = W4A16_GEMV_MAX_TOKENS

    def _make_params(self, hidden: int) -> None:
        e, i, g = self.num_local, self.inter, self.quant.group_size
        if i % g or hidden % g:
            raise WeightShapeError(f"int4 experts need H ({hidden}) and I per rank ({i}) in whole groups of {g}")
        self._register(
            new_param((e, 2 * i, hidden // 8), torch.int32),
            new_param((e, 2 * i, hidden // g), torch.bfloat16),
            new_param((e, hidden, i // 8), torch.int32),
            new_param((e, hidden, i // g), torch.bfloat16),
        )

    def _stored(self, view) -> tuple[torch.Tensor, torch.Tensor]:
        return int4_packed(view)

    def _scale_rows(self, rows: slice) -> slice:
        return rows

    def run(self, experts_fn: ExpertsFn, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids / weights [T, K] (local) -> [T, H]."""
        args = (x, self.w13, self.w13_scale, self.w2, self.w2_scale, ids, weights, self.quant.group_size)
        if self._fast(experts_fn, x):
            from specserve.kernels.quant_moe import w4a16_moe

            return w4a16_moe(*args, gemv_max_tokens=self.gemv_max_tokens)
        return w4a16_moe_reference(*args)


class Fp8StackedExperts(_QuantizedExperts):
    def _make_params(self, hidden: int) -> None:
        e, i, (bo, bi) = self.num_local, self.inter, self.quant.block
        if i % bo:
            raise WeightShapeError(f"fp8 experts need I per rank ({i}) in whole row blocks of {bo}")
        fp8 = torch.float8_e4m3fn
        self._register(
            new_param((e, 2 * i, hidden), fp8),
            new_param((e, 2 * i // bo, -(-hidden // bi)), torch.float32),
            new_param((e, hidden, i), fp8),
            new_param((e, -(-hidden // bo), -(-i // bi)), torch.float32),
        )

    def _stored(self, view) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_packed(view)

    def _scale_rows(self, rows: slice) -> slice:
        bo = self.quant.block[0]
        return slice(rows.start // bo, rows.stop // bo)

    def run(self, experts_fn: ExpertsFn, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids / weights [T, K] (local) -> [T, H]."""
        args = (x, self.w13, self.w13_scale, self.w2, self.w2_scale, ids, weights, self.quant.block)
        if self._fast(experts_fn, x):
            from specserve.kernels.quant_moe import fp8_moe

            return fp8_moe(*args)
        return fp8_moe_reference(*args)
