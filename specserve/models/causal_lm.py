"""The decoder-only causal LM shared by every supported architecture (features come from ModelConfig).

Module and parameter names follow the Hugging Face checkpoints (model.layers.N.self_attn.q_proj, ...),
except the routed experts, which are stacked (model.layers.N.mlp.experts.w13 / .w2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels.moe_reference import SlotRows
from specserve.models.attention import ATTENTION_CLASSES, kv_head_shards
from specserve.models.attn_metadata import AttentionBatch
from specserve.models.config import ModelConfig, ParallelConfig
from specserve.models.kv_cache import PagedKVCache
from specserve.models.layers import Embedding, GatedMLP, ParallelLMHead, RMSNorm, gather_vocab, vocab_range
from specserve.models.moe import ExpertsFn, MoEBlock, moe_reference
from specserve.models.quant_experts import packed_experts


class ModelInputError(ValueError):
    """forward() arguments that do not fit the model, the batch or the cache."""


@dataclass(frozen=True)
class ModelOutput:
    hidden: torch.Tensor  # [T, H] after the final norm
    # [T, len(capture_layers) * H]: output of decoder layer i (pre final norm), in the order given
    captured: torch.Tensor | None
    routed_experts: torch.Tensor | None  # [num_moe_layers, T, top_k] int64 expert ids; None for dense models


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, parallel: ParallelConfig, experts_fn: ExpertsFn) -> None:
        super().__init__()
        attn_cls = ATTENTION_CLASSES[type(config.attention)]
        self.self_attn = attn_cls(
            config.attention, config.rope, config.hidden_size, config.rms_norm_eps, layer, parallel
        )
        self.is_moe = layer in config.moe_layers
        if self.is_moe:
            experts = packed_experts(config, parallel)  # None: float experts (int4 ones load dequantized)
            self.mlp: nn.Module = MoEBlock(config.moe, config.hidden_size, parallel, experts_fn, experts)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, parallel, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        attn: AttentionBatch,
        kv_cache: PagedKVCache,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([T, H], topk_ids [T, K] or None)
        h = x + self.self_attn(self.input_layernorm(x), positions, attn, kv_cache)
        ids = None
        if self.is_moe:
            mlp_out, ids = self.mlp(self.post_attention_layernorm(h), attn.live_rows)
        else:
            mlp_out = self.mlp(self.post_attention_layernorm(h))
        return h + mlp_out, ids

    def forward_fused(
        self,
        x: torch.Tensor | SlotRows,  # [T, H] the previous layer's output before its residual add (embeddings at 0)
        residual: torch.Tensor | None,  # [T, H] the residual stream before that add; None at layer 0
        positions: torch.Tensor,  # [T]
        attn: AttentionBatch,
        kv_cache: PagedKVCache,
    ) -> tuple[torch.Tensor | SlotRows, torch.Tensor, torch.Tensor | None]:  # (mlp out, residual [T, H], topk_ids)
        """The same layer with each residual add fused into the RMSNorm after it (one kernel for both): returns the
        MLP output and the residual stream it is to be added to (by the next layer's fused norm, or the caller).
        A MoE's output may be its slots before their top-k sum (MoEBlock.set_slots_out): the next norm sums them."""
        from specserve.kernels.norm import fused_add_rms_norm

        norm = self.input_layernorm
        if residual is None:
            h, residual = norm(x), x
        else:
            h, residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        a = self.self_attn(h, positions, attn, kv_cache)
        post = self.post_attention_layernorm
        h, residual = fused_add_rms_norm(a, residual, post.weight, post.eps)
        if self.is_moe:
            mlp_out, ids = self.mlp(h, attn.live_rows)
            return mlp_out, residual, ids
        return self.mlp(h), residual, None


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelConfig, experts_fn: ExpertsFn) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, parallel, experts_fn) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelConfig | None = None,
        experts_fn: ExpertsFn = moe_reference,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel or ParallelConfig()
        self.model = DecoderModel(config, self.parallel, experts_fn)
        self.attn_backend = None  # None: plain-torch attention; else see set_attention_backend
        self.fused_layers = False  # set_fused_layers
        self.lm_head = (
            None if config.tie_word_embeddings else ParallelLMHead(config.hidden_size, config.vocab_size, self.parallel)
        )

    def kv_entry_shape(self) -> tuple[int, ...]:
        """This rank's cache entry: GQA kv heads split (or replicated) with the heads; the MLA latent
        is shared by all heads and kept whole on every rank."""
        shape = self.config.kv_entry_shape
        if len(shape) == 3:
            return (shape[0], shape[1] // kv_head_shards(shape[1], self.parallel)[1], shape[2])
        return shape

    def set_experts_fn(self, experts_fn: ExpertsFn) -> None:
        """Swap the routed-experts compute (e.g. a fused GPU kernel) in every MoE layer."""
        for layer in self.model.layers:
            if layer.is_moe:
                layer.mlp.experts_fn = experts_fn

    def set_invariant_rows(self, rows: int) -> None:
        """The row count the target's invariant steps pad to (0: off). Int4 routed experts then run their per-slot
        GEMV at every step of up to that many rows (its rows do not depend on T), so a padded step's pad rows cost
        no expert reads and a decode costs one token's experts (kernels/quant_moe.w4a16_moe)."""
        from specserve.kernels.quant_gemv import W4A16_GEMV_MAX_TOKENS
        from specserve.models.quant_experts import Int4StackedExperts

        for module in self.modules():
            if isinstance(module, Int4StackedExperts):
                module.gemv_max_tokens = max(W4A16_GEMV_MAX_TOKENS, rows)

    def set_fused_layers(
        self, enabled: bool, skinny_gemm: bool = False, moe_block: bool = True, fold_epilogues: bool = True
    ) -> None:
        """The decode graph's fused layers (Triton kernels, CUDA only), or the plain-torch code everywhere:

        - every RMSNorm one launch, each residual add fused into the norm after it (kernels/norm.py);
        - one GEMM for q / k / v (MLA: q_a or q, and kv_a) and one for an MLP's gate and up (dense layers, shared
          experts), their weights merged in place (layers.merge_linears);
        - QK-norm (MLA: the kv_a norm) + RoPE + the paged-cache write in one kernel (kernels/rope_cache.py), when
          the attention backend attends over a cache written beforehand (every paged backend does);
        - with moe_block (on by default), the router and its gate GEMM in one kernel for a step's rows
          (kernels/router.route_gate), the shared experts as always-routed experts of the routed experts' launches
          (MoEBlock.set_shared_as_routed); else the gate GEMM, then the router kernel, and the shared MLP apart;
        - with fold_epilogues (on by default, with moe_block), two small launches of the MoE folded into its
          neighbours: its align step into the router's launch and its top-k sum into the fused add + RMSNorm after
          it (MoEBlock.set_slots_out);
        - with skinny_gemm (off by default: cuBLAS measured faster, BENCHMARKS' tenth pass), a step's few rows through
          the skinny GEMM (kernels/skinny_gemm.py) in every projection but lm_head, SiLU * up in the gate/up GEMM's
          epilogue and the routed experts' sum in the shared experts' down GEMM's."""
        from specserve.kernels.router import new_gate_counters
        from specserve.kernels.skinny_gemm import new_counters
        from specserve.models.layers import (
            ColumnParallelLinear,
            GatedMLP,
            ReplicatedLinear,
            RMSNorm,
            RowParallelLinear,
        )
        from specserve.models.moe import TopKRouter

        self.fused_layers = enabled
        weight = self.model.embed_tokens.weight
        skinny = new_counters(weight.device) if enabled and skinny_gemm else None  # one set: GEMMs run one at a time
        gate_counters = new_gate_counters(weight.device) if enabled and moe_block else None  # routers run one at a time
        for module in self.modules():
            if isinstance(module, (RMSNorm, TopKRouter)):
                module.use_kernel = enabled
            if isinstance(module, TopKRouter):
                module.gate_counters = gate_counters
            if isinstance(module, (TopKRouter, ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)):
                module.skinny = skinny
            elif isinstance(module, GatedMLP):
                module.fuse(enabled)
        table = None
        if enabled:
            rotary = self.model.layers[0].self_attn.rotary
            table = rotary.table(self.config.max_position_embeddings, weight.dtype, weight.device)
        for layer in self.model.layers:
            layer.self_attn.fuse(table, skinny)
            if layer.is_moe:
                layer.mlp.set_shared_as_routed(enabled and moe_block)
                layer.mlp.set_slots_out(enabled and moe_block and fold_epilogues)

    def set_attention_backend(self, backend) -> None:
        """Route every attention layer through `backend` (models/attn_backend.py: FlashInferBackend or
        ReferencePagedBackend), or back to the plain-torch path with None. forward() prepares it once per step."""
        self.attn_backend = backend
        for layer in self.model.layers:
            layer.self_attn.attn_backend = backend

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        """Under tp every rank scores its vocabulary rows; the full logits are gathered on every rank. Ids at or past
        config.logits_vocab_limit get -inf (in place: graph-safe)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            start, end = vocab_range(self.config.vocab_size, self.parallel)
            local = F.linear(hidden, self.model.embed_tokens.weight[start:end]).float()
            part = -(-self.config.vocab_size // self.parallel.tp_size)
            if end - start < part:
                local = F.pad(local, (0, part - (end - start)))
            logits = gather_vocab(local, self.config.vocab_size, self.parallel)
        limit = self.config.logits_vocab_limit
        if limit is not None and limit < logits.shape[-1]:
            logits[:, limit:] = float("-inf")
        return logits

    @torch.no_grad()  # not inference_mode: captured features may feed draft-head training
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionBatch,
        kv_cache: PagedKVCache,
        capture_layers: tuple[int, ...] = (),
    ) -> ModelOutput:
        self._check_inputs(input_ids, positions, attn, kv_cache, capture_layers)
        if self.attn_backend is not None:
            self.attn_backend.prepare(attn)  # plan once per step (a no-op when the graph runner already did)
        x = self.embed(input_ids)
        captured: dict[int, torch.Tensor] = {}
        routed = []
        if self.fused_layers:
            hidden = self._layers_fused(x, positions, attn, kv_cache, capture_layers, captured, routed)
        else:
            for i, layer in enumerate(self.model.layers):
                x, ids = layer(x, positions, attn, kv_cache)
                if ids is not None:
                    routed.append(ids)
                if i in capture_layers:
                    captured[i] = x
            hidden = self.model.norm(x)
        experts = torch.stack(routed) if routed else None
        return ModelOutput(
            hidden=hidden,
            captured=torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None,
            routed_experts=experts if experts is None or experts.dtype == torch.int64 else experts.long(),
        )

    def _layers_fused(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        kv_cache: PagedKVCache,
        capture_layers: tuple[int, ...],
        captured: dict[int, torch.Tensor],
        routed: list[torch.Tensor],
    ) -> torch.Tensor:  # x [T, H] embeddings -> [T, H] final-normed
        from specserve.kernels.fused_moe import sum_slots_of
        from specserve.kernels.norm import fused_add_rms_norm

        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual, ids = layer.forward_fused(x, residual, positions, attn, kv_cache)
            if ids is not None:
                routed.append(ids)
            if i in capture_layers:
                captured[i] = (sum_slots_of(x) if isinstance(x, SlotRows) else x) + residual
        norm = self.model.norm
        return fused_add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def _check_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        kv_cache: PagedKVCache,
        capture_layers: tuple[int, ...],
    ) -> None:
        t = attn.num_rows
        if input_ids.shape != (t,) or positions.shape != (t,):
            raise ModelInputError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both be [{t}]"
            )
        if kv_cache.num_layers != self.config.num_layers or tuple(kv_cache.entry_shape) != self.kv_entry_shape():
            raise ModelInputError(
                f"cache has {kv_cache.num_layers} layers of entry {kv_cache.entry_shape}; model needs "
                f"{self.config.num_layers} of {self.kv_entry_shape()}"
            )
        bad = [i for i in capture_layers if not 0 <= i < self.config.num_layers]
        if bad:
            raise ModelInputError(f"capture_layers {bad} outside [0, {self.config.num_layers})")
        if input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # CUDA-graph capture: no device reads (the engine checks ids on the host)
        if t and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ModelInputError(f"token id outside [0, {self.config.vocab_size})")


def build_model(
    config: ModelConfig,
    parallel: ParallelConfig | None = None,
    experts_fn: ExpertsFn = moe_reference,
) -> CausalLM:
    """Uninitialised model (parameters from torch.empty): load weights before use."""
    return CausalLM(config, parallel or ParallelConfig(), experts_fn)
