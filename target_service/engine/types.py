"""Plain data that crosses the engine boundary (no model code here).

Speculative-decoding glossary, used unchanged in code, protos, metric names and span attributes:

- **pending token**: the newest emitted token of a sequence. It has been sampled by the target but
  its K/V is not in the target's cache yet; the next verify step feeds it first.
- **drafted** tokens: the block (chain or tree) a proposer offers after the pending token.
- **accepted** tokens: the longest prefix (tree: root-to-leaf path) of drafted tokens that the
  target's acceptance rule keeps. Their K/V stays in the cache.
- **rejected** tokens: drafted tokens after the first refusal. They never become visible: the
  sequence length stops before them and their cache slots are reused.
- **recovered** token: the token the target samples at the first refused position, from the
  residual distribution norm(max(0, p - q)) (greedy: the target argmax).
- **bonus** token: the token sampled from the target after the last drafted token when every drafted
  token was accepted.
- **emitted** tokens of a step: accepted + one (recovered or bonus). The recovered or bonus token
  becomes the new pending token. "Accepted length" of a step = accepted + 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DraftBlock:
    """Drafted tokens offered after the pending token.

    A chain has ``parents is None`` (token i follows token i-1; token 0 follows the pending token).
    A tree gives ``parents[i]`` = index of the parent node, or -1 for a child of the pending token;
    parents always come before children (``parents[i] < i``).
    """

    token_ids: tuple[int, ...]  # [n]
    parents: tuple[int, ...] | None = None  # [n] or None for a chain
    probs: torch.Tensor | None = None  # [n, vocab] float32 draft distribution q of each node; None = one-hot

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.parents is not None:
            if len(self.parents) != n:
                raise ValueError(f"parents has {len(self.parents)} entries for {n} tokens")
            for i, p in enumerate(self.parents):
                if not -1 <= p < i:
                    raise ValueError(f"parents[{i}] = {p} must be in [-1, {i})")
        if self.probs is not None and tuple(self.probs.shape[:1]) != (n,):
            raise ValueError(f"probs has shape {tuple(self.probs.shape)} for {n} tokens")

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StepTimings:
    queue_ms: float = 0.0
    forward_ms: float = 0.0
    sample_ms: float = 0.0


@dataclass(frozen=True)
class PrefillResult:
    next_token: int  # the first pending token, sampled from the prompt's last position
    hidden: torch.Tensor | None  # [prompt_len, len(hidden_layers) * hidden_size] or None
    timings: StepTimings = field(default_factory=StepTimings)


@dataclass(frozen=True)
class VerifyResult:
    accepted_ids: tuple[int, ...]  # accepted drafted tokens, in sequence order
    next_token: int  # recovered or bonus token: the new pending token
    # [1 + len(accepted_ids), len(hidden_layers) * hidden_size]: features of the old pending token
    # and the accepted tokens (the positions whose K/V this step committed), or None
    hidden: torch.Tensor | None
    num_drafted: int = 0
    experts_touched: int = 0  # distinct routed experts the verify forward read (summed over MoE layers)
    timings: StepTimings = field(default_factory=StepTimings)

    @property
    def emitted(self) -> tuple[int, ...]:
        return self.accepted_ids + (self.next_token,)
