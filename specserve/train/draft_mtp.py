"""Train a DeepSeek-V3 multi-token-prediction (MTP) layer for a trained target (draft_service/mtp.py).

The layer is the target's layer N (N = ``num_hidden_layers``) in DeepSeek-V3's layout: ``eh_proj``,
``enorm``, ``hnorm``, ``shared_head.norm`` and a full decoder block of the target's own architecture
(MLA attention + MoE, transformers' ``DeepseekV3DecoderLayer``); its embedding and output head are the
target's (shared, as in DeepSeek-V3: frozen here, not saved).

Alignment is the proposer's: entry e (0 <= e <= T - 2) at position e reads token t_{e+1} and the
target's final hidden state at position e (the output of decoder layer N - 1 through the target's final
norm) and predicts token t_{e+2}: its label is the target's soft next-token distribution at position
e + 1 (teacher-forced), i.e. the next-next token of position e.

Training-time test (as EAGLE-3, specserve/train/draft_eagle3.py, whose masks it shares): pass p >= 2
feeds, at entry e, the layer's own pass-(p-1) output at entry e - 1 in place of the target's hidden
state, which is what drafting token p after a pending token at position e - p + 1 sees. Its attention
covers the pass-1 entries up to e - p + 1 (the confirmed context) and the pass-q entries at
e - p + q for q = 2..p (the chain drafted so far). Pass p is weighted ``pass_decay ** (p - 1)``.

The block starts from the target's last decoder layer (its router, correction bias and experts), the
head norm from the target's final norm; ``eh_proj`` starts random (``--init-from DIR``: a saved MTP layer
instead). The router's ``e_score_correction_bias`` stays the target layer's (no gradient reaches it).

Saved: ``config.json`` (the target's, with ``num_nextn_predict_layers`` = 1) and ``model.safetensors``
with the tensors ``model.layers.N.*`` of the published DeepSeek-V3 layout (routed experts one by one),
less ``embed_tokens`` and ``shared_head.head``, which the proposer reads from the target.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.train.common import TrainError, apply_arch
from specserve.train.draft_eagle3 import ttt_mask_cache
from specserve.train.feature_distill import heldout_agreement, train_on_target_features


@dataclass(frozen=True)
class MTPTrainSpec:
    ttt_steps: int = 3  # training-time-test passes (drafted tokens trained for; later ones reuse the last)
    group: int = 16  # sequences per forward
    pass_decay: float = 0.8
    loss_share: float = 0.25  # share of each pass's entries (drawn at random) that the head and loss run on

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise TrainError(f"MTPTrainSpec.{name} must be > 0, got {value}")
        if self.loss_share > 1:
            raise TrainError(f"MTPTrainSpec.loss_share must be in (0, 1], got {self.loss_share}")


class _PassLatents:
    """The one-method cache transformers' MLA attention calls (``update``): the latents of the earlier
    passes [G, 1, K, r] come before this pass's, and this pass's are kept for the next pass."""

    def __init__(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> None:
        self.kv_nope, self.k_rot = kv_nope, k_rot  # [G, 1, K, kv_lora_rank], [G, 1, K, qk_rope_head_dim]
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, kv_nope: torch.Tensor, k_rot: torch.Tensor, layer_idx: int):
        self.new = (kv_nope, k_rot)
        return torch.cat([self.kv_nope, kv_nope], dim=2), torch.cat([self.k_rot, k_rot], dim=2)


class MTPTrainLayer(nn.Module):
    """The trainable MTP layer (transformers modules); ``published_state_dict`` names its tensors."""

    def __init__(self, target) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
            DeepseekV3RotaryEmbedding,
        )

        super().__init__()
        cfg = target.config.__class__.from_dict(target.config.to_dict())
        cfg._attn_implementation = "sdpa"  # the pass masks are boolean
        cfg._experts_implementation = "grouped_mm"  # the same function as the per-expert loop, faster (also on CPU)
        n, h, eps = cfg.num_hidden_layers, cfg.hidden_size, cfg.rms_norm_eps
        if n < 1 or n < cfg.first_k_dense_replace:
            raise TrainError("mtp: the target's layer N would be dense; train mtp for a MoE target")
        self.config, self.num_target_layers = cfg, n
        self.enorm, self.hnorm = DeepseekV3RMSNorm(h, eps), DeepseekV3RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DeepseekV3DecoderLayer(cfg, layer_idx=n)
        self.head_norm = DeepseekV3RMSNorm(h, eps)  # shared_head.norm
        self.target_norm = DeepseekV3RMSNorm(h, eps)
        self.rotary = DeepseekV3RotaryEmbedding(cfg)
        lm_head = target.lm_head.weight if getattr(target, "lm_head", None) is not None else None
        embed = target.model.embed_tokens.weight
        self.register_buffer("embed", embed.detach().float().cpu().clone(), persistent=False)  # [V, H]
        self.register_buffer(
            "head", (embed if lm_head is None else lm_head).detach().float().cpu().clone(), persistent=False
        )  # [V, H]
        with torch.no_grad():
            last = target.model.layers[n - 1].state_dict()
            self.block.load_state_dict({k: v.float().cpu() for k, v in last.items()})
            self.head_norm.weight.copy_(target.model.norm.weight.float().cpu())
            self.target_norm.weight.copy_(target.model.norm.weight.float().cpu())
        self.target_norm.weight.requires_grad_(False)

    def step(
        self,
        tokens: torch.Tensor,  # [G, n] int64: the token each entry reads
        previous: torch.Tensor,  # [G, n, H]: the hidden state before it (the target's final, or this layer's own)
        positions: torch.Tensor,  # [n] int64
        past: _PassLatents,  # the earlier passes' latents [G, 1, K, *]
        mask: torch.Tensor,  # [n, K + n] bool: which keys each entry attends to
    ) -> torch.Tensor:  # [G, n, H] the block's output
        x = self.eh_proj(torch.cat([self.enorm(F.embedding(tokens, self.embed)), self.hnorm(previous)], dim=-1))
        cos, sin = self.rotary(x, positions[None].expand(len(x), -1))
        return self.block(x, attention_mask=mask[None, None], position_embeddings=(cos, sin), past_key_values=past)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        return F.linear(self.head_norm(h), self.head)

    def published_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under the published names ``model.layers.N.*`` (routed experts one by one)."""
        prefix = f"model.layers.{self.num_target_layers}."
        out = {
            prefix + "enorm.weight": self.enorm.weight,
            prefix + "hnorm.weight": self.hnorm.weight,
            prefix + "eh_proj.weight": self.eh_proj.weight,
            prefix + "shared_head.norm.weight": self.head_norm.weight,
        }
        for name, value in self.block.state_dict().items():
            if name == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
                for e, w in enumerate(value):
                    gate, up = w.chunk(2, dim=0)
                    out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate
                    out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up
            elif name == "mlp.experts.down_proj":  # [E, H, I]
                for e, w in enumerate(value):
                    out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = w
            else:
                out[prefix + name] = value
        return {k: v.detach() for k, v in out.items()}


@torch.no_grad()
def load_published_state(layer: MTPTrainLayer, folder: Path) -> None:
    """Fill ``layer`` from a folder ``save_mtp_layer`` wrote (``--init-from``); a missing or misshapen tensor is
    one TrainError naming it."""
    from safetensors.torch import load_file

    path = Path(folder) / "model.safetensors"
    try:
        saved = load_file(str(path))
    except Exception as e:  # a missing or unreadable file
        raise TrainError(f"--init-from: cannot read {path}: {e}") from e
    prefix = f"model.layers.{layer.num_target_layers}."
    experts = layer.block.mlp.experts

    def get(name: str, like: torch.Tensor) -> torch.Tensor:
        value = saved.get(name)
        if value is None or value.shape != like.shape:
            raise TrainError(f"--init-from {folder}: tensor {name} is missing or not {tuple(like.shape)}")
        return value.to(like.dtype)

    for name, value in layer.published_state_dict().items():  # detached views of the parameters
        if ".mlp.experts." not in name:
            value.copy_(get(name, value))
    for e in range(experts.num_experts):
        gate_up, down = experts.gate_up_proj[e], experts.down_proj[e]  # [2I, H], [H, I]
        gate = get(f"{prefix}mlp.experts.{e}.gate_proj.weight", gate_up[: len(gate_up) // 2])
        up = get(f"{prefix}mlp.experts.{e}.up_proj.weight", gate_up[len(gate_up) // 2 :])
        gate_up.copy_(torch.cat([gate, up]))
        down.copy_(get(f"{prefix}mlp.experts.{e}.down_proj.weight", down))


def mtp_pass_outputs(layer: MTPTrainLayer, ids: torch.Tensor, feats: torch.Tensor, masks: list[torch.Tensor]):
    """ids [G, T], feats [G, T, H] (target layer N - 1 outputs) -> the block's output [G, T - 1, H] of each
    training-time-test pass in turn (pass p = ``masks[p - 1]``), entry e at position e."""
    G, T = ids.shape
    cfg = layer.config
    pos = torch.arange(T - 1, device=ids.device)  # [n] entry e sits at position e
    tokens = ids[:, 1:]  # [G, n] entry e reads t_{e+1}
    previous = layer.target_norm(feats[:, :-1])  # [G, n, H] the target's final hidden state at e
    kv = feats.new_zeros(G, 1, 0, cfg.kv_lora_rank)
    kr = feats.new_zeros(G, 1, 0, cfg.qk_rope_head_dim)
    for mask in masks:
        past = _PassLatents(kv, kr)
        out = layer.step(tokens, previous, pos, past, mask)  # [G, n, H]
        kv, kr = past.update(*past.new, 0)
        yield out
        previous = torch.cat([out[:, :1], out[:, :-1]], dim=1)  # entry e reads this pass's output at e - 1


def mtp_ttt_loss(
    layer: MTPTrainLayer,
    ids: torch.Tensor,
    feats: torch.Tensor,
    probs: torch.Tensor,
    masks: list[torch.Tensor],
    spec: MTPTrainSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [G, T], feats [G, T, H], probs [G, T, V] (the target's) -> (weighted loss, per-pass argmax agreement [P])."""
    n = ids.shape[1] - 1
    pos = torch.arange(n, device=ids.device)
    labels = probs[:, 1:]  # [G, n, V] entry e's label: the target's distribution of t_{e+2}
    total, agree = feats.new_zeros(()), []
    for p, out in enumerate(mtp_pass_outputs(layer, ids, feats, masks[: spec.ttt_steps]), start=1):
        valid = pos >= p - 1  # entries with a whole chain before them
        if spec.loss_share < 1 and layer.training:  # the head costs more than the block: run it on a sample
            valid &= torch.rand(n, device=ids.device) < spec.loss_share
        logits = layer.logits(out[:, valid])  # [G, n', V]
        lab = labels[:, valid]
        loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten(0, 1))  # soft labels
        total = total + spec.pass_decay ** (p - 1) * loss
        with torch.no_grad():
            agree.append((logits.argmax(-1) == lab.argmax(-1)).float().mean())
    return total, torch.stack(agree)


def mtp_config(target_config) -> dict:
    """config.json of the MTP folder: the target's, with one multi-token-prediction layer."""
    raw = target_config.to_dict()
    raw["num_nextn_predict_layers"] = 1
    raw["dtype"] = "bfloat16"
    return raw


def save_mtp_layer(layer: MTPTrainLayer, out_dir: Path) -> None:
    """config.json + model.safetensors (bfloat16; the router's correction bias in float32)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.float() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)).cpu().contiguous()
        for k, v in layer.published_state_dict().items()
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(mtp_config(layer.config), indent=2, sort_keys=True) + "\n")


def train_mtp_job(job) -> dict:
    spec = apply_arch(MTPTrainSpec(), job.arch)
    torch.manual_seed(job.seed)
    layer = MTPTrainLayer(job.target)
    if job.init_from is not None:
        load_published_state(layer, job.init_from)
    layer = layer.to(job.device).train()
    layers = (layer.num_target_layers - 1,)
    group = min(spec.group, job.batch_size)
    masks = ttt_mask_cache(spec.ttt_steps, job.device)

    def loss_fn(ids, feats, probs):
        return mtp_ttt_loss(layer, ids, feats, probs, masks(ids.shape[1]), spec)

    run = train_on_target_features(job, layer, layers, group, loss_fn, "train_mtp")
    heldout = heldout_agreement(job, layer, layers, group, loss_fn)
    save_mtp_layer(layer.to("cpu"), job.out_dir)
    return {
        "steps_run": run["steps_run"],
        "stopped_by": run["stopped_by"],
        "train_seconds": run["train_seconds"],
        "last_agreement_by_pass": run["last_agreement"],
        "heldout_agreement_by_pass": heldout,
        "arch": asdict(spec),
    }
