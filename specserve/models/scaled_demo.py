"""The shipped demo at real size: a model with a published MoE's shape, bytes and kernels and the demo's outputs.

`demo@NAME[:LAYERS]` names a model made at load time from the demo checkpoint (demo_model/target: a 5-layer
DeepSeek-V3-architecture MoE, hidden 256) inside the width of a published model (NAME in SHAPES). Every wide
weight is a real tensor that the step reads; the demo's function is embedded so that the logits equal the
demo's (float32: to rounding), and the shipped drafters keep their acceptance:

- **Widths.** Each demo matrix sits in the top-left corner of its wide one, the rest zero. Each RMSNorm over the
  residual stream sees the demo's rows plus zeros; its weight is scaled by sqrt(H_demo / H_wide) and a constant
  channel (below) tops up the mean square so that the demo's eps is matched exactly. Latent norms (q_a, kv_a)
  are scaled the same way (their eps is the model's fixed 1e-6, so they match to eps / rank).
- **Attention.** The demo's heads are the first heads; their nope / v dims the first dims of each wide head.
  Rope pair i of the demo is wide pair rho * i (rho = rope_wide / rope_demo), with the demo's theta, so both see
  the same frequency; q is scaled by sqrt(qk_wide / qk_demo) for the wider softmax scale. The wide model keeps
  a q_lora path (the demo's q is low-rank with a norm between, which no single q matrix reproduces).
- **Layers.** The demo's layer 0 (dense) is layer 0; its MoE layers are spread evenly over the rest
  (`demo_positions`). Every other layer is a full random layer whose attention output projection and MLP
  down projections (routed and shared) are zero: it costs a real layer's bytes and kernels, attends and routes
  over its random weights (its experts are touched as a real model's are), and adds nothing to the residual.
- **Routing.** The wide router has twice the demo's expert groups and chooses one group more. The demo's expert
  group g is wide group g's first experts; one extra group holds the top_k - demo top_k *null* experts (zero
  down projection, bias +2B: always chosen; router row reads only the constant channel, so their sigmoid score
  is 0 and the demo's renormalised weights are unchanged); every other expert has bias -B and is never chosen
  on a demo layer. The down projections carry demo rsf / wide rsf.
- **Constant channel.** Residual dim H_demo holds kappa in every embedding row; no layer writes it. It is what
  the null experts' router rows read, and kappa^2 + eps_wide * H_wide = eps_demo * H_demo makes every residual
  norm the demo's.
- **Vocabulary.** The demo's ids are the first ids; logits past them are -inf (ModelConfig.logits_vocab_limit).
- **INT4 experts** (a published shape with int4 routed experts, Kimi-K2.6): the demo's experts are quantized
  to int4 at the shape's group size (`quantize_int4`); the wide model then computes the int4-quantized demo
  (`quantized_demo` is that reference). Zero blocks are zero scales.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.models.causal_lm import CausalLM, build_model
from specserve.models.config import ModelConfig, ParallelConfig
from specserve.models.errors import ModelConfigError
from specserve.models.presets import init_random_, random_fill_, random_generator
from specserve.models.quant import Int4PackConfig
from specserve.models.scaled_embed import Embedder
from specserve.models.scaled_shapes import scaled_config


def load_demo(
    path: str | Path, device: str | torch.device, dtype: torch.dtype = torch.float32
) -> tuple[CausalLM, ModelConfig]:
    from specserve.models.loader import load_model

    return load_model(path, device=device, dtype=dtype, progress=False)


@torch.no_grad()
def build_scaled_demo(
    spec: str,
    demo_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    parallel: ParallelConfig | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """The wide model of `spec` on `device`: random weights everywhere, then the demo embedded (module docstring).

    With `parallel` (tp_size > 1, routed experts expert-parallel: the step benchmark's one-rank shard), only that
    rank's shard is built: each of its tensors is its slice of the unsharded model's (the same random stream, the same
    embedding), made one full-width layer at a time so that the whole wide model is never in memory."""
    demo, demo_config = load_demo(demo_path, device)
    config = scaled_config(spec, demo_config)
    model = _allocate(config, parallel, device, dtype)
    embedder = Embedder(demo, demo_config, model, config)
    if parallel is None or parallel.tp_size == 1:
        init_random_(model, seed)
        embedder.run()
    else:
        _build_shard(model, embedder, config, parallel, device, dtype, seed)
    return model.eval(), config


def _allocate(config: ModelConfig, parallel: ParallelConfig | None, device, dtype: torch.dtype) -> CausalLM:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return build_model(config, parallel)
    finally:
        torch.set_default_dtype(old)


def _build_shard(
    shard: CausalLM,
    embedder: Embedder,
    config: ModelConfig,
    parallel: ParallelConfig,
    device,
    dtype: torch.dtype,
    seed: int,
) -> None:
    """Fill `shard` with its slices of the unsharded wide model: the random stream drawn in the unsharded model's
    parameter order (embedding, each layer, final norm, lm_head), one full layer at a time."""
    from specserve.models.causal_lm import DecoderLayer

    if not parallel.ep:
        raise ModelConfigError("a demo@ shard splits the routed experts whole (expert parallel): set ep")
    gen = random_generator(torch.device(device), seed)
    int4 = isinstance(config.quantization, Int4PackConfig)
    w = shard.model
    random_fill_(w.embed_tokens.weight, "model.embed_tokens.weight", gen, int4=int4)  # replicated: whole
    full_parallel = ParallelConfig()
    for i, layer in enumerate(w.layers):
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                full = DecoderLayer(config, i, full_parallel, layer.mlp.experts_fn if layer.is_moe else None)
        finally:
            torch.set_default_dtype(old)
        for name, p in full.named_parameters():
            random_fill_(p, f"model.layers.{i}.{name}", gen, int4=int4)
        embedder.layer(i, full)
        _copy_slices(layer, full, parallel)
        del full
    random_fill_(w.norm.weight, "model.norm.weight", gen, int4=int4)
    head = torch.empty(config.vocab_size, config.hidden_size, device=device, dtype=shard.lm_head.weight.dtype)
    random_fill_(head, "lm_head.weight", gen, int4=int4)
    embedder.ends(w.embed_tokens.weight, head, w.norm.weight)
    shard.lm_head.weight.data.copy_(shard_slice(head, tuple(shard.lm_head.weight.shape), parallel))


def shard_slice(full: torch.Tensor, shape: tuple[int, ...], parallel: ParallelConfig) -> torch.Tensor:
    """This rank's slice of an unsharded tensor, given the shard's shape: the one dim that differs cut into equal
    consecutive parts, rank r taking part r (heads, TP rows / columns, whole experts, vocabulary rows; a short last
    part zero-padded); a tensor of the same shape is replicated."""
    dims = [d for d in range(full.dim()) if full.shape[d] != shape[d]]
    if not dims:
        return full
    if len(dims) > 1 or full.dim() != len(shape):
        raise ModelConfigError(f"a shard of shape {shape} is not one slice of {tuple(full.shape)}")
    d = dims[0]
    start = parallel.tp_rank * shape[d]
    piece = full.narrow(d, min(start, full.shape[d]), max(0, min(shape[d], full.shape[d] - start)))
    if piece.shape[d] == shape[d]:
        return piece
    out = torch.zeros(shape, dtype=full.dtype, device=full.device)
    out.narrow(d, 0, piece.shape[d]).copy_(piece)
    return out


def _copy_slices(shard_module: torch.nn.Module, full_module: torch.nn.Module, parallel: ParallelConfig) -> None:
    full = dict(full_module.named_parameters())
    for name, p in shard_module.named_parameters():
        p.data.copy_(shard_slice(full[name].data, tuple(p.shape), parallel))
