"""Train the ``model`` drafter: a small dense LlamaForCausalLM (same tokenizer as the target), distilled
from the target's soft next-token distributions on self-distilled greedy sequences and corpus text."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from specserve.train.common import (
    Logger,
    Progress,
    Schedule,
    TrainError,
    autocast,
    make_optimizer,
)
from specserve.train.distill import MixedBatches, target_outputs
from specserve.train.tokenizer import EOS_ID


@dataclass(frozen=True)
class DraftModelSpec:
    vocab_size: int = 4096
    hidden_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise TrainError(f"DraftModelSpec.{name} must be > 0, got {value}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise TrainError("hidden_size % num_heads and num_heads % num_kv_heads must be 0")

    def hf_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=True,
            bos_token_id=EOS_ID,
            eos_token_id=EOS_ID,
        )


@dataclass(frozen=True)
class DistillSpec:
    steps: int = 1500
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.05
    warmup: int = 100
    grad_clip: float = 1.0
    selfdistill_frac: float = 0.75
    time_limit_s: float | None = None
    seed: int = 2

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise TrainError("steps and batch_size must be >= 1")

    def schedule(self) -> Schedule:
        return Schedule(self.lr, self.steps, self.warmup, time_limit_s=self.time_limit_s)


def soft_ce(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Cross entropy against the target's distribution (= KL(p_target || q) + const): [..., V]."""
    return -(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


@torch.no_grad()
def greedy_agreement(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> float:
    return float((draft_logits.argmax(-1) == target_logits.argmax(-1)).float().mean())


def train_draft_model(
    draft, target, batches: MixedBatches, spec: DistillSpec, device: torch.device, log: Logger
) -> dict:
    draft.to(device).train()
    opt = make_optimizer(draft.parameters(), spec.lr, spec.weight_decay, device)
    sched = spec.schedule()
    progress = Progress("train draft_model", spec.steps, 0, spec.time_limit_s)
    t0 = time.monotonic()
    step, agree = 0, float("nan")
    while True:
        lr = sched.set_lr(opt, step, time.monotonic() - t0)
        if lr is None:
            break
        ids = batches.next().to(device)  # [B, T]
        t_logits, _ = target_outputs(target, ids)
        probs = t_logits.softmax(-1)
        with autocast(device):
            d_logits = draft(input_ids=ids, use_cache=False).logits
        loss = soft_ce(d_logits, probs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), spec.grad_clip)
        opt.step()
        step += 1
        progress.tokens_per_step = ids.numel()
        if step % 50 == 0 or step == 1:
            agree = greedy_agreement(d_logits.detach(), t_logits)
            log("train_draft_model", step=step, loss=float(loss.detach()), greedy_agreement=agree, lr=lr)
            progress.step(step, float(loss.detach()))
        else:
            progress.step(step)
    progress.close()
    return {
        "steps_run": step,
        "stopped_by": "steps" if step >= spec.steps else "time_limit",
        "train_seconds": round(time.monotonic() - t0, 1),
        "last_loss": float(loss.detach()),
        "last_greedy_agreement": agree,
    }
