"""Train a DSpark-style drafter (draft_service/dspark.py): DFlash's block trained as draft_dflash.py trains it, with the
Markov head in its logits and the confidence head beside it.

Alignment as draft_dflash.py's: block output i (anchor a) predicts the token at a + 1 + i. The Markov head reads the
token before it, the one at a + i, teacher-forced: on a greedy-chain block (the only blocks whose outputs count with
``chain_labels``, on by default here) that is the token the drafter itself drafted when drafts 0..i-1 were accepted,
so training sees what serving sees. The loss of the block and the Markov head is draft_dflash's soft cross entropy
(``logits_loss``) of the Markov-corrected logits; the correction applies from output ``markov_from`` on (1 by
default: output 0's previous token is the pending token, the block's own input 0, and its correction only overfit
in issue #43's CPU study; dspark.py's docstring). The confidence head is trained beside it, on detached inputs (it
never pulls the drafter), by binary cross entropy against whether output i's argmax is the target's greedy token,
over the greedy-chain blocks where output i counts: its c_i estimates acceptance of drafted token i given 0..i-1 were
accepted, which is what the verify-length rule (specserve/loop/verify_length.py) reads.

``--init-from DIR``: a saved DSpark drafter (continued), or a DFlash drafter (its block becomes this one's, the Markov
and confidence heads start fresh; its denoise passes are dropped: DSpark drafts in one pass). The block's --arch keys
are draft_dflash's; ``markov_rank`` and ``confidence_weight`` are DSpark's own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F

from specserve.train.common import TrainError, apply_arch
from specserve.train.draft_dflash import (
    DFlashSpec,
    blocks_hidden,
    build_dflash,
    greedy_chain_mask,
    init_from_checkpoint,
    logits_loss,
    resolve_spec,
    train_block_job,
)
from specserve.train.draft_eagle3 import default_capture_layers


@dataclass(frozen=True)
class DSparkSpec:
    markov_rank: int = 32
    confidence_weight: float = 1.0
    markov_from: int = 1  # the first block output the Markov correction applies to (module docstring)

    def __post_init__(self) -> None:
        if self.markov_rank <= 0 or self.confidence_weight < 0 or self.markov_from < 0:
            raise TrainError(f"DSparkSpec: markov_rank must be > 0, confidence_weight and markov_from >= 0, got {self}")


def split_arch(arch: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(DSpark's own --arch keys, the block's: draft_dflash's DFlashSpec)."""
    own = {f.name for f in fields(DSparkSpec)}
    return {k: v for k, v in arch.items() if k in own}, {k: v for k, v in arch.items() if k not in own}


def build_dspark(target, spec: DSparkSpec, block_spec: DFlashSpec, layers: tuple[int, ...]):
    from specserve.draft_service.dspark import DSparkConfig, DSparkModel

    block = build_dflash(target, replace(block_spec, given_tokens=0), layers)
    model = DSparkModel(DSparkConfig(block.cfg, spec.markov_rank, spec.markov_from), block)
    with torch.no_grad():
        torch.nn.init.normal_(model.markov.h_proj.weight, std=0.02)
        torch.nn.init.normal_(model.markov.e_proj.weight, std=0.02)
        model.markov.out.weight.zero_()  # starts as the block alone
        model.confidence.w_z.weight.zero_()
        model.confidence.w_z.bias.zero_()
        model.confidence.w_u.weight.zero_()
        model.confidence.w_lp.fill_(1.0)  # starts rising with q of the drafted token
        model.confidence.w_z.bias.fill_(1.0)
    return model


def init_dspark_from(model, path, target_dir) -> None:
    """Weights of a saved DSpark drafter, or a DFlash drafter's block (module docstring)."""
    import json
    from pathlib import Path

    from specserve.draft_service.drafter_errors import DrafterConfigError
    from specserve.draft_service.dspark import load_dspark

    raw = json.loads((Path(path) / "config.json").read_text()) if (Path(path) / "config.json").is_file() else {}
    if raw.get("model_type") != "dspark":
        init_from_checkpoint(model.block, path, target_dir)  # a DFlash drafter (or the error naming what it is not)
        return
    try:
        saved = load_dspark(path, target_dir=target_dir)
    except DrafterConfigError as e:
        raise TrainError(f"--init-from {path}: {e}") from e
    if saved.spark_cfg != model.spark_cfg:
        raise TrainError(
            f"--init-from {path} has another DSpark config: {saved.spark_cfg} (training {model.spark_cfg})"
        )
    model.load_state_dict(saved.state_dict())


def dspark_logits(model, ids, feats, anchors):
    """ids [G, T], feats [G, T, F], anchors [G, A] -> (z [G, A, b, H], u [G, A, b, r], logits [G, A, b, V] float32): the
    block's rows and its Markov-corrected logits, each output's previous token teacher-forced (module docstring)."""
    b = model.block.cfg.block_size
    z = blocks_hidden(model.block, ids, feats, anchors)  # [G, A, b, H]
    idx = anchors[:, :, None] + torch.arange(b, device=ids.device)  # [G, A, b] label positions a + i
    prev = torch.gather(ids, 1, idx.reshape(ids.shape[0], -1)).view_as(idx)  # the token before output i
    u, delta = model.markov(z, model.block.embed_tokens(prev))
    first = model.spark_cfg.markov_from
    if first:  # outputs before markov_from get no correction, as dspark.py drafts them
        delta = torch.cat([torch.zeros_like(delta[:, :, :first]), delta[:, :, first:]], dim=2)
    return z, u, model.block.lm_head(z).float() + delta


def dspark_loss(model, ids, feats, probs, greedy, anchors, decay: float, confidence_weight: float):
    """(block + Markov soft cross entropy + confidence_weight x confidence BCE, agreement [b] on the chain blocks)."""
    b = model.block.cfg.block_size
    z, u, logits = dspark_logits(model, ids, feats, anchors)
    idx = anchors[:, :, None] + torch.arange(b, device=ids.device)  # [G, A, b] label positions a + i
    loss, agree = logits_loss(logits, ids, probs, greedy, anchors, decay, chain_labels=True)
    with torch.no_grad():
        lp, drafted = torch.log_softmax(logits, dim=-1).max(dim=-1)  # [G, A, b] log q of the greedy draft
        target = torch.gather(greedy, 1, idx.reshape(ids.shape[0], -1)).view_as(idx)
        hit = (drafted == target).float()
        counted = greedy_chain_mask(ids, greedy, idx).float()
    c_logit = model.confidence.logit(z.detach(), u.detach(), lp)
    bce = F.binary_cross_entropy_with_logits(c_logit, hit, reduction="none")
    bce = (bce * counted).sum() / counted.sum().clamp_min(1.0)
    return loss + confidence_weight * bce, agree


def train_dspark_job(job) -> dict:
    from specserve.draft_service.dspark import save_dspark

    own, block_arch = split_arch(job.arch)
    spec = apply_arch(DSparkSpec(), own)
    block_spec = resolve_spec(apply_arch(DFlashSpec(chain_labels=True), block_arch), job.target.config)
    if block_spec.given_tokens:
        raise TrainError("dspark drafts its block in one pass: --arch given_tokens does not apply")
    layers = default_capture_layers(job.target.config.num_hidden_layers)
    torch.manual_seed(job.seed)
    model = build_dspark(job.target, spec, block_spec, layers)
    if job.init_from is not None:
        init_dspark_from(model, job.init_from, job.target_dir)

    def loss(ids, feats, probs, greedy, anchors, gen):
        return dspark_loss(model, ids, feats, probs, greedy, anchors, block_spec.position_decay, spec.confidence_weight)

    return train_block_job(
        job, model, block_spec, layers, loss, "train_dspark", save_dspark, dict(asdict(block_spec), **asdict(spec))
    )
