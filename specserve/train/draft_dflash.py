"""Train a DFlash-style block drafter (helper C's ``DFlashModel``, draft_service/dflash.py).

The proposer's alignment: for a pending token at position a, the context is the target's features of
positions 0..a-1 (fused by ``fc``, one K/V per draft layer); the block's queries are
[embed(t_a), mask, ..., mask] at positions a..a+b-1, non-causal inside the block, each seeing the whole
context; output i predicts the token at position a+1+i, i.e. the target's next-token distribution at
position a+i (teacher-forced soft labels, weighted ``decay**i``).

Training runs many blocks (random anchors a) of many sequences in one pass. ``blocks_logits`` is the
batched form of ``DFlashModel.block_logits`` — the same submodules applied to all blocks at once (each
block: context keys of its own sequence before its anchor + its own keys);
tests/specserve/test_train_dflash.py checks it against ``block_logits`` block by block.

Greedy-chain labels (``--arch chain_labels=1``). At temperature 0, output i only counts when drafts
0..i-1 were accepted, i.e. when tokens a+1..a+i are the target's own greedy tokens; its label should be
the target's distribution at a+i given that chain. A training sequence gives it only where its tokens
a+1..a+i happen to equal the target's argmax at the position before each; elsewhere (real text the
target would not have written) the label is conditioned on tokens the drafter cannot see. With
``chain_labels`` the loss of output i is taken only over blocks whose tokens a+1..a+i are on the
greedy chain (output 0 always counts). The reported agreement of output i is always over those
blocks: the chance that draft i is accepted given drafts 0..i-1 were.

Chain anchors (``--arch chain_anchors=F``). At temperature 0 every block the proposer meets is a
greedy-chain block: its anchor sits in text the target wrote itself. A share F of each sequence's
anchors is drawn among positions whose tokens a+1..a+b-1 are all on the greedy chain (the rest
uniformly), so most of the compute goes to the blocks decoding meets. Default 0 = uniform anchors.

Given tokens (``--arch given_tokens=g``). Each block draws m uniformly from 0..g and has its true
tokens a+1..a+m in place of the first m masks; outputs 0..m-1 (whose answers are given) carry no loss,
and output i >= m needs tokens a+m+1..a+i on the greedy chain under ``chain_labels``. The saved drafter
then drafts in g + 1 passes (``denoise_steps``, draft_service/dflash.py). Default 0 = one pass.

``--arch shared_target_head=1``: the drafter uses the target's token embeddings and lm_head (copied,
frozen, not saved: the proposer reads them from the target checkpoint) and the target's hidden size
(``hidden_size`` is then ignored); its own final norm starts from the target's. Default 0 = the
shipped layout with the drafter's own embeddings and lm_head.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from specserve.train.common import TrainError, apply_arch
from specserve.train.draft_eagle3 import default_capture_layers
from specserve.train.feature_distill import heldout_agreement, train_on_target_features

_FLAGS = ("shared_target_head", "chain_labels")  # the 0/1 fields of DFlashSpec
_SHARES = ("chain_anchors",)  # the fields in [0, 1]
_COUNTS = ("given_tokens",)  # the fields >= 0


@dataclass(frozen=True)
class DFlashSpec:
    hidden_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 48
    intermediate_size: int = 448
    block_size: int = 5
    anchors: int = 64  # random anchors per sequence per step
    group: int = 64  # sequences per pass
    position_decay: float = 0.8
    shared_target_head: bool = False  # 1 = read the target's embeddings + lm_head (see the module docstring)
    chain_labels: bool = False  # 1 = train output i only on greedy-chain blocks (see the module docstring)
    chain_anchors: float = 0.0  # share of anchors drawn on greedy-chain blocks (see the module docstring)
    given_tokens: int = 0  # most true tokens a block is given in training (see the module docstring)

    def __post_init__(self) -> None:
        for name in _FLAGS:
            value = getattr(self, name)
            if value not in (0, 1):  # apply_arch gives an int
                raise TrainError(f"DFlashSpec.{name} must be 0 or 1, got {value!r}")
            object.__setattr__(self, name, bool(value))
        for name in _SHARES:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise TrainError(f"DFlashSpec.{name} must be in [0, 1], got {getattr(self, name)}")
        for name, value in asdict(self).items():
            if name not in _FLAGS + _SHARES + _COUNTS and not value > 0:
                raise TrainError(f"DFlashSpec.{name} must be > 0, got {value}")
        if self.block_size < 2:
            raise TrainError("block_size must be >= 2")
        if not 0 <= self.given_tokens <= self.block_size - 2:
            raise TrainError(
                f"DFlashSpec.given_tokens must be in 0..block_size - 2 = {self.block_size - 2}, got {self.given_tokens}"
            )


def resolve_spec(spec: DFlashSpec, target_config) -> DFlashSpec:
    """The spec actually built: with a shared target head the hidden size is the target's."""
    if spec.shared_target_head and spec.hidden_size != target_config.hidden_size:
        return replace(spec, hidden_size=target_config.hidden_size)
    return spec


def _target_head(target) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, Ht], lm_head [V, Ht]) of the trainer's (transformers) target, float32 on CPU."""
    embed = target.model.embed_tokens.weight
    lm_head = embed if getattr(target, "lm_head", None) is None else target.lm_head.weight
    shape = (target.config.vocab_size, target.config.hidden_size)
    for name, w in (("embed_tokens", embed), ("lm_head", lm_head)):
        if tuple(w.shape) != shape:
            raise TrainError(f"shared_target_head: the target's {name} is {tuple(w.shape)}, expected {shape}")
    return embed.detach().float().cpu(), lm_head.detach().float().cpu()


def build_dflash(target, spec: DFlashSpec, layers: tuple[int, ...]):
    from specserve.draft_service.dflash import DFlashConfig, DFlashModel

    spec = resolve_spec(spec, target.config)
    cfg = DFlashConfig(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        vocab_size=target.config.vocab_size,
        block_size=spec.block_size,
        target_hidden_size=target.config.hidden_size,
        target_layer_ids=layers,
        shared_target_head=spec.shared_target_head,
        denoise_steps=spec.given_tokens + 1,
    )
    model = DFlashModel(cfg)  # shared: embed_tokens / lm_head already frozen
    with torch.no_grad():
        torch.nn.init.normal_(model.mask_embedding, std=0.02)
        if spec.shared_target_head:
            embed, lm_head = _target_head(target)
            model.embed_tokens.weight.copy_(embed)
            model.lm_head.weight.copy_(lm_head)
            model.norm.weight.copy_(target.model.norm.weight.detach().float().cpu())
    return model


def init_from_checkpoint(model, path, target_dir) -> None:
    """Copy the weights of a saved DFlash drafter into ``model`` (continuing its training); the saved
    config must equal the one being trained."""
    from specserve.draft_service.dflash import load_dflash
    from specserve.draft_service.drafter_errors import DrafterConfigError

    try:
        saved = load_dflash(path, target_dir=target_dir)
    except DrafterConfigError as e:
        raise TrainError(f"--init-from {path}: {e}") from e
    diff = [
        f"{k} {getattr(saved.cfg, k)!r} (training {getattr(model.cfg, k)!r})"
        for k in model.cfg.__dataclass_fields__
        if k != "denoise_steps" and getattr(saved.cfg, k) != getattr(model.cfg, k)
    ]  # same weights either way
    if diff:
        raise TrainError(f"--init-from {path} has another DFlash config: {'; '.join(diff)}")
    state = model.state_dict()
    with torch.no_grad():
        for name, value in saved.state_dict().items():
            state[name].copy_(value)


def blocks_logits(
    model, ids: torch.Tensor, feats: torch.Tensor, anchors: torch.Tensor, given: torch.Tensor | None = None
) -> torch.Tensor:
    """ids [G, T], feats [G, T, F], anchors [G, A] (1 <= a <= T - b), given [G, A] int (m: the block's
    true tokens a+1..a+m replace its first m masks; None = 0) -> logits [G, A, b, V] float32."""
    return model.lm_head(blocks_hidden(model, ids, feats, anchors, given)).float()


def blocks_hidden(
    model, ids: torch.Tensor, feats: torch.Tensor, anchors: torch.Tensor, given: torch.Tensor | None = None
) -> torch.Tensor:
    """blocks_logits' rows before the output head: [G, A, b, H] final-normed (the arguments are blocks_logits').

    Each block attends to its own sequence's context keys before its anchor plus its own b keys. The
    context part is one batched matmul per sequence (all A * b queries against its T context keys,
    masked at each block's anchor), so no per-block copy of the context K/V is made; the block part is
    b x b per block; one softmax spans both."""
    from specserve.models.rope import RotaryEmbedding

    c, b = model.cfg, model.cfg.block_size
    G, T = ids.shape
    A = anchors.shape[1]
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    r = hq // hkv  # query heads per key head
    dev = ids.device
    ctx_kv = model.context_kv(feats.reshape(G * T, -1), torch.arange(T, device=dev).repeat(G))
    pos = anchors[:, :, None] + torch.arange(b, device=dev)  # [G, A, b]
    known = torch.gather(ids, 1, pos.reshape(G, -1)).view(G, A, b)  # tokens a .. a+b-1
    shown = torch.arange(b, device=dev) == 0  # [b] the pending token
    if given is not None:
        shown = torch.arange(b, device=dev) <= given[:, :, None]  # [G, A, b]
    x = torch.where(shown.expand(G, A, b)[..., None], model.embed_tokens(known), model.mask_embedding)
    q_pos = pos.reshape(-1)  # [G*A*b]
    cos, sin = model.rotary.cos_sin(q_pos, x.dtype)
    hidden = torch.arange(T, device=dev)[None, None, :] >= anchors[:, :, None]  # [G, A, T] not yet context
    hidden = hidden[:, :, None, None, None, :]  # [G, A, 1, 1, 1, T]
    n = G * A * b
    for layer, (ck, cv) in zip(model.layers, ctx_kv):
        h = layer.input_layernorm(x)
        q = RotaryEmbedding.apply(layer.q_proj(h).view(n, hq, d), cos, sin, False).view(G, A, b, hkv, r, d)
        k = RotaryEmbedding.apply(layer.k_proj(h).view(n, hkv, d), cos, sin, False).view(G, A, b, hkv, d)
        v = layer.v_proj(h).view(G, A, b, hkv, d)
        ck, cv = ck.view(G, T, hkv, d), cv.view(G, T, hkv, d)
        s_ctx = torch.einsum("gaihrd,gthd->gaihrt", q, ck).masked_fill(hidden, float("-inf"))
        s_blk = torch.einsum("gaihrd,gajhd->gaihrj", q, k)
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1) * d**-0.5, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.einsum("gaihrt,gthd->gaihrd", p[..., :T], cv) + torch.einsum("gaihrj,gajhd->gaihrd", p[..., T:], v)
        x = x + layer.o_proj(out.reshape(G, A, b, hq * d))
        y = layer.post_attention_layernorm(x)
        x = x + layer.down_proj(F.silu(layer.gate_proj(y)) * layer.up_proj(y))
    return model.norm(x)  # [G, A, b, H]


def chain_follows(ids: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """ids [G, T], greedy [G, T] (the target's argmax next token after each position) -> [G, T] bool:
    token t is the target's greedy pick after token t - 1 (token 0 counts as True)."""
    follows = torch.ones_like(ids, dtype=torch.bool)
    follows[:, 1:] = ids[:, 1:] == greedy[:, :-1]
    return follows


def greedy_chain_mask(
    ids: torch.Tensor, greedy: torch.Tensor, idx: torch.Tensor, given: torch.Tensor | None = None
) -> torch.Tensor:
    """ids [G, T], greedy [G, T], idx [G, A, b] label positions a + i, given [G, A] (m; None = 0) ->
    [G, A, b] bool: the tokens output i does not see, a+m+1..a+i, all equal the target's argmax at the
    position before (outputs 0..m are always True)."""
    follows = chain_follows(ids, greedy)
    on_chain = torch.gather(follows, 1, idx.reshape(ids.shape[0], -1)).view_as(idx)
    on_chain[..., 0] = True  # output 0 follows the pending token, which is given
    if given is not None:
        on_chain |= torch.arange(idx.shape[-1], device=idx.device) <= given[:, :, None]
    return on_chain.cumprod(-1).bool()


def block_loss(
    model,
    ids,
    feats,
    probs,
    greedy,
    anchors,
    decay: float,
    chain_labels: bool = False,
    given: torch.Tensor | None = None,
):
    """ids [G, T], feats [G, T, F], probs [G, T, V], greedy [G, T] (probs' argmax: the target's next
    token after each position), anchors [G, A], given [G, A] or None ->
    (weighted soft cross entropy, agreement [b] of each block output on the greedy-chain blocks where
    it counts, on the device). Outputs whose answer is given (i < m) count nowhere."""
    return logits_loss(
        blocks_logits(model, ids, feats, anchors, given), ids, probs, greedy, anchors, decay, chain_labels, given
    )


def logits_loss(
    logits, ids, probs, greedy, anchors, decay: float, chain_labels: bool = False, given: torch.Tensor | None = None
):
    """block_loss of the blocks' logits [G, A, b, V] (the other arguments are block_loss')."""
    b = logits.shape[2]
    idx = anchors[:, :, None] + torch.arange(b, device=ids.device)  # [G, A, b] label positions a + i
    labels = torch.gather(probs, 1, idx.reshape(ids.shape[0], -1, 1).expand(-1, -1, probs.shape[-1]))
    labels = labels.view_as(logits)
    asked = torch.ones_like(idx, dtype=torch.bool)  # [G, A, b] outputs whose answer is not given
    if given is not None:
        asked = torch.arange(b, device=ids.device) >= given[:, :, None]
    chain = (greedy_chain_mask(ids, greedy, idx, given) & asked).float()  # [G, A, b]
    ce = -(labels * F.log_softmax(logits, dim=-1)).sum(-1)  # [G, A, b]
    counted = chain if chain_labels else asked.float()
    ce = (ce * counted).sum(dim=(0, 1)) / counted.sum(dim=(0, 1)).clamp_min(1.0)  # [b]
    w = decay ** torch.arange(b, device=ids.device, dtype=ce.dtype)
    with torch.no_grad():
        target_tokens = torch.gather(greedy, 1, idx.reshape(ids.shape[0], -1)).view_as(idx)  # argmax of labels
        hits = (logits.argmax(-1) == target_tokens).float() * chain
        agree = hits.sum(dim=(0, 1)) / chain.sum(dim=(0, 1)).clamp_min(1.0)
    return (w * ce).sum() / w.sum(), agree


def sample_anchors(gen: torch.Generator, ids: torch.Tensor, greedy: torch.Tensor, spec: DFlashSpec) -> torch.Tensor:
    """ids [G, T], greedy [G, T] -> anchors [G, A] in 1..T-b on ids' device (``gen`` lives there too): a
    share ``spec.chain_anchors`` drawn among full greedy-chain blocks (a sequence without one draws
    those uniformly too), the rest uniform."""
    G, T = ids.shape
    b = spec.block_size
    hi = T - b  # a <= T - b so that labels a + b - 1 <= T - 1
    if hi < 1:
        raise TrainError(f"sequences of {T} tokens are too short for blocks of {b}")
    n_chain = round(spec.anchors * spec.chain_anchors)
    anchors = [torch.randint(1, hi + 1, (G, spec.anchors - n_chain), generator=gen, device=ids.device)]
    if n_chain:
        follows = chain_follows(ids, greedy)[:, 2:]  # tokens 2..T-1 (those after anchors 1..)
        full = follows.unfold(1, b - 1, 1).all(-1)[:, :hi]  # [G, hi]: tokens a+1..a+b-1, anchor a = 1..hi
        weights = full.float() + 1e-6  # no chain block in a sequence: uniform
        anchors.append(1 + torch.multinomial(weights, n_chain, replacement=True, generator=gen))
    return torch.cat(anchors, dim=1)


def train_dflash_job(job) -> dict:
    from specserve.draft_service.dflash import save_dflash

    spec = resolve_spec(apply_arch(DFlashSpec(), job.arch), job.target.config)
    layers = default_capture_layers(job.target.config.num_hidden_layers)
    torch.manual_seed(job.seed)
    model = build_dflash(job.target, spec, layers)
    if job.init_from is not None:
        init_from_checkpoint(model, job.init_from, job.target_dir)

    def loss(ids, feats, probs, greedy, anchors, gen):
        given = None
        if spec.given_tokens:
            given = torch.randint(0, spec.given_tokens + 1, anchors.shape, generator=gen, device=ids.device)
        return block_loss(model, ids, feats, probs, greedy, anchors, spec.position_decay, spec.chain_labels, given)

    return train_block_job(job, model, spec, layers, loss, "train_dflash", save_dflash, asdict(spec))


def train_block_job(
    job, model, spec: DFlashSpec, layers: tuple[int, ...], loss, log_name: str, save, arch: dict
) -> dict:
    """The run a block drafter's trainer (DFlash's, DSpark's: draft_dspark.py) shares: ``model`` trained on the device
    with ``loss(ids, feats, probs, greedy, anchors, gen) -> (loss, agreement)`` over anchors drawn per group
    (``sample_anchors``), its held-out agreement measured, then saved in bfloat16 by ``save(model, out_dir)``."""
    model = model.to(job.device).train()
    group = min(spec.group, job.batch_size)

    def loss_with_anchors(seed: int):
        gen = torch.Generator(device=job.device).manual_seed(seed)

        def loss_fn(ids, feats, probs):
            greedy = probs.argmax(-1)  # [G, T]
            return loss(ids, feats, probs, greedy, sample_anchors(gen, ids, greedy, spec), gen)

        return loss_fn

    run = train_on_target_features(job, model, layers, group, loss_with_anchors(job.seed), log_name)
    heldout = heldout_agreement(job, model, layers, group, loss_with_anchors(job.seed + 7))
    model.to("cpu").to(torch.bfloat16)
    save(model, job.out_dir)
    return {
        "steps_run": run["steps_run"],
        "stopped_by": run["stopped_by"],
        "train_seconds": run["train_seconds"],
        "target_layer_ids": list(layers),
        "last_agreement_by_position": run["last_agreement"],
        "heldout_agreement_by_position": heldout,
        "arch": arch,
    }
