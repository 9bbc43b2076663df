"""Probes: the draft calls a chooser that has turned speculation off still makes, to re-measure acceptance.

While adaptive speculation (specserve/loop/adaptive.py) is off, every step is a target-only step, except a probe of
``ProbePolicy.tokens`` drafted after ``interval`` skipped steps. A probe costs its draft call, the catch-up over
the skipped stretch included, and that is what it may cost:

    budget interval = ceil(probe ms / (max_cost_fraction * skipped step ms)), at least min_interval
    probe ms        = the median of the last ``window`` probes' draft ms (before any: the draft-cost fit's)

so past the first ``window`` probes, probes take about ``max_cost_fraction`` of the time (at most 1 in
min_interval + 1 steps; max_interval caps the wait, and with it the budget, for a probe dearer than
max_interval * max_cost_fraction skipped steps). The first ``window`` probes explore: the dear step that turned
speculation off (or a dear probe) may have been a one-off, such as a graph captured on first use, so the i-th
probe (i = 0 .. window - 1) may come after only min_interval * 2^i skipped steps, but only while it keeps
within the budget too:

    exploring interval = max(min_interval * 2^i, ceil(charged ms / (max_cost_fraction * skipped step ms)) - before)
    charged ms         = every timed probe's draft ms summed, less the dearest one's (it may be a one-off)
    before             = the chooser's skipped steps up to the last probe

(and never later than the budget interval). So one dear probe is forgiven, as a possible one-off, and each
further dear one pushes the next probe out in proportion to its cost: a drafter dear on every probe (the H200's
scaled MTP drafter, whose every catch-up size captures a graph) pays two probes and then about
``max_cost_fraction``, even over a run of a few short requests, while one that was dear once is timed again
after min_interval * 2 skipped steps.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbePolicy:
    """When a chooser that has turned speculation off drafts anyway (a probe): the module docstring's rule."""

    min_interval: int = 8  # skipped steps between two probes, at least
    max_interval: int = 4096  # ... and at most: how late a rise in acceptance may be noticed
    max_cost_fraction: float = 0.01  # probes' time over the skipped steps' time, at most (once explored)
    tokens: int = 1  # drafted tokens of a probe
    window: int = 4  # probes whose median is the probe cost; probes timed before the budget alone spaces them

    def __post_init__(self) -> None:
        if not 1 <= self.min_interval <= self.max_interval:
            raise ValueError(
                f"probe intervals must satisfy 1 <= min <= max, got {self.min_interval}, {self.max_interval}"
            )
        if not 0.0 < self.max_cost_fraction <= 1.0:
            raise ValueError(f"max_cost_fraction must be in (0, 1], got {self.max_cost_fraction}")
        if self.tokens < 1:
            raise ValueError(f"a probe drafts at least 1 token, got {self.tokens}")
        if self.window < 1:
            raise ValueError(f"the probe-cost window holds at least 1 probe, got {self.window}")


class ProbeSchedule:
    """The probes of one chooser, over all requests of its drafter: skipped steps since the last draft (and in
    all), the probes made, the last ``policy.window`` probes' draft ms and what the timed ones cost in all."""

    def __init__(self, policy: ProbePolicy) -> None:
        self.policy = policy
        self.skipped = 0  # steps skipped since the last one that drafted
        self.probes = 0  # probes made
        self.timed = 0  # probes whose draft ms was observed
        self.spent_ms = 0.0  # every timed probe's draft ms, summed
        self.dearest_ms = 0.0  # ... and the dearest of them
        self.skipped_total = 0  # steps skipped, over the chooser's life
        self._ms: deque[float] = deque(maxlen=policy.window)

    @property
    def probe_ms(self) -> float | None:
        """The median of the last ``window`` probes' draft ms; None before the first."""
        return statistics.median(self._ms) if self._ms else None

    @property
    def version(self) -> tuple[int, int]:
        """Changes whenever ``interval`` may (with its arguments)."""
        return self.timed, min(self.probes, self.policy.window)

    def observe(self, ms: float) -> None:
        """A probe's draft call took ``ms``."""
        self._ms.append(ms)
        self.timed += 1
        self.spent_ms += ms
        self.dearest_ms = max(self.dearest_ms, ms)

    @property
    def charged_ms(self) -> float:
        """The probes' summed draft ms that the budget charges: all but the dearest (it may be a one-off)."""
        return self.spent_ms - self.dearest_ms

    def interval(self, predicted_probe_ms: float, step_ms: float) -> int:
        """Skipped steps before the next probe (module docstring): ``predicted_probe_ms`` stands in for the
        probe cost before any probe was timed; ``step_ms`` is a skipped step's."""
        policy = self.policy
        probe_ms = self.probe_ms if self._ms else predicted_probe_ms
        n = policy.min_interval
        if probe_ms > 0.0 and step_ms > 1e-5:  # else nothing is measured yet
            n = max(n, math.ceil(probe_ms / (policy.max_cost_fraction * step_ms)))
        if self.probes < policy.window:  # exploring: a dear probe may have been a one-off, but the others count
            n = min(n, max(policy.min_interval << self.probes, self._paid_off(step_ms)))
        return min(n, policy.max_interval)

    def _paid_off(self, step_ms: float) -> int:
        """Skipped steps after the last probe until the charged probe ms is within the budget of all skipped steps'."""
        if step_ms <= 1e-5:  # nothing is measured yet
            return 0
        before = self.skipped_total - self.skipped
        return math.ceil(self.charged_ms / (self.policy.max_cost_fraction * step_ms)) - before

    def drafted(self) -> None:
        """A step drafted without probing (speculation is on)."""
        self.skipped = 0

    def due(self, interval: int) -> bool:
        """A step that speculation skips: whether it probes (``interval`` skipped steps went by) or skips."""
        if self.skipped < interval:
            self.skipped += 1
            self.skipped_total += 1
            return False
        self.skipped = 0
        self.probes += 1
        return True
