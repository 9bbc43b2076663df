"""Synthetic models for performance work: named public architectures with random weights, built on the device.

The preset table below is the one place that names architectures by preset name. A preset is a frozen
ModelConfig; `synthetic_config(spec)` reads "NAME" or "NAME:LAYERS" (LAYERS keeps the first N decoder layers,
with the MoE layer set cut to match), and `build_synthetic_model` allocates the model directly on the target
device (no checkpoint, no CPU staging) and fills every parameter with small normal noise (never zeros).

Presets:
  qwen3-30b-a3b    Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts top-8 (moe_intermediate 768), 32 q / 4 kv
                   heads of 128, vocab 151936.
  kimi-k2-layer    Kimi-K2 width: hidden 7168, 384 experts top-8 + 1 shared (moe_intermediate 2048), MLA (q_lora
                   1536, kv_lora 512, rope 64, nope 128, v 128, 64 heads), every layer MoE (first_k_dense 0 for
                   the slice); 1 layer unless NAME:LAYERS says more.
  mini-qwen3-moe   2 layers with Qwen3-30B-A3B's attention dims (FlashInfer-supported head_dim 128) and few
                   small experts: for GPU equality tests.
  mini-kimi-k2     2 layers with Kimi-K2's MLA latent dims (512 + 64), few small experts, first layer dense.
  tiny-qwen3-moe   CPU-sized (hidden 64, head_dim 16): tests of the table and of the random init.
  tiny-kimi-k2     CPU-sized MLA + shared expert + sigmoid/noaux routing.
  moonlight-16b-a3b  Moonlight-16B-A3B as published: 27 layers (first dense, intermediate 11264), hidden 2048, MLA
                   (no q_lora, kv_lora 512, rope 64, nope 128, v 128, 16 heads), 64 experts top-6 + 2 shared
                   (moe_intermediate 1408), vocab 163840.
  kimi-k2.6        Kimi-K2.6's text model: Kimi-K2's width at its 61 layers (first dense), routed experts int4 in
                   groups of 32 (K2's rope: the preset's bytes and kernels do not depend on it).
  small-moonlight, small-kimi-k2.6   the two above at hidden 512 (a few layers, few experts): CPU tests of the
                   demo at real size (models/scaled_demo.py), which needs room for the demo's hidden 256.
  NAME-int4        kimi-k2-layer / mini-kimi-k2 / tiny-kimi-k2 with routed experts in int4 pack-quantized
                   groups of 32 as Kimi-K2-Thinking / K2.6 ship them (kept packed: random words, small scales).
  NAME-fp8         qwen3-30b-a3b / kimi-k2-layer (Qwen3-30B-A3B-FP8, Kimi-K2-Instruct) and tiny-qwen3-moe
                   with routed experts in e4m3, float32 scales per 128 x 128 block (16 x 16 for tiny-).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

import torch

from specserve.models.causal_lm import CausalLM, build_model
from specserve.models.config import GQAConfig, MLAConfig, ModelConfig, MoEConfig, ParallelConfig, RopeConfig
from specserve.models.errors import ModelConfigError
from specserve.models.moe import ExpertsFn, moe_reference
from specserve.models.quant import Fp8BlockConfig, Int4PackConfig

SYNTHETIC_PREFIX = "synthetic:"
DEFAULT_STD = 0.02


def _qwen3_moe(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    experts: int,
    top_k: int,
    moe_inter: int,
    vocab: int,
) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3_moe",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        intermediate_size=3 * hidden,  # unused: every layer is MoE
        rms_norm_eps=1e-6,
        attention=GQAConfig(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, qk_norm=True),
        rope=RopeConfig(rope_type="default", theta=1e6, dim=head_dim),
        moe=MoEConfig(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=moe_inter,
            layers=tuple(range(layers)),
            scoring="softmax",
            norm_topk_prob=True,
        ),
        max_position_embeddings=40960,
    )


def _kimi_k2(
    layers: int,
    hidden: int,
    heads: int,
    q_lora: int,
    kv_lora: int,
    rope: int,
    nope: int,
    v: int,
    experts: int,
    top_k: int,
    moe_inter: int,
    vocab: int,
    first_dense: int,
) -> ModelConfig:
    return ModelConfig(
        model_type="kimi_k2",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        intermediate_size=hidden * 18432 // 7168,
        rms_norm_eps=1e-6,
        attention=MLAConfig(
            num_heads=heads,
            q_lora_rank=q_lora,
            kv_lora_rank=kv_lora,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=v,
            rope_interleave=True,
        ),
        rope=RopeConfig(
            rope_type="yarn",
            theta=50000.0,
            dim=rope,
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=1.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        moe=MoEConfig(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=moe_inter,
            layers=tuple(range(first_dense, layers)),
            scoring="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=2.827,
            correction_bias=True,
            n_shared_experts=1,
        ),
        max_position_embeddings=131072,
    )


# Kimi-K2-Thinking's quantization_config: int4 routed experts, everything else bf16.
KIMI_INT4 = Int4PackConfig(
    group_size=32,
    ignore=("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"),
)
_KIMI = {
    "kimi-k2-layer": _kimi_k2(1, 7168, 64, 1536, 512, 64, 128, 128, 384, 8, 2048, 163840, first_dense=0),
    "mini-kimi-k2": _kimi_k2(2, 1024, 16, 256, 512, 64, 128, 128, 16, 4, 256, 4096, first_dense=1),
    "tiny-kimi-k2": _kimi_k2(2, 64, 4, 24, 16, 8, 16, 16, 8, 2, 32, 256, first_dense=1),
}


def _moonlight(
    layers: int,
    hidden: int,
    heads: int,
    kv_lora: int,
    rope: int,
    nope: int,
    v: int,
    experts: int,
    top_k: int,
    moe_inter: int,
    shared: int,
    inter: int,
    vocab: int,
) -> ModelConfig:
    """DeepSeek-V3 architecture at Moonlight's settings (no q_lora, sigmoid noaux routing, one dense layer)."""
    base = _kimi_k2(
        layers, hidden, heads, None, kv_lora, rope, nope, v, experts, top_k, moe_inter, vocab, first_dense=1
    )
    return dataclasses.replace(
        base,
        model_type="deepseek_v3",
        intermediate_size=inter,
        rms_norm_eps=1e-5,
        rope=RopeConfig(rope_type="default", theta=50000.0, dim=rope),
        max_position_embeddings=8192,
        moe=dataclasses.replace(base.moe, routed_scaling_factor=2.446, n_shared_experts=shared),
    )


_QWEN3_30B = _qwen3_moe(48, 2048, 32, 4, 128, 128, 8, 768, 151936)
_TINY_QWEN = _qwen3_moe(2, 64, 4, 2, 16, 8, 2, 32, 256)

# The frozen preset table: name -> full-depth config (cut by NAME:LAYERS).
PRESETS: Mapping[str, ModelConfig] = MappingProxyType(
    {
        "qwen3-30b-a3b": _QWEN3_30B,
        "kimi-k2-layer": _KIMI["kimi-k2-layer"],
        "mini-qwen3-moe": _qwen3_moe(2, 1024, 16, 4, 128, 16, 4, 256, 4096),
        "mini-kimi-k2": _KIMI["mini-kimi-k2"],
        "tiny-qwen3-moe": _TINY_QWEN,
        "tiny-kimi-k2": _KIMI["tiny-kimi-k2"],
        "moonlight-16b-a3b": _moonlight(27, 2048, 16, 512, 64, 128, 128, 64, 6, 1408, 2, 11264, 163840),
        "kimi-k2.6": dataclasses.replace(
            _kimi_k2(61, 7168, 64, 1536, 512, 64, 128, 128, 384, 8, 2048, 163840, first_dense=1), quantization=KIMI_INT4
        ),
        "small-moonlight": _moonlight(7, 512, 8, 128, 32, 64, 64, 32, 6, 128, 2, 1024, 8192),
        "small-kimi-k2.6": dataclasses.replace(
            _kimi_k2(6, 512, 8, 256, 128, 32, 64, 64, 48, 8, 128, 8192, first_dense=1), quantization=KIMI_INT4
        ),
        **{f"{name}-int4": dataclasses.replace(_KIMI[name], quantization=KIMI_INT4) for name in _KIMI},
        "qwen3-30b-a3b-fp8": dataclasses.replace(_QWEN3_30B, quantization=Fp8BlockConfig()),
        "kimi-k2-layer-fp8": dataclasses.replace(_KIMI["kimi-k2-layer"], quantization=Fp8BlockConfig()),
        "tiny-qwen3-moe-fp8": dataclasses.replace(_TINY_QWEN, quantization=Fp8BlockConfig(block=(16, 16))),
    }
)


def is_synthetic(model: object) -> bool:
    """True for a model name of the form 'synthetic:NAME[:LAYERS]'."""
    return str(model).startswith(SYNTHETIC_PREFIX)


def split_named_spec(spec: str, prefix: str, names: Mapping[str, object], what: str) -> tuple[str, int | None]:
    """'[prefix]NAME' or '[prefix]NAME:LAYERS' -> (NAME, LAYERS or None); NAME one of `names` (`what` names them in
    the error)."""
    body = spec[len(prefix) :] if spec.startswith(prefix) else spec
    name, sep, layers = body.partition(":")
    if name not in names:
        raise ModelConfigError(f"unknown {what} {name!r} in {spec!r}; choose from {', '.join(sorted(names))}")
    if not sep:
        return name, None
    if not layers.isdigit() or int(layers) < 1:
        raise ModelConfigError(f"{spec!r}: layer count must be a positive integer, got {layers!r}")
    return name, int(layers)


def parse_spec(spec: str) -> tuple[str, int | None]:
    """'NAME', 'NAME:LAYERS' or 'synthetic:NAME[:LAYERS]' -> (NAME, LAYERS or None)."""
    return split_named_spec(spec, SYNTHETIC_PREFIX, PRESETS, "synthetic preset")


def synthetic_config(spec: str) -> ModelConfig:
    """The preset's config, with the first LAYERS decoder layers when the spec gives a count."""
    name, layers = parse_spec(spec)
    config = PRESETS[name]
    if layers is None or layers == config.num_layers:
        return config
    moe = config.moe
    if moe is not None:
        if config.num_layers == 1:  # a one-layer slice repeats its layer kind (MoE) at any depth
            moe = dataclasses.replace(moe, layers=tuple(range(layers)))
        else:
            moe = dataclasses.replace(moe, layers=tuple(i for i in moe.layers if i < layers))
    return dataclasses.replace(config, num_layers=layers, moe=moe)


@torch.no_grad()
def init_random_(model: CausalLM, seed: int = 0, std: float = DEFAULT_STD) -> CausalLM:
    """Fill every parameter in place on its own device: norms 1 + noise, everything else N(0, std^2)."""
    gen = random_generator(next(model.parameters()).device, seed, std)
    int4 = isinstance(model.config.quantization, Int4PackConfig)
    for name, p in model.named_parameters():
        random_fill_(p, name, gen, std, int4)
    return model


def random_generator(device: torch.device, seed: int, std: float = DEFAULT_STD) -> torch.Generator:
    """The generator init_random_ draws from (one stream over the parameters in order)."""
    if not std > 0:
        raise ModelConfigError(f"std must be > 0, got {std}")
    return torch.Generator(device=device).manual_seed(seed)


@torch.no_grad()
def random_fill_(
    p: torch.Tensor, name: str, gen: torch.Generator, std: float = DEFAULT_STD, int4: bool = False
) -> None:
    """One parameter of init_random_ (by its name's ending), drawn from `gen`'s stream."""
    if name.endswith("norm.weight"):
        p.normal_(1.0, std, generator=gen)
    elif not p.is_floating_point():  # int4 experts' packed words: random nibbles
        p.random_(-(2**31), 2**31 - 1, generator=gen)
    elif p.element_size() == 1:  # e4m3 experts: random finite values (|v| <= 1.875), scales below
        p.view(torch.uint8).random_(0, 0x40, generator=gen).bitwise_or_(
            torch.randint(0, 2, p.shape, generator=gen, device=p.device, dtype=torch.uint8) << 7
        )
    elif name.endswith("_scale"):  # quantized experts' scales, so that weights come out at about std
        p.normal_(0.0, std / (4.6 if int4 else 1.0), generator=gen)  # int4 q in [-8, 7]
    else:
        p.normal_(0.0, std, generator=gen)


def build_synthetic_model(
    spec: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    parallel: ParallelConfig | None = None,
    experts_fn: ExpertsFn = moe_reference,
    seed: int = 0,
    std: float = DEFAULT_STD,
) -> tuple[CausalLM, ModelConfig]:
    """A full-size model of a preset with random weights, allocated on `device` directly."""
    config = synthetic_config(spec)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(config, parallel, experts_fn)
    finally:
        torch.set_default_dtype(old)
    init_random_(model, seed, std)
    return model.eval(), config


def parameter_bytes(
    config: ModelConfig, dtype: torch.dtype = torch.bfloat16, parallel: ParallelConfig | None = None
) -> dict[str, int]:
    """Weight bytes by role: 'dense' (read in full every step: attention, norms, routers, dense and shared MLPs,
    lm_head), 'embed' (the input table: a step reads only its tokens' rows), 'expert' (one routed expert of one
    layer), 'moe_layers' (how many layers have routed experts) and 'local_experts' (routed experts per layer held
    here). With `parallel`, the bytes of that rank's shard (TP-split dense weights and lm_head rows; EP: whole
    experts, of which this rank holds E / N)."""
    parallel = parallel or ParallelConfig()
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = build_model(config, parallel)
    finally:
        torch.set_default_dtype(old)
    dense = embed = experts = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.endswith(("experts.w13", "experts.w2", "experts.w13_scale", "experts.w2_scale")):  # int4: + scales
            experts += size
        elif name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            embed += size
        else:
            dense += size
    n_moe = len(config.moe_layers)
    local = 0
    if n_moe:
        local = config.moe.num_experts // parallel.tp_size if parallel.ep else config.moe.num_experts
    per_expert = experts // (n_moe * local) if n_moe else 0
    return {"dense": dense, "embed": embed, "expert": per_expert, "moe_layers": n_moe, "local_experts": local}
