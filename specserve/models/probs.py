"""The target distribution p of a row of logits, and the per-request generator that samples from it.

Shared by the target's sampler and by every drafter that samples its own proposals, so both read p the same way.

What a request's seed guarantees: the target draws from a generator seeded with ``derive_seed(key, seed)``,
an HMAC of the seed under a secret key of the target's own (``SEED_KEY_ENV`` pins it; else each engine
draws one), so the same seed gives the same draws on that target (the same output, for the same
proposals), and nobody without the key, a drafter that was handed or guessed the seed included, can
predict them: a proposal chosen from the request cannot aim the acceptance test or the recovery draw.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import torch

from specserve.contract.types import SamplingParams

SEED_KEY_ENV = "SPECSERVE_SEED_KEY"  # hex, >= 16 bytes: the target's seed key (targets that share it agree)
SEED_KEY_BYTES = 32
MIN_SEED_KEY_BYTES = 16


def new_seed_key() -> bytes:
    return secrets.token_bytes(SEED_KEY_BYTES)


def seed_key_from_hex(text: str) -> bytes:
    """A pinned seed key (``SEED_KEY_ENV``); ValueError naming the problem."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{SEED_KEY_ENV}: not hex") from None
    if len(key) < MIN_SEED_KEY_BYTES:
        raise ValueError(f"{SEED_KEY_ENV}: {len(key)} bytes, at least {MIN_SEED_KEY_BYTES} needed")
    return key


def derive_seed(key: bytes, seed: int) -> int:
    """The generator seed of a seeded request: HMAC-SHA256(key, seed), 63 bits of it."""
    digest = hmac.new(key, str(int(seed)).encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def make_generator(seed: int | None, device: torch.device | str = "cpu", key: bytes | None = None) -> torch.Generator:
    """Per-request generator: for a seeded request seeded with ``derive_seed(key, seed)`` (reproducible
    wherever the key is the same, unpredictable without it), else seeded from OS entropy. ``key=None``
    seeds with the request's seed itself (a drafter's own stream, or tests that need none)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed) if key is None else derive_seed(key, seed))
    return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [N, V] -> [N, V] f32
    """Target distribution p from logits: temperature, then top-k, then top-p (greedy gives one-hot)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    x = _tempered(logits, params.temperature)
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


def device_target_probs(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # 0-dim float32, > 0
    top_k: torch.Tensor,  # 0-dim float32 holding an integer; 0 (or >= V) = off
    top_p: torch.Tensor,  # 0-dim float32; 1.0 = off
) -> torch.Tensor:  # [N, V] float32
    """target_probs for a sampled request, with no host branch and no host read (the parameters device scalars: a
    captured CUDA graph serves every sampled request, draft_service/graph_sampling.py)."""
    x = _tempered(logits.float(), temperature)
    n, vocab = x.shape
    k = top_k.long()
    kth = x.sort(dim=-1, descending=True).values.gather(-1, (k - 1).clamp(0, vocab - 1).expand(n, 1))  # [N, 1]
    x = x.masked_fill(((k > 0) & (k < vocab)) & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    return torch.where(top_p < 1.0, _nucleus(probs, top_p), probs)


def _tempered(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:  # [N, V] f32 -> [N, V]
    # shifted by the row max first: a tiny temperature then sends the other logits to -inf (weight 0)
    # instead of overflowing the largest to +inf (NaN after softmax)
    return (logits - logits.max(dim=-1, keepdim=True).values) / temperature


def _nucleus(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:  # [N, V] -> [N, V], renormalised
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # drop a token when the mass strictly before it already reaches top_p (the first one stays)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)
