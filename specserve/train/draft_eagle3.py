"""Train an EAGLE-3 head (helper C's ``Eagle3Head``, published layout) against the frozen target.

Alignment is the proposer's (draft_service/eagle3.py): the head's entry for sequence position j
(1 <= j <= T-1) reads token t_j and fc(target features of position j-1) at draft position j-1, and its
output predicts the target's next-token distribution at position j.

Training-time test (EAGLE-3): pass 1 feeds target features; pass p >= 2 feeds, at entry j, the head's
own pass-(p-1) output at entry j-1 — exactly what drafting token p-1 after a pending token at
position j-p+1 sees. Its attention covers pass-1 entries up to j-p+1 (the confirmed context) and the
pass-q entries at j-p+q for q = 2..p (the drafted chain so far). Labels are the target's soft
distributions (teacher-forced), weighted 0.8^(p-1).

The head runs one sequence per ``step`` call; training vectorises it over G sequences (torch.func.vmap).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from specserve.train.common import TrainError, apply_arch
from specserve.train.feature_distill import heldout_agreement, train_on_target_features


@dataclass(frozen=True)
class Eagle3Spec:
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    ttt_steps: int = 4  # training-time-test passes
    group: int = 64  # sequences per vectorised head call
    pass_decay: float = 0.8

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise TrainError(f"Eagle3Spec.{name} must be > 0, got {value}")


def default_capture_layers(num_layers: int) -> tuple[int, ...]:
    """Outputs of decoder layers (1, L//2, L-1) (low, middle, last before the final norm), distinct and
    inside [0, L) for a small target (EAGLE-3's (2, L/2, L-3) layer inputs collapse for L < 8)."""
    if num_layers < 3:
        raise TrainError(f"EAGLE-3 fuses 3 distinct target layers; the target has {num_layers}")
    layers = sorted({1, num_layers // 2, num_layers - 1})
    while len(layers) < 3:
        layers = sorted(set(layers) | {min(set(range(num_layers)) - set(layers))})
    return tuple(layers)


def head_config(target_config, spec: Eagle3Spec, layers: tuple[int, ...]) -> dict:
    """config.json of the head: llama-style fields + draft_vocab_size, target_hidden_size and
    eagle_aux_hidden_state_layer_ids (layer INPUTS, i.e. our capture layer + 1)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target_config.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": target_config.max_position_embeddings,
        "rope_theta": 10000.0,
        "vocab_size": target_config.vocab_size,
        "draft_vocab_size": target_config.vocab_size,
        "target_hidden_size": target_config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layers],
        "tie_word_embeddings": False,
        "bos_token_id": target_config.bos_token_id,
        "eos_token_id": target_config.eos_token_id,
        "torch_dtype": "bfloat16",
    }


def build_head(target, spec: Eagle3Spec, layers: tuple[int, ...]):
    from specserve.draft_service.eagle3_head import Eagle3Config, Eagle3Head

    cfg = Eagle3Config.from_dict(head_config(target.config, spec, layers))
    head = Eagle3Head(cfg, with_embeddings=True)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.model.embed_tokens.weight.float().cpu())
        head.t2d.fill_(True)  # full draft vocabulary: draft id == target id (d2t = 0)
        # start from the target's output head: the head's out lives in the target's residual space
        if hasattr(target, "lm_head") and tuple(target.lm_head.weight.shape) == tuple(head.lm_head.weight.shape):
            head.lm_head.weight.copy_(target.lm_head.weight.float().cpu())
            head.norm.weight.copy_(target.model.norm.weight.float().cpu())
    head.embed_tokens.weight.requires_grad_(False)
    return head


def ttt_masks(length: int, passes: int, device) -> list[torch.Tensor]:
    """Pass p's mask [n, p * n] over keys cat(K_1 .. K_p) of one sequence, n = length - 1 entries."""
    j = torch.arange(1, length, device=device)  # [n] sequence position of each entry
    diff = j[:, None] - j[None, :]  # j_query - j_key
    masks = []
    for p in range(1, passes + 1):
        blocks = [diff >= p - 1] + [diff == p - q for q in range(2, p + 1)]
        masks.append(torch.cat(blocks, dim=1))
    return masks


def ttt_mask_cache(passes: int, device):
    """ttt_masks(length, passes, device) for any length, each length's masks made once (training batches come in
    few lengths): length -> [mask [n, p * n] per pass]."""
    cache: dict[int, list[torch.Tensor]] = {}

    def masks(length: int) -> list[torch.Tensor]:
        if length not in cache:
            cache[length] = ttt_masks(length, passes, device)
        return cache[length]

    return masks


def ttt_loss(head, ids: torch.Tensor, feats: torch.Tensor, probs: torch.Tensor, masks, spec: Eagle3Spec):
    """ids [G, T], feats [G, T, 3Ht], probs [G, T, V] -> (weighted loss, per-pass argmax agreement [P]).

    The head's ``step`` (one sequence per call) is vectorised over the G sequences with torch.func.vmap."""
    from torch.func import vmap

    G, T = ids.shape
    n_ent = T - 1
    a = head.cfg.attention
    pos = torch.arange(n_ent, device=ids.device)  # [n] draft position j - 1
    jpos = pos + 1
    labels = probs[:, 1:]  # [G, n, V]
    emb = head.embed(ids[:, 1:])  # [G, n, H]
    feat = head.fuse(feats[:, :-1])  # [G, n, H]
    step = vmap(head.step, in_dims=(0, 0, None, 0, 0, None))
    ks, vs = [], []
    total, agree = 0.0, []
    for p in range(1, spec.ttt_steps + 1):
        past_k = torch.cat(ks, dim=1) if ks else emb.new_zeros(G, 0, a.num_kv_heads, a.head_dim)
        past_v = torch.cat(vs, dim=1) if vs else past_k
        out, k, v = step(emb, feat, pos, past_k, past_v, masks[p - 1])
        ks.append(k)
        vs.append(v)
        logits = head.logits(out)  # [G, n, V]
        valid = jpos >= p  # [n]
        logp = F.log_softmax(logits, dim=-1)
        loss = -(labels * logp).sum(-1)[:, valid].mean()
        total = total + spec.pass_decay ** (p - 1) * loss
        with torch.no_grad():
            agree.append((logits.argmax(-1) == labels.argmax(-1))[:, valid].float().mean())
        # next pass: entry j reads this pass's output at entry j - 1 (of the same sequence)
        feat = torch.cat([out[:, :1], out[:, :-1]], dim=1)
    return total, torch.stack(agree)


def train_eagle3_job(job) -> dict:
    from specserve.draft_service.eagle3_head import save_eagle3_head

    spec = apply_arch(Eagle3Spec(), job.arch)
    layers = default_capture_layers(job.target.config.num_hidden_layers)
    torch.manual_seed(job.seed)
    head = build_head(job.target, spec, layers).to(job.device).train()
    group = min(spec.group, job.batch_size)

    masks = ttt_mask_cache(spec.ttt_steps, job.device)

    def loss_fn(ids, feats, probs):
        return ttt_loss(head, ids, feats, probs, masks(ids.shape[1]), spec)

    run = train_on_target_features(job, head, layers, group, loss_fn, "train_eagle3")
    heldout = heldout_agreement(job, head, layers, group, loss_fn)
    head.to("cpu").to(torch.bfloat16)
    save_eagle3_head(head, job.out_dir, with_embeddings=False)
    return {
        "steps_run": run["steps_run"],
        "stopped_by": run["stopped_by"],
        "train_seconds": run["train_seconds"],
        "capture_layers": list(layers),
        "last_agreement_by_pass": run["last_agreement"],
        "heldout_agreement_by_pass": heldout,
        "arch": asdict(spec),
    }
