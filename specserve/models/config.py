"""Model configs: one architecture-neutral ModelConfig, parsed from a Hugging Face config.json dict.

The only place that branches on ``model_type`` is the ``CONFIG_PARSERS`` registry at the bottom; the
model code is built from the parsed features (MLA vs GQA attention, router kind, MoE layer set, ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from specserve.models.errors import ModelConfigError, UnsupportedModelError
from specserve.models.quant import QuantConfig, parse_quantization

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SCORING_FUNCS = ("softmax", "sigmoid")


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (isinstance(value, (int, float)) and value > 0):
            raise ModelConfigError(f"{type(obj).__name__}.{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor / expert parallel placement of this process. tp_size=1 is the identity."""

    tp_rank: int = 0
    tp_size: int = 1
    ep: bool = False  # shard routed experts across ranks instead of slicing each expert
    # False only in the step benchmark's one-rank shard mode (`specserve bench step --shard R/N`): the
    # shard runs alone, without torch.distributed; its all-reduces are skipped and its logits gather fills the
    # other ranks' vocabulary columns with zeros, so its outputs are not the model's (the collectives are timed
    # separately by `specserve bench kernels --suite allreduce`). Serving always keeps the default.
    collectives: bool = True

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ModelConfigError(f"need 0 <= tp_rank < tp_size, got tp_rank={self.tp_rank} tp_size={self.tp_size}")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding over the first `dim` dims of each rotated head vector."""

    rope_type: str
    theta: float
    dim: int
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn (also scales the MLA softmax scale)
    attention_factor: float | None = None  # yarn: explicit cos/sin scale
    truncate: bool = True  # yarn

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ModelConfigError(f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        _positive(self, "theta", "dim", "factor")
        if self.dim % 2:
            raise ModelConfigError(f"rotary dim must be even, got {self.dim}")
        if self.rope_type in ("llama3", "yarn") and not self.original_max_position_embeddings:
            raise ModelConfigError(f"rope_type {self.rope_type!r} needs original_max_position_embeddings")


@dataclass(frozen=True)
class GQAConfig:
    """Grouped-query attention; K/V cache entry (2, num_kv_heads, head_dim)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    bias: bool = False  # q/k/v/o projections carry a bias
    sliding_window: int | None = None  # keys with q_pos - k_pos >= window are hidden

    def __post_init__(self) -> None:
        _positive(self, "num_heads", "num_kv_heads", "head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelConfigError(f"sliding_window must be > 0 or null, got {self.sliding_window}")

    @property
    def kv_entry_shape(self) -> tuple[int, ...]:
        return (2, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek); cache entry = normalised latent + roped shared key."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    bias: bool = False  # q_a_proj, kv_a_proj_with_mqa and o_proj carry a bias

    def __post_init__(self) -> None:
        _positive(self, "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.q_lora_rank is not None:
            _positive(self, "q_lora_rank")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_entry_shape(self) -> tuple[int, ...]:
        return (self.kv_lora_rank + self.qk_rope_head_dim,)


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (+ optional shared experts) replacing the dense MLP in `layers`."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    layers: tuple[int, ...]  # decoder layers whose MLP is an MoE block
    scoring: str = "softmax"  # softmax over all experts, or independent sigmoid scores
    norm_topk_prob: bool = True  # renormalise the chosen top-k weights to sum to 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # expert groups; only topk_group best groups are eligible
    topk_group: int = 1
    correction_bias: bool = False  # noaux_tc: e_score_correction_bias added for the choice only
    n_shared_experts: int = 0  # shared MLP of width n_shared_experts * intermediate_size

    def __post_init__(self) -> None:
        _positive(self, "num_experts", "top_k", "intermediate_size", "n_group", "topk_group", "routed_scaling_factor")
        if self.scoring not in SCORING_FUNCS:
            raise ModelConfigError(f"unsupported scoring {self.scoring!r}; supported: {', '.join(SCORING_FUNCS)}")
        if self.top_k > self.num_experts:
            raise ModelConfigError(f"top_k {self.top_k} > num_experts {self.num_experts}")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ModelConfigError(
                f"need num_experts % n_group == 0 and topk_group <= n_group, got {self.num_experts}, "
                f"{self.n_group}, {self.topk_group}"
            )
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ModelConfigError(f"top_k {self.top_k} exceeds the experts in {self.topk_group} groups")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int  # dense MLP width
    rms_norm_eps: float
    attention: GQAConfig | MLAConfig
    rope: RopeConfig
    moe: MoEConfig | None = None
    tie_word_embeddings: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: QuantConfig | None = None  # the checkpoint's int4 / fp8 format (weights load dequantized)
    checkpoint_prefix: str = ""  # tensor names of the text model start with this (multimodal wrappers)
    # Only ids below this are tokens: logits at ids >= it are -inf (a vocabulary padded past its real tokens, as
    # the demo at real size pads the demo's; models/scaled_demo.py). None: every id is a token.
    logits_vocab_limit: int | None = None

    def __post_init__(self) -> None:
        _positive(self, "vocab_size", "hidden_size", "num_layers", "intermediate_size", "rms_norm_eps")
        if self.moe is not None and any(not 0 <= i < self.num_layers for i in self.moe.layers):
            raise ModelConfigError(f"MoE layers {self.moe.layers} outside [0, {self.num_layers})")
        if self.logits_vocab_limit is not None and not 0 < self.logits_vocab_limit <= self.vocab_size:
            raise ModelConfigError(
                f"logits_vocab_limit must be in (0, {self.vocab_size}], got {self.logits_vocab_limit}"
            )

    @property
    def kv_entry_shape(self) -> tuple[int, ...]:
        return self.attention.kv_entry_shape

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.moe.layers if self.moe is not None else ()

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        parser = CONFIG_PARSERS.get(model_type)  # type: ignore[arg-type]
        if parser is None:
            raise UnsupportedModelError(model_type, tuple(sorted(CONFIG_PARSERS)))
        quantization = parse_quantization(raw.get("quantization_config"))
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"unsupported hidden_act {raw.get('hidden_act')!r}; only silu")
        config = parser(raw)
        if quantization is not None:
            config = dataclasses.replace(config, quantization=quantization)
        return config

    @staticmethod
    def from_file(path: str | os.PathLike[str]) -> ModelConfig:
        """path: a checkpoint directory or its config.json."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError as e:
            raise ModelConfigError(f"no config.json at {path}") from e
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path} must hold a JSON object")
        return ModelConfig.from_dict(raw)


# ---------------------------------------------------------------- parsing helpers

_MISSING = object()


def _get(raw: Mapping[str, Any], key: str, default: Any = _MISSING) -> Any:
    value = raw.get(key, default)
    if value is _MISSING:
        raise ModelConfigError(f"config.json ({raw.get('model_type')}) is missing {key!r}")
    return value


def _rope(raw: Mapping[str, Any], dim: int, default_theta: float) -> RopeConfig:
    """Reads transformers-5 `rope_parameters` or the older `rope_scaling` + `rope_theta`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    max_pos = raw.get("max_position_embeddings", 4096)
    orig = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if rope_type in ("llama3", "yarn") and orig is None:
        orig = max_pos
    factor = params.get("factor")
    if factor is None:  # yarn without factor: ratio of context lengths (transformers does the same)
        factor = max_pos / orig if rope_type == "yarn" else 1.0
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelConfigError("partial_rotary_factor != 1 is not supported")
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        dim=dim,
        factor=float(factor),
        original_max_position_embeddings=orig,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _common(
    raw: Mapping[str, Any], attention: GQAConfig | MLAConfig, rope: RopeConfig, moe: MoEConfig | None
) -> ModelConfig:
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),))
    return ModelConfig(
        model_type=raw["model_type"],
        vocab_size=_get(raw, "vocab_size"),
        hidden_size=_get(raw, "hidden_size"),
        num_layers=_get(raw, "num_hidden_layers"),
        intermediate_size=_get(raw, "intermediate_size"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        attention=attention,
        rope=rope,
        moe=moe,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _gqa(raw: Mapping[str, Any], qk_norm: bool, sliding_window: int | None) -> GQAConfig:
    heads = _get(raw, "num_attention_heads")
    return GQAConfig(
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or _get(raw, "hidden_size") // heads,
        qk_norm=qk_norm,
        bias=bool(raw.get("attention_bias", False)),
        sliding_window=sliding_window,
    )


def _qwen_sliding_window(raw: Mapping[str, Any]) -> int | None:
    if not raw.get("use_sliding_window", False):
        return None
    raise ModelConfigError("use_sliding_window=true (per-layer sliding windows) is not supported")


# ---------------------------------------------------------------- per-architecture parsers


def _parse_deepseek_v3(raw: Mapping[str, Any]) -> ModelConfig:
    attention = MLAConfig(
        num_heads=_get(raw, "num_attention_heads"),
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=_get(raw, "kv_lora_rank"),
        qk_nope_head_dim=_get(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=_get(raw, "qk_rope_head_dim"),
        v_head_dim=_get(raw, "v_head_dim"),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        bias=bool(raw.get("attention_bias", False)),
    )
    num_layers = _get(raw, "num_hidden_layers")
    first_dense = raw.get("first_k_dense_replace") or 0
    freq = raw.get("moe_layer_freq", 1) or 1
    n_routed = raw.get("n_routed_experts")
    moe = None
    if n_routed:
        moe = MoEConfig(
            num_experts=n_routed,
            top_k=_get(raw, "num_experts_per_tok"),
            intermediate_size=_get(raw, "moe_intermediate_size"),
            layers=tuple(i for i in range(first_dense, num_layers) if i % freq == 0),
            scoring=raw.get("scoring_func", "sigmoid"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            n_group=raw.get("n_group") or 1,
            topk_group=raw.get("topk_group") or 1,
            correction_bias=raw.get("topk_method", "noaux_tc") == "noaux_tc",
            n_shared_experts=raw.get("n_shared_experts") or 0,
        )
    return _common(raw, attention, _rope(raw, attention.qk_rope_head_dim, 10000.0), moe)


def _parse_qwen3_moe(raw: Mapping[str, Any]) -> ModelConfig:
    attention = _gqa(raw, qk_norm=True, sliding_window=_qwen_sliding_window(raw))
    num_layers = _get(raw, "num_hidden_layers")
    step = raw.get("decoder_sparse_step", 1) or 1
    dense_only = set(raw.get("mlp_only_layers") or ())
    num_experts = raw.get("num_experts", raw.get("num_local_experts", 0))
    moe = None
    if num_experts:
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=_get(raw, "num_experts_per_tok"),
            intermediate_size=_get(raw, "moe_intermediate_size"),
            layers=tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0),
            scoring="softmax",
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        )
    return _common(raw, attention, _rope(raw, attention.head_dim, 10000.0), moe)


def _parse_mixtral(raw: Mapping[str, Any]) -> ModelConfig:
    attention = _gqa(raw, qk_norm=False, sliding_window=raw.get("sliding_window"))
    moe = MoEConfig(
        num_experts=_get(raw, "num_local_experts"),
        top_k=_get(raw, "num_experts_per_tok"),
        intermediate_size=_get(raw, "intermediate_size"),
        layers=tuple(range(_get(raw, "num_hidden_layers"))),
        scoring="softmax",
        norm_topk_prob=True,
    )
    return _common(raw, attention, _rope(raw, attention.head_dim, 1e6), moe)


def _parse_llama(raw: Mapping[str, Any]) -> ModelConfig:
    attention = _gqa(raw, qk_norm=False, sliding_window=None)
    return _common(raw, attention, _rope(raw, attention.head_dim, 10000.0), None)


def _parse_qwen3(raw: Mapping[str, Any]) -> ModelConfig:
    if any(t != "full_attention" for t in raw.get("layer_types") or ()):
        raise ModelConfigError("qwen3 layer_types other than full_attention are not supported")
    attention = _gqa(raw, qk_norm=True, sliding_window=_qwen_sliding_window(raw))
    return _common(raw, attention, _rope(raw, attention.head_dim, 10000.0), None)


def _parse_kimi_k25(raw: Mapping[str, Any]) -> ModelConfig:
    """Kimi-K2.5 / K2.6: a multimodal wrapper whose text_config is a deepseek_v3 (tensors under
    language_model.; the vision tower is not loaded). Its quantization_config may sit in text_config."""
    text = raw.get("text_config")
    if not isinstance(text, Mapping) or text.get("model_type") not in ("deepseek_v3", "kimi_k2"):
        raise ModelConfigError("kimi_k25 config.json needs a text_config with model_type deepseek_v3")
    quantization = raw.get("quantization_config") or text.get("quantization_config")
    config = ModelConfig.from_dict({**text, "quantization_config": quantization})
    return dataclasses.replace(config, checkpoint_prefix="language_model.")


# The one registry keyed on model_type (Kimi-K2 ships the DeepSeek-V3 architecture).
CONFIG_PARSERS: dict[str, Callable[[Mapping[str, Any]], ModelConfig]] = {
    "deepseek_v3": _parse_deepseek_v3,
    "kimi_k2": _parse_deepseek_v3,
    "kimi_k25": _parse_kimi_k25,
    "qwen3_moe": _parse_qwen3_moe,
    "mixtral": _parse_mixtral,
    "llama": _parse_llama,
    "qwen3": _parse_qwen3,
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(CONFIG_PARSERS))
