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

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from specserve.kernels.quant_reference import dequant_int4, pack_int4
from specserve.models.causal_lm import CausalLM, build_model
from specserve.models.config import MLAConfig, ModelConfig, ParallelConfig, RopeConfig
from specserve.models.errors import ModelConfigError
from specserve.models.presets import PRESETS, init_random_, random_fill_, random_generator, split_named_spec
from specserve.models.quant import Int4PackConfig

SCALED_PREFIX = "demo@"
CHOICE_BIAS = 1.0e4  # B: the choice bias that keeps an expert out (-B) or in (+2B) on a demo layer
NULL_LOGIT = 1.0e4  # a null expert's router weight on the constant channel (negated): sigmoid(-NULL_LOGIT * h) = 0


@dataclass(frozen=True)
class ScaledShape:
    """A published model the demo is embedded in, and where the embedding departs from it."""

    published: str  # its synthetic preset (models/presets.py): the config parameter counts and bytes compare with
    default_layers: int  # layers when the spec gives none (what fits one H200)
    q_lora_rank: int | None = None  # the q path's rank where the published model has none (same bytes as its q_proj)


SHAPES: Mapping[str, ScaledShape] = MappingProxyType(
    {
        # q_proj 2048 x 3072 = 6.29 M weights; q_a + q_b at rank 1216: 2048 * 1216 + 1216 * 3072 = 6.23 M.
        "moonlight-16b-a3b": ScaledShape("moonlight-16b-a3b", 27, q_lora_rank=1216),
        # 12 of 61 layers: 9.3 GB a layer with int4 experts; 12 layers + embeddings + lm_head fill ~117 GB.
        "kimi-k2.6": ScaledShape("kimi-k2.6", 12),
        "small-moonlight": ScaledShape("small-moonlight", 7, q_lora_rank=256),
        "small-kimi-k2.6": ScaledShape("small-kimi-k2.6", 6),
    }
)


def is_scaled_demo(model: object) -> bool:
    """True for a model name of the form 'demo@NAME[:LAYERS]'."""
    return str(model).startswith(SCALED_PREFIX)


def parse_scaled_spec(spec: str) -> tuple[str, int | None]:
    """'demo@NAME' or 'demo@NAME:LAYERS' -> (NAME, LAYERS or None)."""
    return split_named_spec(spec, SCALED_PREFIX, SHAPES, "demo size")


def demo_positions(num_layers: int, demo_layers: int) -> tuple[int, ...]:
    """Wide layer of each demo layer: 0 -> 0, the others spread evenly over 1..num_layers - 1 (the last one last)."""
    if num_layers < demo_layers:
        raise ModelConfigError(
            f"the demo has {demo_layers} layers; the wide model needs at least as many, got {num_layers}"
        )
    if demo_layers <= 2:
        return tuple(range(demo_layers))[:1] + tuple(num_layers - 1 for _ in range(demo_layers - 1))
    span = num_layers - 2
    return (0,) + tuple(1 + round(i * span / (demo_layers - 2)) for i in range(demo_layers - 1))


def constant_channel(demo: ModelConfig, wide_hidden: int) -> tuple[float, float]:
    """(kappa, the wide eps): kappa a power of two (exact in bf16) with kappa^2 + eps * H_wide = eps_d * H_demo."""
    budget = demo.rms_norm_eps * demo.hidden_size
    kappa = 2.0 ** math.floor(math.log2(math.sqrt(budget / 2)))
    return kappa, (budget - kappa * kappa) / wide_hidden


def scaled_config(spec: str, demo: ModelConfig) -> ModelConfig:
    """The wide model's config for `spec`, given the demo's."""
    name, layers = parse_scaled_spec(spec)
    shape = SHAPES[name]
    pub = PRESETS[shape.published]
    n = layers or shape.default_layers
    _check_fits(demo, pub, shape, n)
    dm, pm = demo.moe, pub.moe
    nulls = pm.top_k - dm.top_k
    moe = dataclasses.replace(
        pm, layers=tuple(range(pm.layers[0], n)), n_group=2 * dm.n_group, topk_group=dm.topk_group + (1 if nulls else 0)
    )
    attention = dataclasses.replace(
        pub.attention,
        q_lora_rank=shape.q_lora_rank or pub.attention.q_lora_rank,
        rope_interleave=demo.attention.rope_interleave,
    )
    rope = RopeConfig(rope_type="default", theta=demo.rope.theta, dim=pub.attention.qk_rope_head_dim)
    return dataclasses.replace(
        pub,
        model_type=demo.model_type,
        num_layers=n,
        moe=moe,
        attention=attention,
        rope=rope,
        rms_norm_eps=constant_channel(demo, pub.hidden_size)[1],
        bos_token_id=demo.bos_token_id,
        eos_token_ids=demo.eos_token_ids,
        logits_vocab_limit=demo.vocab_size,
        tie_word_embeddings=False,
    )


def _check_fits(demo: ModelConfig, pub: ModelConfig, shape: ScaledShape, n: int) -> None:
    d, w, dm, pm = demo.attention, pub.attention, demo.moe, pub.moe
    if not (isinstance(d, MLAConfig) and isinstance(w, MLAConfig) and dm is not None and pm is not None):
        raise ModelConfigError("the demo at real size embeds an MLA + MoE model in an MLA + MoE shape")
    if d.q_lora_rank is None or (shape.q_lora_rank or w.q_lora_rank) is None:
        raise ModelConfigError("the demo's q path is low-rank: the wide shape needs a q_lora rank")
    if demo.rope.rope_type != "default" or demo.tie_word_embeddings:
        raise ModelConfigError("the demo at real size needs default rope and untied embeddings")
    if dm.scoring != "sigmoid" or not dm.correction_bias or not dm.norm_topk_prob:
        raise ModelConfigError("the demo at real size needs sigmoid routing with a correction bias, renormalised")
    if dm.layers != tuple(range(1, demo.num_layers)) or pm.layers[0] != 1:
        raise ModelConfigError("the demo at real size needs layer 0 dense and every later layer MoE, in both")
    pairs = [
        ("hidden", demo.hidden_size + 1, pub.hidden_size),
        ("vocab", demo.vocab_size, pub.vocab_size),
        ("dense intermediate", demo.intermediate_size, pub.intermediate_size),
        ("heads", d.num_heads, w.num_heads),
        ("q_lora", d.q_lora_rank, shape.q_lora_rank or w.q_lora_rank),
        ("kv_lora", d.kv_lora_rank, w.kv_lora_rank),
        ("nope", d.qk_nope_head_dim, w.qk_nope_head_dim),
        ("rope", d.qk_rope_head_dim, w.qk_rope_head_dim),
        ("v", d.v_head_dim, w.v_head_dim),
        ("expert intermediate", dm.intermediate_size, pm.intermediate_size),
        ("shared intermediate", dm.intermediate_size * dm.n_shared_experts, pm.intermediate_size * pm.n_shared_experts),
        ("top_k", dm.top_k, pm.top_k),
    ]
    small = [f"{what} {a} > {b}" for what, a, b in pairs if a > b]
    if small:
        raise ModelConfigError(f"the demo does not fit {shape.published}: {', '.join(small)}")
    if w.qk_rope_head_dim % d.qk_rope_head_dim:
        raise ModelConfigError(f"rope dims {d.qk_rope_head_dim} -> {w.qk_rope_head_dim}: not a whole multiple")
    groups = 2 * dm.n_group
    per_group = pm.num_experts // groups if pm.num_experts % groups == 0 else 0
    if per_group < max(dm.num_experts // dm.n_group, pm.top_k - dm.top_k):
        raise ModelConfigError(
            f"{pm.num_experts} experts do not split into {groups} groups that hold the demo's "
            f"groups and {pm.top_k - dm.top_k} null experts"
        )
    quant = pub.quantization
    if quant is not None and not isinstance(quant, Int4PackConfig):
        raise ModelConfigError(f"the demo at real size quantizes experts to int4 only, not {quant.method}")
    if isinstance(quant, Int4PackConfig) and (
        demo.hidden_size % quant.group_size or dm.intermediate_size % quant.group_size
    ):
        raise ModelConfigError(f"the demo's expert dims are not whole int4 groups of {quant.group_size}")
    demo_positions(n, demo.num_layers)


# ---------------------------------------------------------------- int4


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] (C a multiple of group_size) -> (packed [R, C / 8] int32, scale [R, C / group_size] bf16): symmetric
    groups, scale = max |w| / 7 rounded to bf16, q = round(w / scale) in [-8, 7]; an all-zero group has scale 0."""
    rows, cols = w.shape
    groups = w.float().view(rows, cols // group_size, group_size)
    scale = (groups.abs().amax(-1) / 7.0).to(torch.bfloat16)  # [R, C / G]
    s = scale.float()[..., None]
    q = torch.where(s > 0, (groups / torch.where(s > 0, s, 1.0)).round(), 0.0).clamp(-8, 7).to(torch.int8)
    return pack_int4(q.view(rows, cols)), scale


def int4_roundtrip(w: torch.Tensor, group_size: int) -> torch.Tensor:  # [R, C] -> [R, C] float32
    """What the int4 experts compute with: w quantized (quantize_int4) and dequantized."""
    packed, scale = quantize_int4(w, group_size)
    return dequant_int4(packed, scale, group_size, w.shape[1])


@torch.no_grad()
def quantized_demo(demo: CausalLM, wide: ModelConfig) -> CausalLM:
    """The demo itself with its routed experts replaced, in place, by the int4 round trip the wide int4 model holds:
    gate / up as they are, down quantized as the wide model stores it (times demo rsf / wide rsf) and divided back.
    This is the reference a wide int4 model reproduces."""
    for layer in demo.model.layers:
        quantize_layer_experts_(layer, demo.config, wide)
    return demo


@torch.no_grad()
def quantize_layer_experts_(layer, demo: ModelConfig, wide: ModelConfig) -> None:
    """One demo decoder layer's routed experts replaced, in place, by the int4 round trip (`quantized_demo`); a dense
    layer is left as it is."""
    if not layer.is_moe:
        return
    group = wide.quantization.group_size
    down = demo.moe.routed_scaling_factor / wide.moe.routed_scaling_factor
    ex = layer.mlp.experts
    for e in range(ex.w13.shape[0]):
        ex.w13.data[e] = int4_roundtrip(ex.w13.data[e], group).to(ex.w13.dtype)
        ex.w2.data[e] = (int4_roundtrip(ex.w2.data[e].float() * down, group) / down).to(ex.w2.dtype)


# ---------------------------------------------------------------- building


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
    embedder = _Embedder(demo, demo_config, model, config)
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
    embedder: _Embedder,
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


@torch.no_grad()
def embed_decoder_layer(wide_layer, demo_layer, demo: ModelConfig, wide: ModelConfig, channel: float) -> None:
    """One demo decoder layer written into a wide one of `wide`'s shape (module docstring: norms, attention, MoE routing
    with the null-expert group), for a residual stream whose dim H_demo holds `channel` (or any positive value that
    scales with it: the null experts' routers read channel dim / channel after the post-attention norm)."""
    _Embedder(None, demo, None, wide, channel)._layer(wide_layer, demo_layer)


class _Embedder:
    """Writes the demo's weights into the wide model (module docstring); one method per part."""

    def __init__(
        self,
        demo: CausalLM | None,
        dc: ModelConfig,
        wide: CausalLM | None,
        wc: ModelConfig,
        channel: float | None = None,
    ) -> None:
        self.demo, self.dc, self.wide, self.wc = demo, dc, wide, wc
        self.hd, self.hw = dc.hidden_size, wc.hidden_size
        self.kappa = constant_channel(dc, wc.hidden_size)[0] if channel is None else channel
        self.norm_scale = math.sqrt(self.hd / self.hw)

    def run(self) -> None:
        w = self.wide.model
        self.ends(w.embed_tokens.weight, self.wide.lm_head.weight, w.norm.weight)
        for i, layer in enumerate(w.layers):
            self.layer(i, layer)

    def ends(self, embed: torch.Tensor, head: torch.Tensor, norm: torch.Tensor) -> None:
        """The embedding table, the lm head and the final norm (all at full width)."""
        d, hd, vd = self.demo.model, self.hd, self.dc.vocab_size
        emb = embed.data
        emb[:vd].zero_()
        emb[:vd, :hd] = d.embed_tokens.weight.to(emb.dtype)
        emb[:, hd] = self.kappa  # the constant channel (rows past the demo's are never embedded: their logits are -inf)
        head = head.data
        head[:vd].zero_()
        head[:vd, :hd] = self.demo.lm_head.weight.to(head.dtype)
        self._residual_norm(norm, d.norm.weight, channel=0.0)

    def layer(self, i: int, layer) -> None:
        """Wide layer i (full width): a demo layer where demo_positions puts one, else a silent random layer."""
        positions = demo_positions(self.wc.num_layers, self.dc.num_layers)
        if i in positions:
            self._layer(layer, self.demo.model.layers[positions.index(i)])
        else:
            self._silence(layer)

    # -- pieces

    def _residual_norm(self, wide: torch.Tensor, demo: torch.Tensor, channel: float) -> None:
        wide.data.fill_(1.0)
        wide.data[: self.hd] = (demo.float() * self.norm_scale).to(wide.dtype)
        wide.data[self.hd] = channel

    @staticmethod
    def _latent_norm(wide: torch.Tensor, demo: torch.Tensor) -> None:
        wide.data.fill_(1.0)
        n = demo.shape[0]
        wide.data[:n] = (demo.float() * math.sqrt(n / wide.shape[0])).to(wide.dtype)

    @staticmethod
    def _corner(wide: torch.Tensor, demo: torch.Tensor, scale: float = 1.0) -> None:
        wide.data.zero_()
        wide.data[: demo.shape[0], : demo.shape[1]] = (demo.float() * scale).to(wide.dtype)

    @staticmethod
    def _rows(wide: torch.Tensor, demo: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> None:
        """wide[dst, :C] = demo[src] * scale, everything else zero."""
        wide.data.zero_()
        wide.data[dst.to(wide.device), : demo.shape[1]] = (demo[src.to(demo.device)].float() * scale).to(wide.dtype)

    def _silence(self, layer) -> None:
        """A random layer that adds nothing: zero attention output and zero down projections."""
        layer.self_attn.o_proj.weight.data.zero_()
        mlp = layer.mlp
        if layer.is_moe:
            ex = mlp.experts
            (ex.w2_scale if hasattr(ex, "w2_scale") else ex.w2).data.zero_()
            if mlp.shared_experts is not None:
                mlp.shared_experts.down_proj.weight.data.zero_()
        else:
            mlp.down_proj.weight.data.zero_()

    def _layer(self, wl, dl) -> None:
        self._residual_norm(wl.input_layernorm.weight, dl.input_layernorm.weight, channel=0.0)
        # the null experts' routers read the channel after this norm: h = (1 / kappa) * kappa / rms = 1 / rms
        self._residual_norm(
            wl.post_attention_layernorm.weight, dl.post_attention_layernorm.weight, channel=1.0 / self.kappa
        )
        self._attention(wl.self_attn, dl.self_attn)
        if wl.is_moe:
            self._moe(wl.mlp, dl.mlp)
        else:
            self._mlp(wl.mlp, dl.mlp)

    def _attention(self, wa, da) -> None:
        d, w = self.dc.attention, self.wc.attention
        qk_d, qk_w = d.qk_head_dim, w.qk_head_dim
        rho = w.qk_rope_head_dim // d.qk_rope_head_dim
        # rope dims: demo pair i (dims 2i, 2i+1) -> wide pair rho * i
        pair = torch.arange(d.qk_rope_head_dim // 2)
        rope_dst = torch.stack([2 * rho * pair, 2 * rho * pair + 1], dim=1).flatten()
        rope_src = torch.arange(d.qk_rope_head_dim)
        heads = torch.arange(d.num_heads)[:, None]
        nope = torch.arange(d.qk_nope_head_dim)  # a head's nope dims are its first dims, at both widths
        q_src = torch.cat([(heads * qk_d + nope).flatten(), (heads * qk_d + d.qk_nope_head_dim + rope_src).flatten()])
        q_dst = torch.cat([(heads * qk_w + nope).flatten(), (heads * qk_w + w.qk_nope_head_dim + rope_dst).flatten()])
        q_scale = math.sqrt(qk_w / qk_d)  # the softmax scale is qk^-0.5
        self._corner(wa.q_a_proj.weight, da.q_a_proj.weight)
        self._latent_norm(wa.q_a_layernorm.weight, da.q_a_layernorm.weight)
        self._rows(wa.q_b_proj.weight, da.q_b_proj.weight, q_dst, q_src, q_scale)
        kv_src = torch.cat([torch.arange(d.kv_lora_rank), d.kv_lora_rank + rope_src])
        kv_dst = torch.cat([torch.arange(d.kv_lora_rank), w.kv_lora_rank + rope_dst])
        self._rows(wa.kv_a_proj_with_mqa.weight, da.kv_a_proj_with_mqa.weight, kv_dst, kv_src)
        self._latent_norm(wa.kv_a_layernorm.weight, da.kv_a_layernorm.weight)
        span_d, span_w = d.qk_nope_head_dim + d.v_head_dim, w.qk_nope_head_dim + w.v_head_dim
        v_d = torch.arange(d.v_head_dim)
        b_src = torch.cat([(heads * span_d + nope).flatten(), (heads * span_d + d.qk_nope_head_dim + v_d).flatten()])
        b_dst = torch.cat([(heads * span_w + nope).flatten(), (heads * span_w + w.qk_nope_head_dim + v_d).flatten()])
        self._rows(wa.kv_b_proj.weight, da.kv_b_proj.weight, b_dst, b_src)
        o_src = (heads * d.v_head_dim + v_d).flatten()
        o_dst = (heads * w.v_head_dim + v_d).flatten()
        o = wa.o_proj.weight.data
        o.zero_()
        o[: self.hd, o_dst.to(o.device)] = da.o_proj.weight[:, o_src.to(da.o_proj.weight.device)].to(o.dtype)

    def _mlp(self, wm, dm, scale: float = 1.0) -> None:
        """A gated MLP (dense, or shared experts) in the corner of its wide one."""
        self._corner(wm.gate_proj.weight, dm.gate_proj.weight)
        self._corner(wm.up_proj.weight, dm.up_proj.weight)
        self._corner(wm.down_proj.weight, dm.down_proj.weight, scale)

    def _moe(self, wm, dm) -> None:
        dcfg, wcfg = self.dc.moe, self.wc.moe
        per_d = dcfg.num_experts // dcfg.n_group
        per_w = wcfg.num_experts // wcfg.n_group
        demo_ids = torch.tensor([(e // per_d) * per_w + e % per_d for e in range(dcfg.num_experts)])
        null_ids = torch.arange(wcfg.top_k - dcfg.top_k) + dcfg.n_group * per_w
        router, bias = wm.gate.weight.data, wm.gate.e_score_correction_bias.data
        router[demo_ids.to(router.device)] = 0.0
        router[demo_ids.to(router.device), : self.hd] = dm.gate.weight.to(router.dtype)
        router[null_ids.to(router.device)] = 0.0
        router[null_ids.to(router.device), self.hd] = -NULL_LOGIT
        bias.fill_(-CHOICE_BIAS)
        bias[demo_ids.to(bias.device)] = dm.gate.e_score_correction_bias.to(bias.dtype)
        bias[null_ids.to(bias.device)] = 2 * CHOICE_BIAS
        down = dcfg.routed_scaling_factor / wcfg.routed_scaling_factor
        ex, dx = wm.experts, dm.experts
        quant = self.wc.quantization
        for e_d, e_w in enumerate(demo_ids.tolist()):
            gate, up = dx.w13[e_d, : dcfg.intermediate_size], dx.w13[e_d, dcfg.intermediate_size :]
            if isinstance(quant, Int4PackConfig):
                self._int4_expert(ex, e_w, gate, up, dx.w2[e_d].float() * down, quant.group_size)
            else:
                inter = ex.w13.shape[1] // 2
                ex.w13.data[e_w].zero_()
                ex.w13.data[e_w, : gate.shape[0], : self.hd] = gate.to(ex.w13.dtype)
                ex.w13.data[e_w, inter : inter + up.shape[0], : self.hd] = up.to(ex.w13.dtype)
                self._corner(ex.w2[e_w], dx.w2[e_d], down)
        for e_w in null_ids.tolist():
            (ex.w2_scale if isinstance(quant, Int4PackConfig) else ex.w2).data[e_w].zero_()
        if dm.shared_experts is not None:
            self._mlp(wm.shared_experts, dm.shared_experts)
        elif wm.shared_experts is not None:
            wm.shared_experts.down_proj.weight.data.zero_()

    def _int4_expert(self, ex, e: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, group: int) -> None:
        """Expert e's int4 words and scales: the demo expert's quantized blocks in the corner, zero scales elsewhere."""
        inter = ex.w13.shape[1] // 2
        hd, gw = self.hd, self.hd // group
        ex.w13_scale.data[e].zero_()
        ex.w2_scale.data[e].zero_()
        for rows, w in ((0, gate), (inter, up)):
            packed, scale = quantize_int4(w, group)
            ex.w13.data[e, rows : rows + w.shape[0], : hd // 8] = packed.to(ex.w13.device)
            ex.w13_scale.data[e, rows : rows + w.shape[0], :gw] = scale.to(ex.w13_scale.device)
        packed, scale = quantize_int4(down, group)  # [H_d, I_d]
        ex.w2.data[e, :hd, : down.shape[1] // 8] = packed.to(ex.w2.device)
        ex.w2_scale.data[e, :hd, : down.shape[1] // group] = scale.to(ex.w2_scale.device)
