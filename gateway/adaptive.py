"""MoE-aware adaptive speculation: pick the block size that maximises emitted tokens per second.

Verify cost on an MoE target grows with the distinct experts a step reads, not only with its token
count, so the cost model is fitted on both (plus what drafting ahead concurrently adds):

    verify_ms(n, e, ahead) ~= a + b * n + c * e + d * ahead
        n = tokens in the forward (pending + drafted, tree nodes for a tree)
        e = distinct (layer, expert) pairs the router chose
        ahead = 1 when the drafter was drafting the next block during this verify (contention)
    experts(n) ~= running mean of e over past steps with n tokens (interpolated when unseen)
    draft_ms(k)  = the least of k's last ``draft_window`` timed calls, once k was timed that often (settled);
                   else d0 + d1 * k (d0 = per-call part: a one-pass drafter is flat, an autoregressive one is
                   linear), fitted on the settled k's (on every timed k while none is), or k's own least
                   timing, or max(1, k / j) times another timed j's least, where that is lower
    Both fits are least squares with coefficients >= 0 (n and e move together; free signs would not). The verify
    fit leaves out steps more than twice as dear as their token count's median, and the experts column until three
    token counts were seen (VerifyCostModel.fit).

A draft call's time is its steady cost plus one-offs that only add to it (a CUDA graph captured on first use of
a shape, mid-request; a catch-up over skipped steps; a busy host): the least of a k's last few timings is its
steady cost, and a k timed fewer times (perhaps only on one-offs) is charged no more than the line through the
settled k's, so it is tried again instead of turning speculation off for good.

Expected emitted tokens of a chain of length k, with alpha_i the chance that drafted position i is
accepted given positions < i were:

    E[emitted | k] = 1 + sum_{i=1..k} prod_{j<=i} alpha_j

alpha_i comes from the drafter's own confidence q of the drafted token, mapped through a running
calibration (observed acceptance per q bin, starting at q itself), when the drafter sent
probabilities; else from a running per-position acceptance estimate.

    overhead(k) = running mean of (step wall - draft - verify) of steps that drafted (k >= 1) or did
                  not (k = 0): a drafted step also pays the propose call's hop, checks and truncation

Before drafting, k maximises E[emitted | k] / (draft_ms(k) + verify_ms(k + 1) + overhead(k)); k = 0 is
target-only's rate 1 / (verify_ms(1) + overhead(0)), so speculation is off whenever it does not pay.
After a block is drafted its cost is sunk: the truncation maximises E[emitted | k] / (sunk_ms +
verify_ms(k + 1)). Only which tokens are verified changes; the acceptance rule does not, so the output
distribution is untouched.

While speculation is off, a step does what a target-only step does (no drafter call: the drafter
catches up on the skipped tokens at the next propose). Now and then a probe drafts anyway, so acceptance
stays measured and speculation comes back on when it pays again; gateway/probing.py spaces the probes by
their measured cost: a probe is made only while the probes so far, less the dearest (a dear probe may be a
one-off), took at most about 1% of the skipped steps' time, the first few (exploring, at growing intervals)
included, so a dear drafter costs a run of a few short requests two probes, then about 1%. A draft call that
caught up more than one step (a probe, a request's first) is an upper bound of a steady call: it is a timing of
its k only where k is not settled and it undercuts k's cost.
So a probe can turn speculation back on when its k was timed only on one-offs (or never), and only steady
calls revise a settled k.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from specserve.gateway.probing import ProbePolicy, ProbeSchedule

AHEAD_PROBE_EVERY = 16  # every 16th step that could draft ahead does the opposite of the estimate
IDLE_REFIT_FACTOR = 16  # the verify fit's refit interval is this many times longer while speculation is off


@dataclass(frozen=True)
class AdaptiveConfig:
    max_k: int = 8
    window: int = 256  # steps the cost models are fitted on
    refit_every: int = 16
    prior_accept: float = 0.6  # acceptance estimate before any observation
    ema: float = 0.1  # weight of the newest observation in the step-overhead and ahead-hit estimates
    draft_window: int = 4  # timed calls of a k whose least is its draft cost (DraftCostModel)
    accept_memory: float = 64.0  # steps the acceptance estimate averages over
    accept_prior_weight: float = 4.0  # pseudo-observations at the prior mean per position
    calibration_bins: int = 10  # q bins of the confidence calibration
    calibration_prior: float = 4.0  # pseudo-observations at q itself in each bin
    probe: ProbePolicy = ProbePolicy()  # while speculation is off

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if self.window < 1 or self.refit_every < 1:
            raise ValueError(f"window and refit_every must be >= 1, got {self.window}, {self.refit_every}")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")
        if self.draft_window < 1:
            raise ValueError(f"draft_window must be >= 1, got {self.draft_window}")
        if self.accept_memory < 1.0 or self.accept_prior_weight <= 0.0:
            raise ValueError(f"accept_memory must be >= 1 and accept_prior_weight > 0, got {self.accept_memory}, "
                             f"{self.accept_prior_weight}")
        if not 0.0 <= self.prior_accept <= 1.0:
            raise ValueError(f"prior_accept must be in [0, 1], got {self.prior_accept}")
        if self.calibration_bins < 1 or self.calibration_prior <= 0:
            raise ValueError("calibration_bins must be >= 1 and calibration_prior > 0")


def nonneg_lstsq(x: np.ndarray, y: np.ndarray, order: tuple[int, ...] | None = None) -> np.ndarray:
    """min |x c - y| with every c >= 0 (x [N, P], y [N], small P).

    The optimum is the unconstrained fit on some subset of columns; every well-conditioned subset
    whose fit is non-negative is tried (from the normal equations, all subsets in one batched solve),
    smaller subsets first and in ``order`` within a size, and a later one wins only if it fits clearly
    better. So collinear columns (tokens and experts move together) never give opposite-signed
    coefficients, and a tie goes to the earlier column in ``order``.
    """
    p = x.shape[1]
    order = tuple(range(p)) if order is None else order
    scale = np.sqrt((x * x).sum(axis=0))
    scale[scale == 0] = 1.0
    xs = x / scale  # unit columns: the conditioning test below is scale-free
    gram, xty, yty = xs.T @ xs, xs.T @ y, float(y @ y)
    subsets = [cols for size in range(1, p + 1) for cols in combinations(order, size)]
    mask = np.zeros((len(subsets), p), dtype=bool)  # [S, P]
    for i, cols in enumerate(subsets):
        mask[i, list(cols)] = True
    both = mask[:, :, None] & mask[:, None, :]  # [S, P, P]
    # each subset's normal equations, padded to P x P with the identity on the columns it leaves out
    g = np.where(both, gram, 0.0) + np.where(mask, 0.0, 1.0)[:, :, None] * np.eye(p)
    ok = np.linalg.eigvalsh(g)[:, 0] >= 1e-9  # (near-)collinear or empty columns: skip
    c = np.zeros((len(subsets), p))
    c[ok] = np.linalg.solve(g[ok], np.where(mask[ok], xty, 0.0)[..., None])[..., 0]
    err = yty - c @ xty  # residual of each subset's least-squares fit
    best, best_err = np.zeros(p), yty
    for i in np.flatnonzero(ok & (c >= 0).all(axis=1)):
        if err[i] < best_err - 1e-9 * (1.0 + abs(best_err)):
            best, best_err = c[i], float(err[i])
    return best / scale


class VerifyCostModel:
    """Non-negative least-squares fit of verify time on (1, tokens, distinct experts, ahead)."""

    # ties between collinear columns: intercept, then ahead contention, then tokens, then experts
    _ORDER = (0, 3, 1, 2)

    def __init__(self, window: int = 256, refit_every: int = 16) -> None:
        # ring of the last ``window`` steps, plain Python (a step's observe stays cheap; numpy at the fit)
        self._x: list[tuple[float, int, int, float]] = [(1.0, 0, 0, 0.0)] * window  # (1, n, e, ahead)
        self._y: list[float] = [0.0] * window  # their ms
        self._count = 0  # steps observed in all
        self._refit_every = refit_every
        self._since_fit = 0
        self._only_decodes = True  # every step since the last fit verified 1 token (speculation off)
        self.coef = np.zeros(4)  # a, b (per token), c (per expert), d (drafting ahead meanwhile)
        self._experts_by_n: dict[int, tuple[float, int]] = {}
        self._experts_table: tuple[np.ndarray, np.ndarray] | None = None  # sorted n, mean e (as of the fit)
        self.version = 0  # bumped by every fit: predictions only change then

    def observe(self, n_tokens: int, experts: int, ms: float, ahead: bool = False) -> None:
        i = self._count % len(self._y)
        self._x[i] = (1.0, n_tokens, experts, 1.0 if ahead else 0.0)
        self._y[i] = ms
        self._count += 1
        mean, count = self._experts_by_n.get(n_tokens, (0.0, 0))
        self._experts_by_n[n_tokens] = ((mean * count + experts) / (count + 1), count + 1)
        self._since_fit += 1
        self._only_decodes = self._only_decodes and n_tokens == 1
        # while only 1-token steps arrive (speculation off) the fit hardly moves, and fitting would be most
        # of such a step's chooser time: refit IDLE_REFIT_FACTOR times less often then
        every = self._refit_every * (IDLE_REFIT_FACTOR if self._only_decodes else 1)
        if self._since_fit >= every or self._count <= 4:
            self.fit()

    def fit(self) -> None:
        """Non-negative least squares on the window's steps, less the outliers: a step more than twice as dear as the
        median of its (token count, ahead) group (of 3 or more) is left out, since a step's time is its steady cost plus
        noise that only adds (a busy host, a one-off) and one such step tilts the line for every count. The experts
        column is fitted only once three token counts were seen: over two, experts are a function of tokens, and their
        (concave) interpolation would make the counts between look as dear as the larger one."""
        self._since_fit = 0
        self._only_decodes = True
        self._experts_table = None
        self.version += 1
        m = self.observed
        if not m:
            return
        x, y = np.array(self._x[:m], dtype=float), np.array(self._y[:m])
        keep = np.ones(m, dtype=bool)
        groups = x[:, 1] * 2 + x[:, 3]  # (n, ahead) as one key
        for g in np.unique(groups):
            members = groups == g
            if members.sum() >= 3:
                keep &= ~members | (y <= 2.0 * np.median(y[members]))
        x, y = x[keep], y[keep]
        if len(np.unique(x[:, 1])) < 3:
            x[:, 2] = 0.0  # the experts column left out (an empty column gets coefficient 0)
        self.coef = nonneg_lstsq(x, y, self._ORDER)

    @property
    def observed(self) -> int:
        return min(self._count, len(self._y))

    @property
    def observed_ahead(self) -> int:
        """Steps in the window that drafted ahead while verifying."""
        return int(sum(row[3] for row in self._x[: self.observed]))

    def expected_experts(self, n_tokens):
        """Mean distinct experts seen at n tokens (interpolated, clamped at the ends); n may be an array."""
        if not self._experts_by_n:
            return np.zeros_like(np.asarray(n_tokens, dtype=float))
        if self._experts_table is None:
            ns = sorted(self._experts_by_n)
            self._experts_table = (np.array(ns, dtype=float), np.array([self._experts_by_n[n][0] for n in ns]))
        return np.interp(n_tokens, *self._experts_table)

    def predict_many(self, n_tokens: np.ndarray, ahead: np.ndarray | bool = False) -> np.ndarray:
        """Predicted ms for each n [K] (expected experts), ``ahead`` [K] or one flag for all."""
        n = np.asarray(n_tokens, dtype=float)
        x = np.stack([np.ones_like(n), n, self.expected_experts(n), np.broadcast_to(np.asarray(ahead, dtype=float), n.shape)], axis=-1)
        return np.maximum(x @ self.coef, 1e-6)

    def predict(self, n_tokens: int, experts: float | None = None, ahead: bool = False) -> float:
        e = float(self.expected_experts(n_tokens)) if experts is None else experts
        return max(float(self.coef @ np.array([1.0, n_tokens, e, float(ahead)])), 1e-6)

    def heldout_error(self, steps: list[tuple]) -> float:
        """Median relative error |predicted - measured| / measured over steps the fit did not see.

        Each step is (n, e, ms) or (n, e, ms, ahead)."""
        errs = [abs(self.predict(s[0], s[1], bool(s[3]) if len(s) > 3 else False) - s[2]) / s[2] for s in steps if s[2] > 0]
        return float(np.median(errs)) if errs else float("nan")


class DraftCostModel:
    """draft_ms(k): the least of k's last ``window`` timings once k was timed that often (settled), else the
    line d0 + d1 * k capped by k's own least timing (module docstring).

    The line is non-negative least squares on the settled k's least timings (on every timed k's while none is
    settled). With a single k the two parts cannot be told apart: the cost is charged per token (d0 = 0),
    which is exact at that k; once another k is timed the fit separates them."""

    def __init__(self, window: int = 4) -> None:
        self._window = window
        self._timings: dict[int, deque[float]] = {}
        self._least: dict[int, float] = {}  # least of each timed k's last timings
        self.coef = np.zeros(2)  # d0 (per call), d1 (per drafted token)
        self._costs: list[float] = [0.0]  # predicted ms of k = 0, 1, ... as of the last fit
        self.version = 0

    def observe(self, k: int, ms: float) -> None:
        if k <= 0:
            return
        timings = self._timings.setdefault(k, deque(maxlen=self._window))
        timings.append(ms)
        self._least[k] = min(timings)
        self.fit()

    def settled(self, k: int) -> bool:
        """Whether k was timed ``window`` times (its cost is then its own least timing)."""
        return len(self._timings.get(k, ())) >= self._window

    def fit(self) -> None:
        """Closed form (a handful of points): the line if both parts come out >= 0, else the better of
        the two one-part fits (through the origin, or flat)."""
        self.version += 1
        self._costs = [0.0]
        pts = [(k, ms) for k, ms in self._least.items() if self.settled(k)] or list(self._least.items())
        if not pts:
            return
        if len(pts) == 1:
            (k, ms), = pts
            self.coef = np.array([0.0, max(ms / k, 0.0)])
            return
        m = len(pts)
        kbar, ybar = sum(k for k, _ in pts) / m, sum(y for _, y in pts) / m
        d1 = sum((k - kbar) * (y - ybar) for k, y in pts) / sum((k - kbar) ** 2 for k, _ in pts)
        d0 = ybar - d1 * kbar
        if d0 >= 0 and d1 >= 0:
            self.coef = np.array([d0, d1])
            return
        per_token = max(sum(k * y for k, y in pts) / sum(k * k for k, _ in pts), 0.0)
        flat = max(ybar, 0.0)
        err_token = sum((per_token * k - y) ** 2 for k, y in pts)
        err_flat = sum((flat - y) ** 2 for _, y in pts)
        self.coef = np.array([0.0, per_token]) if err_token < err_flat else np.array([flat, 0.0])

    def _cost(self, k: int) -> float:
        """A settled k's least timing; else the line, k's own least timing and what any other timed j bounds it by
        (a call of k tokens costs no more than k / j calls of j tokens, nor more than one of j >= k tokens), whichever
        is least: one dear timing (a one-off) of a k makes neither that k nor the others dear."""
        least = self._least.get(k)
        if self.settled(k):
            return least
        bounds = [float(self.coef[0] + self.coef[1] * k)] + ([] if least is None else [least])
        bounds += [ms * max(1.0, k / j) for j, ms in self._least.items() if j != k]
        return min(bounds)

    def costs(self, kmax: int) -> list[float]:
        """Predicted ms of a draft call asking for k = 0..kmax [kmax + 1] (0 for k = 0: no call), plain floats."""
        while len(self._costs) <= kmax:
            self._costs.append(self._cost(len(self._costs)))
        return self._costs[: kmax + 1]

    def predict(self, k: int) -> float:
        return self.costs(k)[k] if k > 0 else 0.0

    def predict_many(self, ks: np.ndarray) -> np.ndarray:
        """ms of a draft call asking for each k [K]; 0 for k = 0 (no call)."""
        return np.array([self.predict(int(k)) for k in np.asarray(ks).ravel()]).reshape(np.shape(ks))


class AcceptanceEstimator:
    """Running estimate of alpha_i = P(position i accepted | positions < i accepted).

    Per position: decayed counts of accepted / observed, plus ``prior_weight`` pseudo-observations at
    a prior mean: ``prior`` for position 0, the estimate of position i - 1 for position i (positions
    of one drafter tend to be alike; a chain's tail is seen least). Every step decays the counts of
    every position by 1 - 1/memory, so a position the chooser stopped drafting drifts back to its
    prior and gets drafted again, instead of staying at one unlucky early observation."""

    def __init__(self, max_k: int, prior: float, memory: float, prior_weight: float = 4.0) -> None:
        self.hits = np.zeros(max_k)
        self.trials = np.zeros(max_k)
        self._prior, self._keep, self._weight = prior, 1.0 - 1.0 / memory, prior_weight
        self.version = 0  # bumped by every observation that changes the estimate

    @property
    def alpha(self) -> np.ndarray:
        out, mean = np.empty(len(self.hits)), self._prior
        for i in range(len(out)):
            mean = out[i] = (self.hits[i] + self._weight * mean) / (self.trials[i] + self._weight)
        return out

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        # positions 0..num_accepted-1 were accepted; position num_accepted (if drafted) was refused
        seen = min(num_drafted, num_accepted + 1, len(self.hits))
        if seen == 0:
            return
        self.hits *= self._keep
        self.trials *= self._keep
        self.hits[: min(seen, num_accepted)] += 1.0
        self.trials[:seen] += 1.0
        self.version += 1


class ConfidenceCalibration:
    """Map from the drafter's q of a drafted token to its observed acceptance rate (per q bin).

    Each bin starts with ``prior`` pseudo-observations at q itself, so an unseen bin trusts q and a
    drafter whose q overstates (or understates) acceptance is corrected as steps arrive. Counts are
    halved when a bin passes ``window`` observations, so the map follows drift."""

    def __init__(self, bins: int, prior: float, window: int) -> None:
        self.hits = np.zeros(bins)
        self.trials = np.zeros(bins)
        self._prior, self._window = prior, window

    def _bin(self, q: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(q) * len(self.hits)).astype(int), 0, len(self.hits) - 1)

    def observe(self, q: np.ndarray, num_accepted: int) -> None:
        """q [k] of a verified chain; positions up to the first refusal were observed."""
        seen = min(len(q), num_accepted + 1)
        for i in range(seen):
            b = int(self._bin(q[i]))
            self.hits[b] += 1.0 if i < num_accepted else 0.0
            self.trials[b] += 1.0
            if self.trials[b] > self._window:
                self.hits[b] /= 2
                self.trials[b] /= 2

    def __call__(self, q: np.ndarray) -> np.ndarray:
        q = np.clip(np.asarray(q, dtype=float), 0.0, 1.0)
        b = self._bin(q)
        return (self.hits[b] + self._prior * q) / (self.trials[b] + self._prior)


def expected_emitted(alpha: Sequence[float]) -> list[float]:
    """E[emitted | k] for k = 0..len(alpha): 1 + sum_{i<k} prod_{j<=i} alpha_j. Plain floats: with a
    handful of positions numpy's per-call overhead would dominate the chooser's step."""
    out, run = [1.0], 1.0
    for a in alpha:
        run *= float(a)
        out.append(out[-1] + run)
    return out


class AdaptiveSpeculation:
    """Chooses each step's chain length (and whether drafting ahead pays) from the cost models and
    the acceptance estimates. One instance per drafter; it outlives requests."""

    def __init__(self, config: AdaptiveConfig) -> None:
        self.config = config
        self.cost = VerifyCostModel(config.window, config.refit_every)
        self.draft = DraftCostModel(config.draft_window)
        self.accept = AcceptanceEstimator(config.max_k, config.prior_accept, config.accept_memory, config.accept_prior_weight)
        self.calibration = ConfidenceCalibration(config.calibration_bins, config.calibration_prior, config.window)
        self.ahead_hit_rate = 0.5  # running share of ahead blocks that were used
        self._ahead_steps = 0
        self._cost_cache: tuple | None = None
        self._choice_cache: tuple | None = None  # (inputs, k) of the last choice before drafting
        self.overhead_ms = [0.0, 0.0]  # running step overhead of k = 0 and k >= 1 steps
        self._overhead_seen = [0, 0]
        self._overhead_used = (0.0, 0.0)  # what choices charge: overhead_ms as of the last verify refit
        self._plan_cache: tuple | None = None  # (inputs, k, probe interval) of the last plan
        self.probing = ProbeSchedule(config.probe)  # skipped steps, probes made and their cost

    def observe_draft(self, k: int, ms: float, steady: bool = True, probe: bool = False) -> None:
        """A draft call asked for k tokens and took ms (drafting ahead is not observed: it overlaps).
        ``steady``: the drafter was in step (the request's previous step drafted); otherwise the call
        also caught up on skipped tokens (or started the drafter's session), so it is an upper bound of a
        steady call: a timing of k only where it undercuts k's cost and k is not settled (module docstring).
        ``probe``: ``plan`` made it a probe."""
        if probe:
            self.probing.observe(ms)
        if steady or (not self.draft.settled(k) and ms < self.draft.predict(k)):
            self.draft.observe(k, ms)

    def observe_overhead(self, drafted: bool, ms: float) -> None:
        """One step's wall time outside its draft and verify calls; charged from the next verify refit on."""
        i = int(drafted)
        self._overhead_seen[i] += 1
        old = self.overhead_ms[i]
        self.overhead_ms[i] = ms if self._overhead_seen[i] == 1 else old + self.config.ema * (ms - old)

    def observe_verify(
        self, num_drafted: int, num_accepted: int, experts: int, ms: float,
        confidence: np.ndarray | None = None, ahead: bool = False, overhead_ms: float | None = None,
    ) -> None:
        """One verified chain; ``confidence`` [num_drafted] is q of its tokens, ``ahead`` whether the
        drafter drafted the next block meanwhile, ``overhead_ms`` the step's time outside its draft and
        verify calls."""
        if overhead_ms is not None:
            self.observe_overhead(num_drafted > 0, overhead_ms)
        version = self.cost.version
        self.cost.observe(num_drafted + 1, experts, ms, ahead)
        if self.cost.version != version:
            self._overhead_used = tuple(self.overhead_ms)
        self.accept.observe(num_drafted, num_accepted)
        if confidence is not None and len(confidence) == num_drafted:
            self.calibration.observe(confidence, num_accepted)

    def observe_ahead(self, hit: bool) -> None:
        self.ahead_hit_rate += self.config.ema * (float(hit) - self.ahead_hit_rate)

    def ahead_pays(self, k: int) -> bool:
        """Draft ahead when the draft time it saves on a hit outweighs what it adds to the verify."""
        saved = self.ahead_hit_rate * self.draft.predict(max(1, k))
        return saved >= self.cost.coef[3]

    def plan_ahead(self, k: int) -> bool:
        """Whether this step (verifying k >= 1 drafted tokens) drafts ahead: ``ahead_pays``, except on
        every ``AHEAD_PROBE_EVERY``-th step, which does the opposite so that the verify time both with
        and without drafting ahead stays measured (else the contention cannot be told from the
        intercept, or the gate never reopens)."""
        self._ahead_steps += 1
        pays = self.ahead_pays(k)
        return not pays if self._ahead_steps % AHEAD_PROBE_EVERY == 0 else pays

    def plan(self, limit: int, ahead: bool = False) -> tuple[int, bool]:
        """(k, probe) of a step about to draft up to ``limit`` tokens: ``choose_k``'s k when it is >= 1;
        else 0 (skip: the step is a target-only step) until ``probe_interval`` steps were skipped, then a
        probe of ``ProbePolicy.tokens`` (gateway/probing.py). Shared by all requests of the drafter: probes
        are spaced over all of its steps."""
        key = (limit, ahead, self.cost.version, self.draft.version, self.accept.version, self._overhead_used,
               self.probing.version)
        if self._plan_cache is None or self._plan_cache[0] != key:  # else nothing it reads has changed
            k = self.choose_k(limit, ahead=ahead)
            self._plan_cache = (key, k, self.probe_interval() if k == 0 else 0)
        _, k, interval = self._plan_cache
        if k > 0 or limit <= 0:
            self.probing.drafted()
            return k, False
        if not self.probing.due(interval):
            return 0, False
        return min(self.config.probe.tokens, limit), True

    def probe_interval(self) -> int:
        """Skipped steps before the next probe (gateway/probing.py), a skipped step costing the verify fit's
        1-token step plus a skipped step's overhead; before any probe was timed its cost is the draft fit's."""
        step_ms = self.cost.predict(1) + self._overhead_used[0]
        return self.probing.interval(self.draft.predict(self.config.probe.tokens), step_ms)

    def alpha(self, kmax: int, confidence: np.ndarray | None = None) -> np.ndarray:
        alpha = self.accept.alpha[:kmax].copy()
        if confidence is not None:
            m = min(len(confidence), kmax)
            alpha[:m] = self.calibration(confidence[:m])
        return alpha

    def choose_k(
        self, limit: int, confidence: np.ndarray | None = None, sunk_ms: float | None = None, ahead: bool = False,
    ) -> int:
        """Best k in [0, min(limit, max_k)].

        Before drafting (``sunk_ms`` None) a step costs draft_ms(k) + verify_ms(k + 1) + overhead(k); to
        truncate a block already drafted, it costs sunk_ms + verify_ms(k + 1). ``ahead``: a step with k >= 1
        drafts the next block meanwhile (its verify pays the contention); ``confidence[i]`` is the
        drafter's q of token i. A choice before drafting without confidence is cached until an estimate
        it reads changes (a step that skips drafting then costs a lookup)."""
        kmax = max(0, min(limit, self.config.max_k))
        if kmax == 0:
            return 0
        key = None
        if confidence is None and sunk_ms is None:
            key = (kmax, bool(ahead), self.cost.version, self.draft.version, self.accept.version, self._overhead_used)
            if self._choice_cache is not None and self._choice_cache[0] == key:
                return self._choice_cache[1]
        gain = expected_emitted(self.alpha(kmax, confidence).tolist())
        verify = self._verify_costs(kmax, bool(ahead))
        draft_ms = self.draft.costs(kmax)
        over0, over1 = self._overhead_used if sunk_ms is None else (0.0, 0.0)
        best_k, best_rate = 0, -1.0
        for k in range(kmax + 1):
            draft = max(sunk_ms, 0.0) if sunk_ms is not None else (draft_ms[k] + over1 if k else over0)
            rate = gain[k] / (draft + verify[k])
            if rate > best_rate:  # first best, like argmax
                best_k, best_rate = k, rate
        if key is not None:
            self._choice_cache = (key, best_k)
        return best_k

    def _verify_costs(self, kmax: int, ahead: bool) -> list[float]:
        """Predicted verify ms of k = 0..kmax [kmax + 1], cached until the verify model is refitted."""
        key = (kmax, ahead, self.cost.version)
        if self._cost_cache is None or self._cost_cache[0] != key:
            ks = np.arange(kmax + 1)
            self._cost_cache = (key, self.cost.predict_many(ks + 1, (ks > 0) & ahead).tolist())
        return self._cost_cache[1]
