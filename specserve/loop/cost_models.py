"""The chooser's cost models (specserve/loop/adaptive.py): verify time fitted on tokens, distinct experts and drafting
ahead (VerifyCostModel), draft time per block size (DraftCostModel), both by least squares with coefficients >= 0
(nonneg_lstsq). Their formulas are in adaptive.py's docstring."""

from __future__ import annotations

from collections import deque
from itertools import combinations

import numpy as np

IDLE_REFIT_FACTOR = 16  # the verify fit's refit interval is this many times longer while speculation is off


class Subsets:
    """nonneg_lstsq's column subsets for P columns tried in ``order``: which they are and their masks, made once (a
    cost model's fit reuses them: making them was a tenth of a fit)."""

    def __init__(self, p: int, order: tuple[int, ...] | None = None) -> None:
        self.p, self.order = p, tuple(range(p)) if order is None else order
        self.cols = [cols for size in range(1, p + 1) for cols in combinations(self.order, size)]
        self.mask = np.zeros((len(self.cols), p), dtype=bool)  # [S, P]
        for i, cols in enumerate(self.cols):
            self.mask[i, list(cols)] = True
        self.both = self.mask[:, :, None] & self.mask[:, None, :]  # [S, P, P]
        self.pad = np.where(self.mask, 0.0, 1.0)[:, :, None] * np.eye(p)  # [S, P, P]: identity on columns left out


def nonneg_lstsq(
    x: np.ndarray, y: np.ndarray, order: tuple[int, ...] | None = None, subsets: Subsets | None = None
) -> np.ndarray:
    """min |x c - y| with every c >= 0 (x [N, P], y [N], small P); ``subsets``: Subsets(P, order), made here if not given.

    The optimum is the unconstrained fit on some subset of columns; every well-conditioned subset
    whose fit is non-negative is tried (from the normal equations, all subsets in one batched solve),
    smaller subsets first and in ``order`` within a size, and a later one wins only if it fits clearly
    better. So collinear columns (tokens and experts move together) never give opposite-signed
    coefficients, and a tie goes to the earlier column in ``order``.
    """
    p = x.shape[1]
    sub = Subsets(p, order) if subsets is None else subsets
    scale = np.sqrt((x * x).sum(axis=0))
    scale[scale == 0] = 1.0
    xs = x / scale  # unit columns: the conditioning test below is scale-free
    gram, xty, yty = xs.T @ xs, xs.T @ y, float(y @ y)
    mask = sub.mask
    # each subset's normal equations, padded to P x P with the identity on the columns it leaves out
    g = np.where(sub.both, gram, 0.0) + sub.pad
    ok = np.linalg.eigvalsh(g)[:, 0] >= 1e-9  # (near-)collinear or empty columns: skip
    c = np.zeros((len(sub.cols), p))
    c[ok] = np.linalg.solve(g[ok], np.where(mask[ok], xty, 0.0)[..., None])[..., 0]
    err = yty - c @ xty  # residual of each subset's least-squares fit
    best, best_err = np.zeros(p), yty
    for i in np.flatnonzero(ok & (c >= 0).all(axis=1)):
        if err[i] < best_err - 1e-9 * (1.0 + abs(best_err)):
            best, best_err = c[i], float(err[i])
    return best / scale


def group_medians(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [N] float, [N] int
    """Each value's group's median, as np.median gives it, and the group's size (groups: equal keys [N]), from one
    sort of all."""
    order = np.lexsort((values, keys))
    k, v = keys[order], values[order]
    new_group = np.empty(len(k), dtype=bool)
    new_group[0] = True
    np.not_equal(k[1:], k[:-1], out=new_group[1:])
    starts = np.flatnonzero(new_group)
    counts = np.diff(starts, append=len(k))
    low, high = v[starts + (counts - 1) // 2], v[starts + counts // 2]
    medians, sizes = np.empty(len(k)), np.empty(len(k), dtype=np.int64)
    medians[order] = np.repeat(np.where(counts % 2 == 1, high, (low + high) / 2), counts)
    sizes[order] = np.repeat(counts, counts)
    return medians, sizes


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
        self._tables: dict = {}  # table()'s, as of the fit "version": ms by ahead flag
        self._subsets = Subsets(4, self._ORDER)

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
        medians, sizes = group_medians(x[:, 1] * 2 + x[:, 3], y)  # by (n, ahead) as one key
        keep = (sizes < 3) | (y <= 2.0 * medians)  # in groups of 3 or more
        x, y = x[keep], y[keep]
        if len(np.unique(x[:, 1])) < 3:
            x[:, 2] = 0.0  # the experts column left out (an empty column gets coefficient 0)
        self.coef = nonneg_lstsq(x, y, self._ORDER, self._subsets)

    @property
    def observed(self) -> int:
        return min(self._count, len(self._y))

    def seen(self, n_tokens: int) -> int:
        """Verifies of ``n_tokens`` tokens observed, over the model's life."""
        return self._experts_by_n.get(n_tokens, (0.0, 0))[1]

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

    def table(self, kmax: int, ahead: bool = False) -> tuple[float, ...]:
        """[kmax + 1] predicted ms of a verify of k + 1 tokens, k = 0..kmax (a k >= 1 step drafting ahead when
        ``ahead``), plain floats; made once per fit (``version``) and size, then read."""
        if self._tables.get("version") != self.version:
            self._tables = {"version": self.version}
        made = self._tables.get(ahead)
        if made is None or len(made) <= kmax:  # one table per flag, as long as the longest asked for
            ks = np.arange(max(kmax, 8) + 1)
            made = self._tables[ahead] = tuple(self.predict_many(ks + 1, (ks > 0) & ahead).tolist())
        return made[: kmax + 1]

    def predict_many(self, n_tokens: np.ndarray, ahead: np.ndarray | bool = False) -> np.ndarray:
        """Predicted ms for each n [K] (expected experts), ``ahead`` [K] or one flag for all."""
        n = np.asarray(n_tokens, dtype=float)
        x = np.stack(
            [np.ones_like(n), n, self.expected_experts(n), np.broadcast_to(np.asarray(ahead, dtype=float), n.shape)],
            axis=-1,
        )
        return np.maximum(x @ self.coef, 1e-6)

    def predict(self, n_tokens: int, experts: float | None = None, ahead: bool = False) -> float:
        e = float(self.expected_experts(n_tokens)) if experts is None else experts
        return max(float(self.coef @ np.array([1.0, n_tokens, e, float(ahead)])), 1e-6)

    def heldout_error(self, steps: list[tuple]) -> float:
        """Median relative error |predicted - measured| / measured over steps the fit did not see.

        Each step is (n, e, ms) or (n, e, ms, ahead)."""
        errs = [
            abs(self.predict(s[0], s[1], bool(s[3]) if len(s) > 3 else False) - s[2]) / s[2] for s in steps if s[2] > 0
        ]
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
        settled = self.settled(k)
        timings.append(ms)
        least = min(timings)
        if least != self._least.get(k) or settled != self.settled(k):  # else every cost stays as it was
            self._least[k] = least
            self.fit()

    def timed(self, k: int) -> bool:
        """Whether k has a timing (a steady call's, or a catch-up's that undercut it)."""
        return bool(self._timings.get(k))

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
            ((k, ms),) = pts
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
