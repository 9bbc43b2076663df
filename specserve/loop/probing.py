"""Probes: the draft calls a chooser that has turned speculation off still makes, to re-measure acceptance.

While adaptive speculation (specserve/loop/adaptive.py) is off, every step is a target-only step, except a probe of
``ProbePolicy.tokens`` drafted after ``interval`` skipped steps. A probe costs what its step spends beyond a
target-only step: its draft call (the catch-up over the skipped stretch included, and on a request's first propose
the drafter's session start), the verify of its drafted token and a drafted step's extra overhead (the chooser
adds the last two from its tables: on an MoE a 2-token verify reads ~2x a decode's experts). That is what it may
cost:

    budget interval = ceil(probe ms / (max_cost_fraction * skipped step ms))
    probe ms        = the median of the last ``window`` probes' cost (before any: the chooser's prediction)

and, whatever the budget, a floor that backs off geometrically while probes keep losing (issue #43: a cheap probe
every 9 steps was 11% of the steps, each verifying a token that was never accepted):

    floor = min(min_interval * 2^streak, backoff_max)     streak = probes since speculation was last on

so past the first probes, probes take at most ``max_cost_fraction`` of the time and at most 1 in backoff_max + 1
steps (max_interval caps the wait, and with it the budget, for a probe dearer than max_interval *
max_cost_fraction skipped steps). The first ``window`` probes may explore: a probe whose k the chooser never
timed in a steady call may have been dear only once (a CUDA graph captured on first use), so the dearest such
probe is forgiven, and the i-th probe (i = 0 .. window - 1) may come after only the floor, but only while it keeps
within the budget too:

    exploring interval = max(floor, ceil(charged ms / (max_cost_fraction * skipped step ms)) - before)
    charged ms         = every timed probe's cost summed, less the dearest forgivable one's
    before             = the chooser's skipped steps up to the last probe

(and never later than the budget interval). A probe at a k already timed in steady calls is not forgivable: its
extra cost is the catch-up or the session start, which every probe pays again (the H200's Moonlight DFlash: a
13.7 ms probe, 3x a step, forgiven, landed in a bench's 94 timed steps and cost it 3.5%). So a drafter dear on
every probe pays one probe and then about ``max_cost_fraction``, even over a run of a few short requests, while
one dear once at a shape it was never timed at is timed again after min_interval * 2 skipped steps.
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
    max_cost_fraction: float = 0.005  # probes' time over the skipped steps' time, at most (once explored)
    tokens: int = 1  # drafted tokens of a probe
    window: int = 4  # probes whose median is the probe cost; probes timed before the budget alone spaces them
    backoff_max: int = 256  # the losing probes' geometric floor stops growing here (1 probe in 257 steps at most)

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
        if self.backoff_max < self.min_interval:
            raise ValueError(f"backoff_max must be >= min_interval, got {self.backoff_max} < {self.min_interval}")


class ProbeSchedule:
    """The probes of one chooser, over all requests of its drafter: skipped steps since the last draft (and in
    all), the probes made (and since speculation was last on), the last ``policy.window`` probes' cost and what the
    timed ones cost in all."""

    def __init__(self, policy: ProbePolicy) -> None:
        self.policy = policy
        self.skipped = 0  # steps skipped since the last one that drafted
        self.probes = 0  # probes made
        self.streak = 0  # probes made since speculation was last on (each one lost: it stayed off)
        self.timed = 0  # probes whose cost was observed
        self.spent_ms = 0.0  # every timed probe's cost, summed
        self.dearest_ms = 0.0  # ... and the dearest forgivable one (a possible one-off)
        self.skipped_total = 0  # steps skipped, over the chooser's life
        self._ms: deque[float] = deque(maxlen=policy.window)

    @property
    def probe_ms(self) -> float | None:
        """The median of the last ``window`` probes' cost; None before the first."""
        return statistics.median(self._ms) if self._ms else None

    @property
    def version(self) -> tuple[int, int]:
        """Changes whenever ``interval`` may (with its arguments)."""
        return self.timed, min(self.probes, self.policy.window), self.streak

    def observe(self, ms: float, forgivable: bool = True) -> None:
        """A probe cost ``ms`` (its draft call and what its step spent beyond a skipped one); ``forgivable``: its k was
        never timed in a steady call, so its cost may have been a one-off."""
        self._ms.append(ms)
        self.timed += 1
        self.spent_ms += ms
        if forgivable:
            self.dearest_ms = max(self.dearest_ms, ms)

    @property
    def charged_ms(self) -> float:
        """The probes' summed cost that the budget charges: all but the dearest forgivable one (a possible one-off)."""
        return self.spent_ms - self.dearest_ms

    def interval(self, predicted_probe_ms: float, step_ms: float) -> int:
        """Skipped steps before the next probe (module docstring): ``predicted_probe_ms`` stands in for the
        probe cost before any probe was timed; ``step_ms`` is a skipped step's."""
        policy = self.policy
        probe_ms = self.probe_ms if self._ms else predicted_probe_ms
        floor = min(policy.min_interval << min(self.streak, 30), policy.backoff_max)  # losing probes back off
        n = floor
        if probe_ms > 0.0 and step_ms > 1e-5:  # else nothing is measured yet
            n = max(n, math.ceil(probe_ms / (policy.max_cost_fraction * step_ms)))
        if self.probes < policy.window:  # exploring: a forgivable dear probe may have been a one-off
            n = min(n, max(floor, self._paid_off(step_ms)))
        return min(n, policy.max_interval)

    def _paid_off(self, step_ms: float) -> int:
        """Skipped steps after the last probe until the charged probe ms is within the budget of all skipped steps'."""
        if step_ms <= 1e-5:  # nothing is measured yet
            return 0
        before = self.skipped_total - self.skipped
        return math.ceil(self.charged_ms / (self.policy.max_cost_fraction * step_ms)) - before

    def drafted(self) -> None:
        """A step drafted without probing (speculation is on): the losing streak ends."""
        self.skipped = 0
        self.streak = 0

    def due(self, interval: int) -> bool:
        """A step that speculation skips: whether it probes (``interval`` skipped steps went by) or skips."""
        if self.skipped < interval:
            self.skipped += 1
            self.skipped_total += 1
            return False
        self.skipped = 0
        self.probes += 1
        self.streak += 1
        return True
