"""Count the loaded target's real parameters by role, for the byte floors (specserve.bench.floors).

Roles come from module types, not from parameter-name guesses: the deepest typed ancestor of a
parameter decides (an RMSNorm inside an attention block is a norm; a GatedMLP inside an MoE block is
a shared expert; routed experts are the StackedExperts tensors, counted per expert).

A quantized checkpoint (config.quantization) counts what its format stores: routed experts held packed
count their words / e4m3 bytes and scale parameters; its other quantized Linears, which load dequantized,
count packed bytes plus scales as well (int4: bf16 group scales; fp8: float32 block scales, as DeepSeek-V3
ships them): the floor of the format, which the fp8 dense kernel reads (the model reads the dequantized copy
until that kernel is wired in).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specserve.bench.floors import DENSE_ROLES, FloorError, ModelBytes, fp8_linear_bytes, int4_linear_bytes


def _role_table():
    from specserve.models.attention import ATTENTION_CLASSES
    from specserve.models.layers import Embedding, GatedMLP, RMSNorm
    from specserve.models.moe import MoEBlock, StackedExperts, TopKRouter
    from specserve.models.quant_experts import Fp8StackedExperts, Int4StackedExperts

    # module type -> role; order does not matter (deepest match wins)
    table = {
        RMSNorm: "norm",
        Embedding: "embedding",
        GatedMLP: "dense_mlp",
        TopKRouter: "router",
        StackedExperts: "routed_experts",
        Int4StackedExperts: "routed_experts",
        Fp8StackedExperts: "routed_experts",
        MoEBlock: "other",
    }
    table.update({cls: "attention" for cls in ATTENTION_CLASSES.values()})
    return table, MoEBlock, GatedMLP, StackedExperts


def parameter_roles(model: nn.Module) -> dict[str, str]:
    """parameter name -> role (DENSE_ROLES, "embedding" or "routed_experts")."""
    table, moe_cls, mlp_cls, _ = _role_table()
    modules = dict(model.named_modules())
    lm_head = getattr(model, "lm_head", None)
    roles = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")[:-1]
        role, parent = "other", None
        for i in range(len(parts) + 1):
            module = modules[".".join(parts[:i])]
            if lm_head is not None and module is lm_head:
                role = "lm_head"
            for cls, r in table.items():
                if type(module) is cls:
                    role = "shared_experts" if cls is mlp_cls and isinstance(parent, moe_cls) else r
            parent = module
        roles[name] = role
    return roles


def param_bytes(name: str, p: torch.Tensor, quant=None) -> int:  # quant: models.quant.QuantConfig | None
    """Bytes a step reads of parameter `name`: as loaded, or as stored when its Linear is quantized."""
    from specserve.models.quant import Int4PackConfig

    plain = p.numel() * p.element_size()
    held_quantized = not p.is_floating_point() or p.element_size() == 1  # experts kept packed (int32 words / e4m3)
    if quant is None or p.dim() < 2 or held_quantized or not name.endswith((".weight", ".w13", ".w2")):
        return plain  # (the scales of experts kept packed are parameters of their own)
    count, prefix = 1, name.rsplit(".", 1)[0]
    if name.endswith(".w13"):  # stacked [E, 2I, H]: gate and up, each its own [I, H] Linear in the checkpoint
        count, module, shapes = p.shape[0], f"{prefix}.0.gate_proj", [(p.shape[1] // 2, p.shape[2])] * 2
    elif name.endswith(".w2"):  # stacked [E, H, I]
        count, module, shapes = p.shape[0], f"{prefix}.0.down_proj", [tuple(p.shape[1:])]
    else:
        module, shapes = prefix, [tuple(p.shape)]
    if not quant.quantizes(module):
        return plain
    if isinstance(quant, Int4PackConfig):
        return count * sum(int4_linear_bytes(o, i, quant.group_size) for o, i in shapes)
    return count * sum(fp8_linear_bytes(o, i, quant.block) for o, i in shapes)


def model_bytes(model: nn.Module, config, kv_dtype: torch.dtype | None = None) -> ModelBytes:
    """Bytes of the loaded CausalLM by role; ``config`` is its ModelConfig (kv entry shape, layers)."""
    _, _, _, experts_cls = _role_table()
    roles = parameter_roles(model)
    params = dict(model.named_parameters())
    dense = {r: 0 for r in DENSE_ROLES}
    embedding_bytes, embedding_rows, total = 0, 0, 0
    quant = getattr(config, "quantization", None)
    for name, p in params.items():
        nbytes = param_bytes(name, p, quant)
        total += nbytes
        role = roles[name]
        if role == "routed_experts":
            continue
        if role == "embedding":
            embedding_bytes += nbytes
            embedding_rows = p.shape[0]
            continue
        dense[role] += nbytes
    notes = []
    tied = getattr(model, "lm_head", None) is None
    if tied:
        # logits read the whole embedding matrix every step; the row gathers are inside that read
        dense["lm_head"] += embedding_bytes
        row_bytes = 0
        notes.append("tied embeddings: lm_head reads the embedding matrix; no separate row bytes")
    else:
        row_bytes = embedding_bytes // embedding_rows if embedding_rows else 0
    per_expert, moe_layers, num_experts = [], 0, 0
    for name, module in model.named_modules():
        if isinstance(module, experts_cls):
            local = len(module.local_experts())
            nbytes = sum(param_bytes(f"{name}.{n}", p, quant) for n, p in module.named_parameters(recurse=False))
            per_expert.append(nbytes / local)
            moe_layers += 1
            num_experts = max(num_experts, local)
    if per_expert and max(per_expert) != min(per_expert):
        notes.append("routed experts differ in size across layers; expert_bytes is their mean")
    expert = round(sum(per_expert) / len(per_expert)) if per_expert else 0
    if kv_dtype is None:
        kv_dtype = next(iter(params.values())).dtype
    kv_elem = torch.empty((), dtype=kv_dtype).element_size()
    entry_shape = model.kv_entry_shape() if hasattr(model, "kv_entry_shape") else config.kv_entry_shape
    if not entry_shape:
        raise FloorError("the model reports no KV cache entry shape")
    return ModelBytes(
        dense_bytes={r: b for r, b in dense.items() if b},
        embedding_row_bytes=row_bytes,
        expert_bytes=expert,
        num_moe_layers=moe_layers,
        num_experts=num_experts,
        kv_entry_bytes=math.prod(entry_shape) * kv_elem,
        num_layers=config.num_layers,
        param_bytes_total=total,
        notes=tuple(notes),
    )
