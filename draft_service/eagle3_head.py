"""The EAGLE-3 draft head: module, checkpoint loader and saver (the published layout).

Layout (one folder): ``config.json`` (llama-style fields + ``draft_vocab_size``, optional
``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids``) and ``model.safetensors`` with

    fc.weight                                   [H, 3 * Ht]   fuses three target layers
    midlayer.input_layernorm.weight             [H]           norm of the token embedding
    midlayer.hidden_norm.weight                 [H]           norm of the feature
    midlayer.self_attn.{q,k,v}_proj.weight      [heads * D, 2H]  over concat(embedding, feature)
    midlayer.self_attn.o_proj.weight            [H, heads * D]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up}_proj.weight          [I, H];  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                                 [H]
    lm_head.weight                              [Vd, H]      over the reduced draft vocabulary
    d2t                                         [Vd] int64   target_id = draft_id + d2t[draft_id]
    t2d                                         [V] bool     which target ids the draft vocab covers
    embed_tokens.weight                         [V, H]       optional; else the target's embeddings

One step at sequence position j: ``x = concat(input_layernorm(embed(t_j)), hidden_norm(f))`` with f =
fc(target features of position j - 1) (or, while drafting, the head's own output at the previous
position), attention (rope at draft position j - 1), residual on f, MLP; the next-token logits are
``lm_head(norm(out))`` and ``out`` (pre-norm) is the next step's feature.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specserve.draft_service.proposer import DrafterConfigError
from specserve.draft_service.target_tensors import read_target_tensors, read_tensors
from specserve.models.attention import attend
from specserve.models.config import GQAConfig, ModelConfig, RopeConfig
from specserve.models.layers import RMSNorm
from specserve.models.rope import RotaryEmbedding

HEAD_FILE = "model.safetensors"
REQUIRED_TENSORS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    attention: GQAConfig
    rope: RopeConfig
    aux_layers: tuple[int, ...] | None = None  # target layers (our capture convention) if recorded
    raw: dict | None = None  # the config.json dict, written back by save
    # draft ids at or past this get -inf logits (a head padded to a wider draft vocabulary: scaled_drafters.py)
    draft_vocab_limit: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise DrafterConfigError(
                f"draft_vocab_size {self.draft_vocab_size} must be in [1, vocab_size {self.vocab_size}]"
            )
        if self.draft_vocab_limit is not None and not 0 < self.draft_vocab_limit <= self.draft_vocab_size:
            raise DrafterConfigError(
                f"draft_vocab_limit {self.draft_vocab_limit} must be in [1, draft_vocab_size {self.draft_vocab_size}]"
            )

    @staticmethod
    def from_dict(raw: dict) -> Eagle3Config:
        if "draft_vocab_size" not in raw:
            raise DrafterConfigError("EAGLE-3 config.json lacks draft_vocab_size")
        llama = dict(raw, model_type="llama", num_hidden_layers=1)
        try:
            base = ModelConfig.from_dict(llama)
        except ValueError as e:
            raise DrafterConfigError(f"EAGLE-3 config.json: {e}") from e
        if not isinstance(base.attention, GQAConfig):
            raise DrafterConfigError("EAGLE-3 head must use grouped-query attention")
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        return Eagle3Config(
            hidden_size=base.hidden_size,
            intermediate_size=base.intermediate_size,
            vocab_size=base.vocab_size,
            draft_vocab_size=int(raw["draft_vocab_size"]),
            target_hidden_size=int(raw.get("target_hidden_size") or base.hidden_size),
            rms_norm_eps=base.rms_norm_eps,
            attention=base.attention,
            rope=base.rope,
            aux_layers=tuple(int(i) for i in aux) if aux else None,
            raw=dict(raw),
            draft_vocab_limit=int(raw["draft_vocab_limit"]) if raw.get("draft_vocab_limit") else None,
        )


def _norm(size: int, eps: float) -> RMSNorm:
    norm = RMSNorm(size, eps)
    nn.init.ones_(norm.weight)
    return norm


class Eagle3Head(nn.Module):
    """Parameters are plain tensors (a trainer calls ``requires_grad_()``); random init by default."""

    def __init__(self, cfg: Eagle3Config, with_embeddings: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        h, a = cfg.hidden_size, cfg.attention
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if with_embeddings else None
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.q_proj = nn.Linear(2 * h, a.num_heads * a.head_dim, bias=a.bias)
        self.k_proj = nn.Linear(2 * h, a.num_kv_heads * a.head_dim, bias=a.bias)
        self.v_proj = nn.Linear(2 * h, a.num_kv_heads * a.head_dim, bias=a.bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_layernorm = _norm(h, cfg.rms_norm_eps)
        self.hidden_norm = _norm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = _norm(h, cfg.rms_norm_eps)
        self.norm = _norm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = RotaryEmbedding(cfg.rope)

    def draft_to_target(self) -> torch.Tensor:  # [Vd] int64 target ids
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def embed(self, target_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.embed_tokens is None:
            raise DrafterConfigError("EAGLE-3 head has no token embeddings loaded")
        return self.embed_tokens(target_ids)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:  # [T, 3 * Ht] -> [T, H]
        return self.fc(features.to(self.fc.weight.dtype))

    def step(
        self,
        embeds: torch.Tensor,  # [T, H] token embeddings
        feats: torch.Tensor,  # [T, H] fused target features or the head's own previous outputs
        positions: torch.Tensor,  # [T] int64 draft positions
        past_k: torch.Tensor,  # [P, Hkv, D] keys this step may attend to (masked by `mask`)
        past_v: torch.Tensor,  # [P, Hkv, D]
        mask: torch.Tensor,  # [T, P + T] bool, True = may attend
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cos, sin) [T, D / 2] of `positions`, if made already
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # out [T, H], k [T, Hkv, D], v [T, Hkv, D]
        a, t = self.cfg.attention, embeds.shape[0]
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feats)], dim=-1)  # [T, 2H]
        q = self.q_proj(x).view(t, a.num_heads, a.head_dim)
        k = self.k_proj(x).view(t, a.num_kv_heads, a.head_dim)
        v = self.v_proj(x).view(t, a.num_kv_heads, a.head_dim)
        cos, sin = self.rotary.cos_sin(positions, x.dtype) if rope is None else rope
        q = RotaryEmbedding.apply(q, cos, sin, interleaved=False)
        k = RotaryEmbedding.apply(k, cos, sin, interleaved=False)
        out = attend(q, torch.cat([past_k, k]), torch.cat([past_v, v]), mask, a.head_dim**-0.5)
        h = feats + self.o_proj(out.reshape(t, -1))
        y = self.post_attention_layernorm(h)
        h = h + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return h, k, v

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, Vd] float32
        """Draft ids at or past cfg.draft_vocab_limit get -inf (in place: graph-safe)."""
        logits = self.lm_head(self.norm(out)).float()
        limit = self.cfg.draft_vocab_limit
        if limit is not None and limit < logits.shape[-1]:
            logits[:, limit:] = float("-inf")
        return logits


# checkpoint name -> module attribute path
def _param_names(head: Eagle3Head) -> dict[str, str]:
    names = {
        "fc.weight": "fc.weight",
        "norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        "d2t": "d2t",
        "t2d": "t2d",
        "midlayer.input_layernorm.weight": "input_layernorm.weight",
        "midlayer.hidden_norm.weight": "hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight": "post_attention_layernorm.weight",
    }
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"midlayer.self_attn.{p}.weight"] = f"{p}.weight"
        if getattr(head, p).bias is not None:
            names[f"midlayer.self_attn.{p}.bias"] = f"{p}.bias"
    for p in ("gate_proj", "up_proj", "down_proj"):
        names[f"midlayer.mlp.{p}.weight"] = f"{p}.weight"
    if head.embed_tokens is not None:
        names["embed_tokens.weight"] = "embed_tokens.weight"
    return names


def save_eagle3_head(head: Eagle3Head, out_dir: str | Path, with_embeddings: bool = False) -> None:
    """Write config.json + model.safetensors in the published layout (embeddings only if asked)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = dict(head.state_dict())
    tensors = {}
    for ckpt, attr in _param_names(head).items():
        if ckpt == "embed_tokens.weight" and not with_embeddings:
            continue
        tensors[ckpt] = state[attr].detach().contiguous().cpu()
    save_file(tensors, str(out / HEAD_FILE))
    (out / "config.json").write_text(json.dumps(head.cfg.raw, indent=2))


def load_eagle3_head(
    head_dir: str | Path,
    target_dir: str | Path | None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Eagle3Head:
    """Load a head in the published layout; a missing or misshapen tensor -> DrafterConfigError."""
    head_dir = Path(head_dir)
    cfg_path, weights = head_dir / "config.json", head_dir / HEAD_FILE
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise DrafterConfigError(f"EAGLE-3 head: no config.json in {head_dir}") from e
    except json.JSONDecodeError as e:
        raise DrafterConfigError(f"EAGLE-3 head: {cfg_path} is not valid JSON: {e}") from e
    cfg = Eagle3Config.from_dict(raw)
    if not weights.is_file():
        raise DrafterConfigError(f"EAGLE-3 head: no {HEAD_FILE} in {head_dir}")
    tensors = read_tensors(weights, "EAGLE-3 head")
    missing = [name for name in REQUIRED_TENSORS if name not in tensors]
    if missing:
        raise DrafterConfigError(f"EAGLE-3 head {weights} lacks tensor(s): {', '.join(missing)}")
    if "embed_tokens.weight" not in tensors:
        if target_dir is None:
            raise DrafterConfigError(
                "EAGLE-3 head has no embed_tokens.weight; give the target checkpoint to read them from"
            )
        tensors.update(read_target_tensors(target_dir, {"embed_tokens.weight": "model.embed_tokens.weight"}, "EAGLE-3 head"))
    with torch.device(device):
        head = Eagle3Head(cfg, with_embeddings=True)
    params = dict(head.state_dict())
    for ckpt, attr in _param_names(head).items():
        if ckpt not in tensors:
            raise DrafterConfigError(f"EAGLE-3 head {weights} lacks tensor {ckpt}")
        src, dst = tensors[ckpt], params[attr]
        if tuple(src.shape) != tuple(dst.shape):
            raise DrafterConfigError(
                f"EAGLE-3 tensor {ckpt} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(src)
    d2t_ids = head.draft_to_target()
    if int(d2t_ids.min()) < 0 or int(d2t_ids.max()) >= cfg.vocab_size:
        raise DrafterConfigError("EAGLE-3 d2t maps draft ids outside the target vocabulary")
    return head.to(dtype=dtype).eval()
