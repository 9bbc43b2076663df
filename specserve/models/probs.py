"""The target distribution p of a row of logits, and the per-request generator that samples from it.

Shared by the target's sampler and by every drafter that samples its own proposals, so both read p the same way.
"""

from __future__ import annotations

import torch

from specserve.contract.types import SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """Per-request generator: seeded for reproducible output, else seeded from OS entropy."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [N, V] -> [N, V] f32
    """Target distribution p from logits: temperature, then top-k, then top-p (greedy gives one-hot)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    # shifted by the row max first: a tiny temperature then sends the other logits to -inf (weight 0)
    # instead of overflowing the largest to +inf (NaN after softmax)
    x = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p (the first one stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
