"""The verify-length rule: how many of a step's drafted tokens to verify, 0 (a target-only step) included.

Pure and table-driven (plain floats, no numpy, no state): a step loop, wherever it runs, hands it the chance of
each drafted position and a precomputed table of step costs by verify length, and gets k back.

    alpha_i        chance drafted token i is accepted given tokens < i were (a confidence head's output, or a
                   drafter's q of the token, calibrated; else a running per-position estimate)
    E[emitted | k] = 1 + sum_{i<=k} prod_{j<=i} alpha_j          (the bonus / recovered token always comes)
    step_ms(k)     = draft_ms[k] + verify_ms[k] + overhead(k)    before drafting
                   = sunk_ms + verify_ms[k]                     once the block is drafted (its cost is sunk)
    k*             = argmax_{least <= k <= K} E[emitted | k] / step_ms(k)   (the first best)
                     with k = 0's rate raised by ``margin`` (before drafting: a k >= 1 must beat target-only by it)

verify_ms[k] is the verify of k + 1 tokens on the target: on an MoE it grows with the distinct experts those tokens
route to, so the table comes from a fit on tokens and experts (gateway/cost_models.py), not from a per-token line.
k = 0 is the target-only step (1 token a verify), so a block nobody is confident in is not verified at all, and a
drafter that never pays is not asked (k* = 0 before drafting). Verifying any prefix of a chain is lossless: the
acceptance rule is the target's and does not change, only how many tokens it is shown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCosts:
    """A step's costs by the number k of drafted tokens it verifies, k = 0..K (what the chooser reads)."""

    verify_ms: tuple[float, ...]  # [K + 1] the verify of k + 1 tokens
    draft_ms: tuple[float, ...]  # [K + 1] drafting k tokens (draft_ms[0] = 0: no drafter call)
    overhead_ms: tuple[float, float] = (0.0, 0.0)  # the step's time outside draft and verify: k = 0, k >= 1

    def __post_init__(self) -> None:
        if not self.verify_ms or len(self.draft_ms) != len(self.verify_ms):
            raise ValueError(
                f"verify_ms and draft_ms need K + 1 >= 1 entries each, got {len(self.verify_ms)} and "
                f"{len(self.draft_ms)}"
            )
        if len(self.overhead_ms) != 2:
            raise ValueError(f"overhead_ms is (target-only, drafted), got {self.overhead_ms!r}")

    @property
    def max_k(self) -> int:
        return len(self.verify_ms) - 1

    def step_ms(self, k: int, sunk_ms: float | None = None) -> float:
        """Expected ms of a step verifying k drafted tokens (``sunk_ms``: the block is already drafted)."""
        if sunk_ms is not None:
            return max(sunk_ms, 0.0) + self.verify_ms[k]
        return self.draft_ms[k] + self.verify_ms[k] + self.overhead_ms[1 if k else 0]


def expected_emitted(alpha: Sequence[float]) -> list[float]:
    """E[emitted | k] for k = 0..len(alpha) [len(alpha) + 1]. Plain floats: with a handful of positions numpy's
    per-call overhead would dominate a step's choice."""
    out, run = [1.0], 1.0
    for a in alpha:
        run *= float(a)
        out.append(out[-1] + run)
    return out


def best_length(
    alpha: Sequence[float], costs: StepCosts, sunk_ms: float | None = None, least: int = 0, margin: float = 0.0
) -> int:
    """k* of the module docstring over k = least..min(len(alpha), costs.max_k); ``least`` = 1 makes a step verify
    something whatever the estimates say (a probe, which is there to measure); ``margin``: k = 0's rate is raised by
    that share, so a k >= 1 is chosen only if predicted to beat target-only by it (noisy estimates)."""
    kmax = min(len(alpha), costs.max_k)
    least = min(max(least, 0), kmax)
    gain = expected_emitted(alpha[:kmax])
    best_k, best_rate = least, -1.0
    for k in range(least, kmax + 1):
        rate = gain[k] / costs.step_ms(k, sunk_ms)
        if not k:
            rate *= 1.0 + margin
        if rate > best_rate:  # the first best, like argmax
            best_k, best_rate = k, rate
    return best_k
