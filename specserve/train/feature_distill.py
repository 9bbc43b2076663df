"""The training loop shared by drafters that read target hidden features (EAGLE-3, DFlash).

Each step takes a batch of self-distilled and plain sequences, runs the target once for its soft
next-token distributions and the features of the drafter's layers, and trains the drafter in groups of
``group`` sequences on ``loss_fn(ids[G, T], feats[G, T, F], probs[G, T, V]) -> (loss, agreement [P])``.
The agreement stays on the device and is read only when logged: a per-step read would make the host
wait for the GPU every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specserve.train.common import Progress, Schedule, autocast, make_optimizer
from specserve.train.distill import MixedBatches, target_outputs

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def train_on_target_features(job, module: torch.nn.Module, layers, group: int, loss_fn: LossFn, log_name: str) -> dict:
    """Run the schedule of ``job`` (steps and time limit); return steps run, stop reason, time, last agreement."""
    batches = MixedBatches(job.sequences, job.train_stream, job.batch_size, 0.75, job.seed)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = make_optimizer(params, job.lr, 0.0, job.device)
    sched = Schedule(job.lr, job.steps, min(50, job.steps // 10 + 1), time_limit_s=job.time_limit_s)
    progress = Progress(log_name.replace("_", " "), job.steps, 0, job.time_limit_s)
    t0, step, agree = time.monotonic(), 0, None
    while True:
        lr = sched.set_lr(opt, step, time.monotonic() - t0)
        if lr is None:
            break
        ids = batches.next()
        ids = (ids.pin_memory() if job.device.type == "cuda" else ids).to(job.device, non_blocking=True)
        logits, feats = target_outputs(job.target, ids, layers)
        probs = logits.softmax(-1)
        opt.zero_grad(set_to_none=True)
        for i in range(0, len(ids) - group + 1, group):
            with autocast(job.device):
                loss, agree = loss_fn(ids[i : i + group], feats[i : i + group], probs[i : i + group])
            (loss * group / len(ids)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step == 1:  # the only host reads of the loss (a GPU sync)
            loss_val = float(loss.detach())
            job.log(log_name, step=step, loss=loss_val, lr=lr, agreement=_rounded(agree, 3))
            progress.tokens_per_step = ids.numel()
            progress.step(step, loss_val)
        else:
            progress.step(step)
    progress.close()
    return {
        "steps_run": step,
        "stopped_by": "steps" if step >= job.steps else "time_limit",
        "train_seconds": round(time.monotonic() - t0, 1),
        "last_agreement": _rounded(agree, 3),
    }


def _rounded(agree: torch.Tensor | None, digits: int) -> list[float]:
    return [] if agree is None else [round(a, digits) for a in agree.tolist()]


@torch.no_grad()
def heldout_agreement(job, module: torch.nn.Module, layers, group: int, loss_fn: LossFn) -> list[float]:
    """Mean per-position (or per-pass) argmax agreement with the target on the held-out sequences."""
    module.eval()
    seqs = job.heldout_sequences
    sums, n = None, 0
    for i in range(0, len(seqs) - group + 1, group):
        ids = seqs[i : i + group].to(job.device)
        logits, feats = target_outputs(job.target, ids, layers)
        with autocast(job.device):
            _, agree = loss_fn(ids, feats, logits.softmax(-1))
        sums = agree if sums is None else sums + agree
        n += 1
    module.train()
    return _rounded(None if sums is None else sums / n, 4)
