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

For serving (`fuse_projections`, called by the proposer once the weights are final) q/k/v run as one GEMM and
gate/up as another, over weights concatenated once (the separate linears then read views of them: no second copy).
`window_step` is the pass the CUDA graphs record (eagle3_graph.py): its keys and values are written into a fixed
window first, then it attends over the whole window under an additive bias (no concatenated copy of the window a
pass), RoPE from a table of the window's positions in three kernels (q and k together), the MLP's residual added by
its down projection's GEMM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specserve.draft_service.drafter_errors import DrafterConfigError
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
    # draft ids at or past this get -inf logits (a head padded to a wider draft vocabulary: models/scaled_drafters.py)
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
        self._qkv: torch.Tensor | None = None  # [(Hq + 2 Hkv) D, 2H] q/k/v weights as one (fuse_projections)
        self._qkv_bias: torch.Tensor | None = None
        self._gate_up: torch.Tensor | None = None  # [2I, H] gate and up weights as one

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """q/k/v as one GEMM, gate/up as another (inference: call once the weights are final, in their dtype and on
        their device; idempotent). The separate linears then hold views of the fused weights, so an in-place edit of
        either is seen by both and no weight is stored twice."""
        if self._qkv is not None:
            return

        def fuse(linears):
            fused = torch.cat([m.weight for m in linears])
            start = 0
            for m in linears:
                rows = m.weight.shape[0]
                m.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
                start += rows
            return fused

        attn = (self.q_proj, self.k_proj, self.v_proj)
        if self.q_proj.bias is not None:
            self._qkv_bias = torch.cat([m.bias for m in attn])
            start = 0
            for m in attn:
                rows = m.bias.shape[0]
                m.bias = nn.Parameter(self._qkv_bias[start : start + rows], requires_grad=False)
                start += rows
        self._qkv = fuse(attn)
        self._gate_up = fuse((self.gate_proj, self.up_proj))

    def draft_to_target(self) -> torch.Tensor:  # [Vd] int64 target ids
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def embed(self, target_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.embed_tokens is None:
            raise DrafterConfigError("EAGLE-3 head has no token embeddings loaded")
        return self.embed_tokens(target_ids)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:  # [T, 3 * Ht] -> [T, H]
        return self.fc(features.to(self.fc.weight.dtype))

    def _qkv_rope(
        self,
        x: torch.Tensor,  # [T, 2H] concat(input_layernorm(embeds), hidden_norm(feats))
        rope: torch.Tensor,  # [T, 2, D] rope_rows of the T positions
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k [T, Hkv, D] (both roped), v [T, Hkv, D]
        a, t = self.cfg.attention, x.shape[0]
        nq, nkv = a.num_heads, a.num_kv_heads
        if self._qkv is not None:  # one GEMM; q and k roped together
            y = F.linear(x, self._qkv, self._qkv_bias).view(t, nq + 2 * nkv, a.head_dim)
            qk, v = y[:, : nq + nkv], y[:, nq + nkv :]
        else:
            qk = torch.cat([self.q_proj(x).view(t, nq, a.head_dim), self.k_proj(x).view(t, nkv, a.head_dim)], dim=1)
            v = self.v_proj(x).view(t, nkv, a.head_dim)
        qk = rotate(qk, rope)
        return qk[:, :nq], qk[:, nq:], v

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:  # [T, H] -> gate/up activation [T, I]
        y = self.post_attention_layernorm(h)
        if self._gate_up is not None:
            gate, up = F.linear(y, self._gate_up).chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.silu(self.gate_proj(y)) * self.up_proj(y)

    def rope_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [T] -> [T, 2, D]
        """(cos, signed sin) of each position over a head's D dims, as `rotate` reads them: cos of pair i at dims i
        and D/2 + i, sin as -sin at i and +sin at D/2 + i (the half-split layout)."""
        cos, sin = self.rotary.cos_sin(positions, dtype)  # [T, D / 2] each
        return torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)], dim=1)

    def step(
        self,
        embeds: torch.Tensor,  # [T, H] token embeddings
        feats: torch.Tensor,  # [T, H] fused target features or the head's own previous outputs
        positions: torch.Tensor,  # [T] int64 draft positions
        past_k: torch.Tensor,  # [P, Hkv, D] keys this step may attend to (masked by `mask`)
        past_v: torch.Tensor,  # [P, Hkv, D]
        mask: torch.Tensor,  # [T, P + T] bool, True = may attend
        rope: torch.Tensor | None = None,  # [T, 2, D] rope_rows of `positions`, if made already
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # out [T, H], k [T, Hkv, D], v [T, Hkv, D]
        a, t = self.cfg.attention, embeds.shape[0]
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feats)], dim=-1)  # [T, 2H]
        q, k, v = self._qkv_rope(x, self.rope_rows(positions, x.dtype) if rope is None else rope)
        out = attend(q, torch.cat([past_k, k]), torch.cat([past_v, v]), mask, a.head_dim**-0.5)
        h = feats + self.o_proj(out.reshape(t, -1))
        return h + self.down_proj(self._mlp(h)), k, v

    def window_step(
        self,
        embeds: torch.Tensor,  # [T, H] token embeddings
        feats: torch.Tensor,  # [T, H] fused target features or the head's own previous outputs (not written)
        rope: torch.Tensor,  # [T, 2, D] rope_rows of the T positions
        keys: torch.Tensor,  # [P, Hkv, D] the window: this step's keys are written at `slots` first
        values: torch.Tensor,  # [P, Hkv, D]
        slots: torch.Tensor,  # [T] int64 window slots of the T rows (their draft positions)
        bias: torch.Tensor,  # [Hkv, T * G, P] window_bias: 0 where row t may attend, -inf elsewhere (overwritten)
    ) -> torch.Tensor:  # out [T, H]
        """One head pass over a fixed window (inference only; what eagle3_graph.py records): 24 kernels a drafted
        token with the Triton norms, none of them a copy of the window."""
        a, t = self.cfg.attention, embeds.shape[0]
        g = a.num_heads // a.num_kv_heads
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feats)], dim=-1)  # [T, 2H]
        q, k, v = self._qkv_rope(x, rope)
        keys.index_copy_(0, slots, k)
        values.index_copy_(0, slots, v)
        qg = q.reshape(t, a.num_kv_heads, g, a.head_dim).transpose(0, 1).reshape(a.num_kv_heads, t * g, a.head_dim)
        scores = bias.baddbmm_(qg, keys.permute(1, 2, 0), alpha=a.head_dim**-0.5)  # [Hkv, T * G, P]
        out = torch.bmm(torch.softmax(scores, dim=-1), values.transpose(0, 1))  # [Hkv, T * G, D]
        out = out.view(a.num_kv_heads, t, g, a.head_dim).transpose(0, 1).reshape(t, -1)  # [T, Hq * D]
        h = self.o_proj(out)
        h += feats
        return h.addmm_(self._mlp(h), self.down_proj.weight.t())

    def window_bias(
        self,
        positions: torch.Tensor,  # [T] int64 draft positions (= window slots) of the T rows
        slot_ids: torch.Tensor,  # [P] arange over the window
        dtype: torch.dtype,
        per_row: bool,  # True: [T, Hkv, G, P], row t's bias for a pass of its own (a chain); False: [Hkv, T * G, P]
    ) -> torch.Tensor:
        """window_step's bias: row t may attend to slots <= positions[t] (the confirmed entries, the rows before it
        and itself, all written before it attends)."""
        a = self.cfg.attention
        g = a.num_heads // a.num_kv_heads
        t, p = positions.shape[0], slot_ids.shape[0]
        bias = torch.zeros(t, p, dtype=dtype, device=positions.device).masked_fill_(
            slot_ids[None] > positions[:, None], float("-inf")
        )  # [T, P]
        if per_row:
            return bias[:, None, None].expand(t, a.num_kv_heads, g, p).contiguous()
        return bias[None, :, None].expand(a.num_kv_heads, t, g, p).contiguous().view(a.num_kv_heads, t * g, p)

    def greedy_ids(self, out: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T] int64 draft ids
        """The argmax of logits(out) without its float copy and its -inf fill (the ids past draft_vocab_limit are
        left out of the argmax instead): the same ids."""
        logits = self.lm_head(self.norm(out))
        limit = self.cfg.draft_vocab_limit
        return (logits if limit is None else logits[:, :limit]).argmax(dim=-1)

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, Vd] float32
        """Draft ids at or past cfg.draft_vocab_limit get -inf (in place: graph-safe)."""
        logits = self.lm_head(self.norm(out)).float()
        limit = self.cfg.draft_vocab_limit
        if limit is not None and limit < logits.shape[-1]:
            logits[:, limit:] = float("-inf")
        return logits


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:  # x [T, heads, D], rope [T, 2, D] -> [T, heads, D]
    """Half-split RoPE (RotaryEmbedding.apply, interleaved=False) in three kernels: x cos + roll(x, D/2) signed sin."""
    return torch.addcmul(x * rope[:, None, 0], x.roll(x.shape[-1] // 2, dims=-1), rope[:, None, 1])


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
        tensors[ckpt] = state[attr].detach().cpu().clone()  # fused heads hold views of one tensor
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
        tensors.update(
            read_target_tensors(target_dir, {"embed_tokens.weight": "model.embed_tokens.weight"}, "EAGLE-3 head")
        )
    with torch.device(device):
        head = Eagle3Head(cfg, with_embeddings=True)
    params = dict(head.state_dict())
    for ckpt, attr in _param_names(head).items():
        if ckpt not in tensors:
            raise DrafterConfigError(f"EAGLE-3 head {weights} lacks tensor {ckpt}")
        src, dst = tensors[ckpt], params[attr]
        if tuple(src.shape) != tuple(dst.shape):
            raise DrafterConfigError(f"EAGLE-3 tensor {ckpt} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(src)
    d2t_ids = head.draft_to_target()
    if int(d2t_ids.min()) < 0 or int(d2t_ids.max()) >= cfg.vocab_size:
        raise DrafterConfigError("EAGLE-3 d2t maps draft ids outside the target vocabulary")
    return head.to(dtype=dtype).eval()
