"""DFlash configuration and the two checkpoint layouts it is read from (the model: dflash.py).

Our layout: ``config.json`` with ``model_type: "dflash"`` and DFlashConfig's fields (``from_dict`` /
``to_dict``; dflash.py's docstring lists its tensors).

z-lab's published layout (``architectures: ["DFlashDraftModel"]``, ``model_type: qwen3``; read by
``zlab_config``, never written): ``block_size``, ``dflash_config: {mask_token_id, target_layer_ids}``
(target layer outputs, our capture convention; ``num_target_layers`` spreads them when the ids are
absent) and Qwen3 layer fields; tensors ``fc.weight [H, taps * H]``, ``hidden_norm.weight`` (our
``context_norm``), ``norm.weight`` and per layer the Qwen3 names including
``self_attn.{q_norm,k_norm}.weight``; no embed_tokens, mask_embedding or lm_head (the target's are
used). It differs from ours in four features of DFlashConfig: ``qk_norm`` (per-head RMSNorm of q and
k), ``mask_token_id`` (mask positions hold that token's embedding), ``context_layernorm`` False (the
context rows T = hidden_norm(fc(...)) go to k/v_proj as they are, without the layer's input_layernorm)
and ``anchor_predicts_next`` False (the output at block position i gives drafted token i, so a block
drafts block_size - 1 tokens). The proposer is the same for both.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass

from specserve.draft_service.drafter_errors import DrafterConfigError


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    shared_target_head: bool = False  # embed_tokens / lm_head are the target's (frozen, not saved)
    denoise_steps: int = 1  # passes per drafted block (see "Denoising passes")
    # features of z-lab's layout (module docstring); the defaults are our own layout
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    mask_token_id: int | None = None  # None: a learned mask_embedding; else that token's embedding
    context_layernorm: bool = True  # context rows pass each layer's input_layernorm before k/v_proj
    anchor_predicts_next: bool = True  # output at block position 0 gives drafted token 1 (else position 1)
    # ids at or past this get -inf logits (a drafter over a padded vocabulary: models/scaled_drafters.py); None = none
    logits_vocab_limit: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "block_size",
            "target_hidden_size",
            "denoise_steps",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise DrafterConfigError(f"dflash config: {name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterConfigError("dflash config: num_attention_heads must be a multiple of num_key_value_heads")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise DrafterConfigError(f"dflash config: bad target_layer_ids {self.target_layer_ids}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise DrafterConfigError(
                f"dflash config: mask_token_id {self.mask_token_id} outside [0, {self.vocab_size})"
            )
        if self.mask_token_id is not None and not self.shared_target_head:
            raise DrafterConfigError("dflash config: mask_token_id needs the target's embeddings (shared_target_head)")
        if self.logits_vocab_limit is not None and not 0 < self.logits_vocab_limit <= self.vocab_size:
            raise DrafterConfigError(
                f"dflash config: logits_vocab_limit {self.logits_vocab_limit} outside [1, {self.vocab_size}]"
            )
        if self.drafts_per_block < 1:
            raise DrafterConfigError(f"dflash config: block_size {self.block_size} drafts no token")
        if self.denoise_steps > self.block_size - 1:
            raise DrafterConfigError(
                f"dflash config: denoise_steps {self.denoise_steps} > block_size - 1 = {self.block_size - 1}"
            )
        if not isinstance(self.shared_target_head, bool):
            raise DrafterConfigError(
                f"dflash config: shared_target_head must be true or false, got {self.shared_target_head!r}"
            )
        if self.shared_target_head and self.hidden_size != self.target_hidden_size:
            raise DrafterConfigError(
                f"dflash config: shared_target_head needs hidden_size == target_hidden_size (the target's embeddings"
                f" and lm_head are [V, {self.target_hidden_size}]), got hidden_size {self.hidden_size}"
            )

    @property
    def drafts_per_block(self) -> int:
        """Drafted tokens one block gives: block_size, or block_size - 1 when position 0 is only the anchor."""
        return self.block_size if self.anchor_predicts_next else self.block_size - 1

    def to_dict(self) -> dict:
        """Our layout's config.json; fields at their defaults are left out (older files stay byte-equal)."""
        fields = self.__dataclass_fields__
        optional = (
            "shared_target_head",
            "denoise_steps",
            "qk_norm",
            "mask_token_id",
            "context_layernorm",
            "anchor_predicts_next",
            "logits_vocab_limit",
        )
        d = {k: getattr(self, k) for k in fields if k not in optional or getattr(self, k) != fields[k].default}
        return dict(d, model_type="dflash", target_layer_ids=list(self.target_layer_ids))

    @staticmethod
    def from_dict(raw: dict) -> DFlashConfig:
        """Our layout's config.json (``model_type: dflash``); ``read_config`` also takes z-lab's."""
        if raw.get("model_type") != "dflash":
            raise DrafterConfigError(
                "dflash config.json must say model_type 'dflash' (our layout) or architectures ['DFlashDraftModel']"
                f" (z-lab's), got model_type {raw.get('model_type')!r}"
            )
        fields = DFlashConfig.__dataclass_fields__
        missing = [k for k in fields if k not in raw and fields[k].default is MISSING]
        if missing:
            raise DrafterConfigError(f"dflash config.json lacks {', '.join(missing)}")
        return DFlashConfig(**{k: raw[k] for k in fields if k in raw})


ZLAB_ARCHITECTURE = "DFlashDraftModel"
ZLAB_RENAMES = {"context_norm.weight": "hidden_norm.weight"}  # module attribute -> z-lab tensor name


def spread_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's taps when a config names none: one per draft layer, evenly from layer 1 to layer L - 3
    (rounded); a one-layer drafter taps the middle layer L // 2."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    return tuple(int(round(first + i * (last - first) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def zlab_config(raw: dict) -> DFlashConfig:
    """DFlashConfig of a config.json in z-lab's layout (module docstring); one line naming what is missing."""
    extra = raw.get("dflash_config")
    if not isinstance(extra, dict):
        raise DrafterConfigError(
            "dflash (z-lab layout) config.json lacks dflash_config {mask_token_id, target_layer_ids}"
        )
    need = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "block_size",
    )
    missing = [k for k in need if k not in raw] + [f"dflash_config.{k}" for k in ("mask_token_id",) if k not in extra]
    ids = extra.get("target_layer_ids")
    num_target = extra.get("num_target_layers", raw.get("num_target_layers"))
    if ids is None and num_target is None:
        missing.append("dflash_config.target_layer_ids (or num_target_layers)")
    if missing:
        raise DrafterConfigError(f"dflash (z-lab layout) config.json lacks {', '.join(missing)}")
    if not isinstance(extra["mask_token_id"], int):
        raise DrafterConfigError(
            f"dflash (z-lab layout): dflash_config.mask_token_id must be a token id, got {extra['mask_token_id']!r}"
        )
    kinds = set(raw.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise DrafterConfigError(
            f"dflash (z-lab layout): only full_attention layers are supported, got layer_types {sorted(kinds)}"
        )
    for key, ok in (("rope_scaling", None), ("attention_bias", False), ("hidden_act", "silu")):
        if raw.get(key, ok) not in (ok, None):
            raise DrafterConfigError(f"dflash (z-lab layout): {key} {raw[key]!r} is not supported (only {ok!r})")
    rope = raw.get("rope_parameters") or {}  # transformers 5 writes rope_theta there
    if rope.get("rope_type", "default") != "default":
        raise DrafterConfigError(
            f"dflash (z-lab layout): rope_type {rope['rope_type']!r} is not supported (only 'default')"
        )
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    h = raw["hidden_size"]
    if ids is None:
        ids = spread_target_layers(num_target, raw["num_hidden_layers"])
    return DFlashConfig(
        hidden_size=h,
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"],
        head_dim=raw.get("head_dim") or h // raw["num_attention_heads"],
        intermediate_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        block_size=raw["block_size"],
        target_hidden_size=h,  # fc reads taps x hidden_size: the drafter is as wide as its target
        target_layer_ids=tuple(ids),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        shared_target_head=True,
        qk_norm=True,
        mask_token_id=extra["mask_token_id"],
        context_layernorm=False,
        anchor_predicts_next=False,
    )


def read_config(raw: dict) -> tuple[DFlashConfig, dict[str, str]]:
    """(config, tensor renames) of either layout's config.json: z-lab's when its architectures say so."""
    if ZLAB_ARCHITECTURE in (raw.get("architectures") or ()):
        return zlab_config(raw), ZLAB_RENAMES
    return DFlashConfig.from_dict(raw), {}
