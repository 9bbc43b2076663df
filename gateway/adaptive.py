"""MoE-aware adaptive speculation: pick the block size that maximises emitted tokens per second.

Verify cost on an MoE target grows with the distinct experts a step reads, not only with its token
count, so the cost model is fitted on both:

    verify_ms(n, e) ~= a + b * n + c * e        n = tokens in the forward (pending + drafted)
                                               e = distinct (layer, expert) pairs the router chose
    experts(n)      ~= running mean of e over past steps with n tokens (interpolated when unseen)

Expected emitted tokens of a chain of length k, with alpha_i the chance that drafted position i is
accepted given positions < i were:

    E[emitted | k] = 1 + sum_{i=1..k} prod_{j<=i} alpha_j

alpha_i comes from the drafter's own confidence when it sent probabilities (q of the drafted token),
else from a running per-position acceptance estimate. The chosen k maximises
E[emitted | k] / (draft_ms(k) + verify_ms(k + 1, experts(k + 1))). Only which tokens are verified
changes; the acceptance rule does not, so the output distribution is untouched.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AdaptiveConfig:
    max_k: int = 8
    window: int = 256  # steps the cost model is fitted on
    refit_every: int = 16
    prior_accept: float = 0.6  # acceptance estimate before any observation
    ema: float = 0.1  # weight of the newest observation in the per-position estimate

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")


class VerifyCostModel:
    """Least-squares fit of verify time on (tokens, distinct experts), refreshed as steps arrive."""

    def __init__(self, window: int = 256, refit_every: int = 16) -> None:
        self._obs: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._refit_every = refit_every
        self._since_fit = 0
        self.coef = np.zeros(3)  # a, b, c
        self._experts_by_n: dict[int, tuple[float, int]] = {}

    def observe(self, n_tokens: int, experts: int, ms: float) -> None:
        self._obs.append((n_tokens, experts, ms))
        mean, count = self._experts_by_n.get(n_tokens, (0.0, 0))
        self._experts_by_n[n_tokens] = ((mean * count + experts) / (count + 1), count + 1)
        self._since_fit += 1
        if self._since_fit >= self._refit_every or len(self._obs) <= 4:
            self.fit()

    def fit(self) -> None:
        self._since_fit = 0
        if not self._obs:
            return
        x = np.array([(1.0, n, e) for n, e, _ in self._obs])
        y = np.array([ms for _, _, ms in self._obs])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        self.coef = coef

    def expected_experts(self, n_tokens: int) -> float:
        if n_tokens in self._experts_by_n:
            return self._experts_by_n[n_tokens][0]
        if not self._experts_by_n:
            return 0.0
        ns = sorted(self._experts_by_n)
        return float(np.interp(n_tokens, ns, [self._experts_by_n[n][0] for n in ns]))

    def predict(self, n_tokens: int, experts: float | None = None) -> float:
        e = self.expected_experts(n_tokens) if experts is None else experts
        return max(float(self.coef @ np.array([1.0, n_tokens, e])), 1e-6)

    def heldout_error(self, steps: list[tuple[int, int, float]]) -> float:
        """Median relative error |predicted - measured| / measured over steps the fit did not see."""
        errs = [abs(self.predict(n, e) - ms) / ms for n, e, ms in steps if ms > 0]
        return float(np.median(errs)) if errs else float("nan")


class AcceptanceEstimator:
    """Running estimate of alpha_i = P(position i accepted | positions < i accepted)."""

    def __init__(self, max_k: int, prior: float, ema: float) -> None:
        self.alpha = np.full(max_k, prior)
        self._ema = ema

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        # positions 0..num_accepted-1 were accepted; position num_accepted (if drafted) was refused
        for i in range(min(num_drafted, num_accepted + 1)):
            hit = 1.0 if i < num_accepted else 0.0
            self.alpha[i] += self._ema * (hit - self.alpha[i])


def expected_emitted(alpha: np.ndarray) -> np.ndarray:
    """E[emitted | k] for k = 0..len(alpha): 1 + cumulative sum of cumulative products."""
    return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(alpha))])


class AdaptiveSpeculation:
    """Chooses each step's chain length from the cost model and the acceptance estimate."""

    def __init__(self, config: AdaptiveConfig) -> None:
        self.config = config
        self.cost = VerifyCostModel(config.window, config.refit_every)
        self.accept = AcceptanceEstimator(config.max_k, config.prior_accept, config.ema)
        self.draft_ms_per_token = 0.0

    def observe_draft(self, k: int, ms: float) -> None:
        """Running (EMA) estimate of the draft cost per drafted token."""
        if k <= 0:
            return
        w = self.config.ema
        per_token = ms / k
        self.draft_ms_per_token += w * (per_token - self.draft_ms_per_token)

    def observe_verify(self, num_drafted: int, num_accepted: int, experts: int, ms: float) -> None:
        self.cost.observe(num_drafted + 1, experts, ms)
        self.accept.observe(num_drafted, num_accepted)

    def choose_k(self, limit: int, confidence: np.ndarray | None = None) -> int:
        """Best k in [0, min(limit, max_k)]; confidence[i] (drafter's q of token i) replaces alpha_i."""
        kmax = max(0, min(limit, self.config.max_k))
        if kmax == 0:
            return 0
        alpha = self.accept.alpha[:kmax].copy()
        if confidence is not None:
            m = min(len(confidence), kmax)
            alpha[:m] = np.clip(confidence[:m], 0.0, 1.0)
        gain = expected_emitted(alpha)
        cost = np.array([self.draft_ms_per_token * k + self.cost.predict(k + 1) for k in range(kmax + 1)])
        return int(np.argmax(gain / cost))
