"""Sampling helpers shared by the model-based drafters (model, eagle3, dflash).

q, the distribution a drafted token is drawn from, comes from the request's SamplingParams through
the target sampler's own transform (temperature, then top-k, then top-p), so the target's lossless
rule sees the exact distribution the token was drawn from. Greedy requests draw the argmax and report
``probs=None`` (one-hot, which is what the token was drawn from; the target uses the greedy rule).
"""

from __future__ import annotations

import torch

from specserve.contract.types import SamplingParams
from specserve.models.probs import target_probs


def sampling_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:  # [N, V] -> [N, V] f32
    """The distribution a sampled draft token is drawn from (the target sampler's transform)."""
    return target_probs(logits.float(), sampling)


def draw_tokens(
    logits: torch.Tensor,  # [N, Vd] draft logits
    sampling: SamplingParams,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [N] int64 (draft ids), q [N, Vd] f32 or None
    """One draw per row: argmax when greedy (q None), else a sample from q."""
    if sampling.greedy:
        return logits.argmax(dim=-1), None
    q = sampling_probs(logits, sampling)
    tokens = torch.multinomial(q.to(generator.device), 1, generator=generator).squeeze(1)
    return tokens.to(logits.device), q


def to_target_probs(
    q: torch.Tensor,  # [N, Vd] over the draft vocabulary (a device tensor is read back here)
    vocab_size: int,  # the target's
    draft_to_target: torch.Tensor
    | None = None,  # [Vd] int64 target id of each draft id (host, or read back); None = same ids
) -> torch.Tensor:  # [N, vocab_size] float32 on the CPU
    q = q.float()
    if q.device.type != "cpu":
        q = q.cpu()
    if draft_to_target is None:
        vd = q.shape[-1]
        if vd >= vocab_size:
            return q[:, :vocab_size].contiguous()
        return torch.nn.functional.pad(q, (0, vocab_size - vd))
    if draft_to_target.device.type != "cpu":
        draft_to_target = draft_to_target.cpu()
    out = torch.zeros(q.shape[0], vocab_size, dtype=torch.float32)
    out[:, draft_to_target] = q
    return out
