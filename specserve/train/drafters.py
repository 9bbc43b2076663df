"""The one registry of drafter trainers: family name -> function that trains and saves that drafter.

Every trainer gets a ``DraftJob`` (the frozen target, its training stream, the self-distilled greedy
sequences, the device, the logger, family options) and writes its checkpoint folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping

import numpy as np
import torch

from specserve.train.common import Logger, TrainError


@dataclass(frozen=True)
class DraftJob:
    target: object  # transformers DeepseekV3ForCausalLM, frozen
    target_dir: Path
    train_stream: np.ndarray  # [N] int32
    sequences: torch.Tensor  # [S, T] self-distilled greedy sequences
    heldout_sequences: torch.Tensor  # [S', T] the same, from held-out prompts (for reporting)
    out_dir: Path
    device: torch.device
    log: Logger
    steps: int
    batch_size: int
    lr: float
    time_limit_s: float | None
    seed: int
    arch: dict = field(default_factory=dict)  # family architecture overrides {KEY: VALUE string}
    init_from: Path | None = None  # a saved drafter of this family and arch to continue training from


def _train_model(job: DraftJob) -> dict:
    from transformers import LlamaForCausalLM

    from specserve.train.common import apply_arch
    from specserve.train.distill import MixedBatches
    from specserve.train.draft_model import (
        DistillSpec,
        DraftModelSpec,
        train_draft_model,
    )
    from specserve.train.target import save_bf16_pretrained

    spec = apply_arch(DraftModelSpec(vocab_size=job.target.config.vocab_size), job.arch)
    torch.manual_seed(job.seed)
    draft = LlamaForCausalLM(spec.hf_config())
    dspec = DistillSpec(
        steps=job.steps, batch_size=job.batch_size, lr=job.lr, time_limit_s=job.time_limit_s, seed=job.seed
    )
    batches = MixedBatches(job.sequences, job.train_stream, dspec.batch_size, dspec.selfdistill_frac, job.seed)
    summary = train_draft_model(draft, job.target, batches, dspec, job.device, job.log)
    summary["heldout_greedy_agreement"] = heldout_agreement_lm(draft, job)
    save_bf16_pretrained(draft, job.out_dir, keep_fp32=())
    summary["arch"] = spec.__dict__
    return summary


@torch.no_grad()
def heldout_agreement_lm(draft, job: DraftJob) -> float:
    """Share of held-out self-distilled positions where the drafter's argmax equals the target's."""
    from specserve.train.distill import target_outputs

    draft.eval()
    hits, total = 0, 0
    for i in range(0, len(job.heldout_sequences), 64):
        ids = job.heldout_sequences[i : i + 64].to(job.device)
        t_logits, _ = target_outputs(job.target, ids)
        d_logits = draft(input_ids=ids, use_cache=False).logits.float()
        hits += int((d_logits.argmax(-1) == t_logits.argmax(-1)).sum())
        total += ids.numel()
    return hits / max(total, 1)


def _train_eagle3(job: DraftJob) -> dict:
    from specserve.train.draft_eagle3 import train_eagle3_job

    return train_eagle3_job(job)


def _train_dflash(job: DraftJob) -> dict:
    from specserve.train.draft_dflash import train_dflash_job

    return train_dflash_job(job)


def _train_dspark(job: DraftJob) -> dict:
    from specserve.train.draft_dspark import train_dspark_job

    return train_dspark_job(job)


def _train_mtp(job: DraftJob) -> dict:
    from specserve.train.draft_mtp import train_mtp_job

    return train_mtp_job(job)


DRAFT_TRAINERS: Mapping[str, Callable[[DraftJob], dict]] = MappingProxyType(
    {
        "model": _train_model,
        "eagle3": _train_eagle3,
        "dflash": _train_dflash,
        "dspark": _train_dspark,
        "mtp": _train_mtp,
    }
)
RESUMABLE = frozenset({"dflash", "dspark", "mtp"})  # families whose trainer honours DraftJob.init_from


def check_resumable(family: str, init_from: Path | None, out_dir: Path | None = None) -> None:
    if init_from is None:
        return
    if family not in RESUMABLE:
        raise TrainError(f"--init-from is supported for {', '.join(sorted(RESUMABLE))}, not {family!r}")
    if out_dir is not None and Path(init_from).resolve() == Path(out_dir).resolve():
        raise TrainError(f"--init-from and --out are both {out_dir}: write the continued drafter elsewhere")


def train_drafter(family: str, job: DraftJob) -> dict:
    trainer = DRAFT_TRAINERS.get(family)
    if trainer is None:
        raise TrainError(f"unknown drafter family {family!r}; known: {sorted(DRAFT_TRAINERS)}")
    check_resumable(family, job.init_from)
    return trainer(job)
