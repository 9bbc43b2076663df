"""demo@ names and the wide model's shape: the published shapes the shipped demo is embedded in (SHAPES),
`demo@NAME[:LAYERS]` parsed, where the demo's layers go among the wide ones (demo_positions), the constant channel's
value (constant_channel) and the wide model's config (scaled_config), refused where the demo does not fit. How the
embedding works: models/scaled_demo.py's docstring."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from specserve.models.config import MLAConfig, ModelConfig, RopeConfig
from specserve.models.errors import ModelConfigError
from specserve.models.presets import PRESETS, split_named_spec
from specserve.models.quant import Int4PackConfig

SCALED_PREFIX = "demo@"


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
