"""MoE-aware adaptive speculation: pick the block size that maximises emitted tokens per second.

Verify cost on an MoE target grows with the distinct experts a step reads, not only with its token
count, so the cost model is fitted on both (plus what drafting ahead concurrently adds; specserve/loop/cost_models.py):

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

The rule itself is specserve/loop/verify_length.py's (pure, over a precomputed table of step costs by k: ``step_costs``).
A choice reads tables, made when what they come from changes (issue #42: no per-step recomputation): the step costs
by (k, ahead) once per cost-model change (a draft timing that moves no k's least changes nothing), alpha once per
acceptance observation, the calibration as each bin's line (offset, slope), plain floats (numpy's per-call overhead
dominates a handful of positions). What is left on a step is best_length's few divisions; the verify fit, every
``refit_every`` steps, is the one amortised recomputation.
Before drafting, k maximises E[emitted | k] / (draft_ms(k) + verify_ms(k + 1) + overhead(k)); k = 0 is
target-only's rate 1 / (verify_ms(1) + overhead(0)), so speculation is off whenever it does not pay.
After a block is drafted its cost is sunk: the verify length maximises E[emitted | k] / (sunk_ms +
verify_ms(k + 1)) from each drafted position's confidence, k = 0 included (a block nobody is confident in is not
verified; a probe verifies at least one token). The positions cut count as expected observations in the
per-position estimate (AcceptanceEstimator.observe), so a drafter whose blocks are cut to nothing stops being
asked. Only which tokens are verified changes; the acceptance rule does not, so the output distribution is
untouched.

While speculation is off, a step does what a target-only step does (no drafter call: the drafter
catches up on the skipped tokens at the next propose). Now and then a probe drafts anyway, so acceptance
stays measured and speculation comes back on when it pays again; specserve/loop/probing.py spaces the probes by
their measured cost (the draft call and what the probe's step spends beyond a skipped one: ``probe_extra_ms``, the
verify of its token and a drafted step's overhead) within about 0.5% of the skipped steps' time, and by a floor that
backs off geometrically while probes keep losing (at most 1 probe in 257 steps after 6 losing ones). A probe at a
k never timed may have been dear once (a graph captured on first use): the dearest such is forgiven while
exploring; a probe at a timed k is charged in full (its dear part is a catch-up every probe pays). A draft call
that caught up more than one step (a probe, a request's first) is an upper bound of a steady call: it is a timing
of its k only where k is not settled and it undercuts k's cost.
So a probe can turn speculation back on when its k was timed only on one-offs (or never), and only steady
calls revise a settled k.

Issue #43's guards against losing to target-only where a drafter does not pay: before drafting, a k >= 1 must be
predicted to beat target-only's rate by ``AdaptiveConfig.margin`` while drafting is off; a block shorter than asked
(an n-gram without a match) refuses the positions it did not propose in what a draft call yields (``yielded``;
``observe_draft`` notes the k asked, the truncation's ``choose_k`` the block's length; a concurrent request's draft
in between can misattribute one step's count, never what is verified); and a drafted step's overhead is a skipped
step's until one was measured.

Issue #43's second half, a drafter that pays kept on (the H200 headline run: n-gram at fixed k = 2 gave 1.15x
target-only, adaptive chose k = 0 on 247 of 250 steps; replayed, specserve/bench/adaptive_replay.py):

- A draft call's yield and its cost are priced over the block's length (``planned``). Per position, ``proposed`` is
  the chance the drafter proposes it when asked, ``accept`` the chance a proposed token is accepted (what a drafted
  block is cut by, its cost sunk) and ``yielded`` the chance of both, estimated as one (so a drafter that proposes
  nothing goes off as fast as before). Before drafting, E[emitted | k] is ``yielded``'s and the verify is the one
  of the block's expected length: an empty block verifies 1 token. Before, an empty block was charged a full
  verify and, as a refusal, cut every proposed block too.
- A position not yet observed starts from the prior, not from a weak position before it, once that one had a token
  accepted lately (AcceptanceEstimator): n-gram's later positions are accepted 0.6-0.85 of the time after a first
  one at 0.3, and the chain that pays was priced out before it was ever verified.
- While drafting is on and tokens were accepted lately, it stays on until a k >= 1 is predicted to lose
  (``AdaptiveConfig.keep_margin``, 0): the 3% margin both ways turned a drafter that pays by 5-10% off on each dip
  of its estimate, and 1-token probes, a few in 250 steps, were slow to turn it back on.
- Until DECODES_TIMED 1-token verifies were timed, every DECODE_EVERY-th drafting step is a target-only step: a
  chooser that drafts from its first step had no decode timed, and its verify fit, on distinct experts, priced one
  at the smallest verify seen (a decode's experts taken as a 2-token verify's), so a drafter that lost by 8% (MTP
  on Moonlight) stayed on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specserve.loop.cost_models import DraftCostModel, VerifyCostModel
from specserve.loop.probing import ProbePolicy, ProbeSchedule
from specserve.loop.verify_length import StepCosts, best_length

AHEAD_PROBE_EVERY = 16  # every 16th step that could draft ahead does the opposite of the estimate
# a chooser that drafts from its first step never times a target-only step (a 1-token verify): the verify fit then
# prices it from drafted steps (a decode's experts taken as the smallest verify's seen), too dear, and drafting stays on
# where it loses; so until DECODES_TIMED 1-token verifies were timed, every DECODE_EVERY-th drafting step is one
DECODES_TIMED = 3
DECODE_EVERY = 8


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
    # before drafting, a k >= 1 must be predicted to beat target-only's rate by this share (the estimates are noisy
    # and a step that drafts for a predicted 1% loses when they are a little optimistic; issue #43)
    margin: float = 0.03
    # ... and, while drafting is on and tokens were accepted lately, by this share to stay on (hysteresis: a drafter
    # that pays by a few % was turned off by each dip of its noisy estimate; issue #43's headline run)
    keep_margin: float = 0.0

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
            raise ValueError(
                f"accept_memory must be >= 1 and accept_prior_weight > 0, got {self.accept_memory}, "
                f"{self.accept_prior_weight}"
            )
        if not 0.0 <= self.prior_accept <= 1.0:
            raise ValueError(f"prior_accept must be in [0, 1], got {self.prior_accept}")
        if self.calibration_bins < 1 or self.calibration_prior <= 0:
            raise ValueError("calibration_bins must be >= 1 and calibration_prior > 0")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if not -1.0 < self.keep_margin <= self.margin:
            raise ValueError(f"keep_margin must be in (-1, margin], got {self.keep_margin}")


class AcceptanceEstimator:
    """Running estimate of alpha_i = P(position i accepted | positions < i accepted).

    Per position: decayed counts of accepted / observed, plus ``prior_weight`` pseudo-observations at
    a prior mean: ``prior`` for position 0, the estimate of position i - 1 for position i (positions
    of one drafter tend to be alike; a chain's tail is seen least), but no less than ``prior`` once position i - 1
    had a token accepted lately (decayed count >= 1): a weak head does not price out a tail never seen (n-gram's
    positions after a first one at 0.3 are accepted 0.6-0.85 of the time), while a head never accepted (a drafter
    proposing nothing) keeps its tail as low as itself. Every step decays the counts of
    every position by 1 - 1/memory, so a position the chooser stopped drafting drifts back to its
    prior and gets drafted again, instead of staying at one unlucky early observation.

    ``alpha`` is a table: made once per observation (``version``), read by every choice until the next one."""

    def __init__(self, max_k: int, prior: float, memory: float, prior_weight: float = 4.0) -> None:
        self.hits = np.zeros(max_k)
        self.trials = np.zeros(max_k)
        self._prior, self._keep, self._weight = prior, 1.0 - 1.0 / memory, prior_weight
        self.version = 0  # bumped by every observation that changes the estimate
        self._alpha: tuple[int, list[float]] | None = None  # (version, alpha as plain floats)

    @property
    def alpha(self) -> list[float]:  # [max_k], plain floats (a copy: the caller may change it)
        if self._alpha is None or self._alpha[0] != self.version:
            out, mean, accepted = [], self._prior, 1.0
            for hits, trials in zip(self.hits.tolist(), self.trials.tolist()):
                prior = max(mean, self._prior) if accepted >= 1.0 else mean
                mean = (hits + self._weight * prior) / (trials + self._weight)
                out.append(mean)
                accepted = hits
            self._alpha = (self.version, out)
        return list(self._alpha[1])

    def observe(self, num_drafted: int, num_accepted: int, unverified: Sequence[float] = ()) -> None:
        """Positions 0..num_accepted-1 were accepted; position num_accepted (if drafted) was refused. ``unverified``:
        the chances (calibrated confidence) of drafted positions num_drafted.. that the step did not verify
        (specserve/loop/verify_length.py cut them): when every verified one was accepted they count as expected
        observations, position i weighted by the chance of reaching it, so a drafter whose blocks are cut to nothing
        still teaches the estimate that drafting does not pay."""
        seen = min(num_drafted, num_accepted + 1, len(self.hits))
        soft = list(unverified)[: max(0, len(self.hits) - num_drafted)] if num_accepted == num_drafted else []
        if seen == 0 and not soft:
            return
        self.hits *= self._keep
        self.trials *= self._keep
        self.hits[: min(seen, num_accepted)] += 1.0
        self.trials[:seen] += 1.0
        reach = 1.0
        for i, a in enumerate(soft, start=num_drafted):
            a = min(max(float(a), 0.0), 1.0)
            self.hits[i] += reach * a
            self.trials[i] += reach
            reach *= a
        self.version += 1


class ConfidenceCalibration:
    """Map from the drafter's q of a drafted token to its observed acceptance rate (per q bin).

    Each bin starts with ``prior`` pseudo-observations at q itself, so an unseen bin trusts q and a
    drafter whose q overstates (or understates) acceptance is corrected as steps arrive. Counts are
    halved when a bin passes ``window`` observations, so the map follows drift.

    The map is a table of plain floats, bin b's line (hits_b + prior * q) / (trials_b + prior) as its offset and
    slope, remade for the bins an observation changed: a choice reads it without numpy (a handful of positions)."""

    def __init__(self, bins: int, prior: float, window: int) -> None:
        self.hits = np.zeros(bins)
        self.trials = np.zeros(bins)
        self._prior, self._window = prior, window
        self._lines = [(0.0, 1.0)] * bins  # [bins] (offset, slope) of each bin's map

    def _bin(self, q: float) -> int:
        return min(max(int(q * len(self._lines)), 0), len(self._lines) - 1)

    def observe(self, q, num_accepted: int) -> None:
        """q [k] of a verified chain; positions up to the first refusal were observed."""
        seen = min(len(q), num_accepted + 1)
        for i in range(seen):
            b = self._bin(float(q[i]))
            self.hits[b] += 1.0 if i < num_accepted else 0.0
            self.trials[b] += 1.0
            if self.trials[b] > self._window:
                self.hits[b] /= 2
                self.trials[b] /= 2
            denominator = float(self.trials[b]) + self._prior
            self._lines[b] = (float(self.hits[b]) / denominator, self._prior / denominator)

    def calibrated(self, q) -> list[float]:
        """The map of each q [n] (plain floats in and out)."""
        out = []
        for x in q:
            x = min(max(float(x), 0.0), 1.0)
            offset, slope = self._lines[self._bin(x)]
            out.append(offset + slope * x)
        return out

    def __call__(self, q) -> np.ndarray:
        return np.asarray(self.calibrated(np.asarray(q, dtype=float).ravel().tolist()))


class AdaptiveSpeculation:
    """Chooses each step's chain length (and whether drafting ahead pays) from the cost models and
    the acceptance estimates. One instance per drafter; it outlives requests."""

    def __init__(self, config: AdaptiveConfig) -> None:
        self.config = config
        self.cost = VerifyCostModel(config.window, config.refit_every)
        self.draft = DraftCostModel(config.draft_window)
        self.accept = AcceptanceEstimator(
            config.max_k, config.prior_accept, config.accept_memory, config.accept_prior_weight
        )
        # the chance the drafter proposes drafted position i when asked for it, given it proposed < i (a full block:
        # 1; n-gram without a match proposes nothing): what a draft call yields, apart from what is accepted of it
        self.proposed = AcceptanceEstimator(config.max_k, 1.0, config.accept_memory, config.accept_prior_weight)
        # ... and the chance it proposes position i and i is accepted, given i - 1 was (a position it did not propose
        # refused): what a draft call asking for i yields, estimated as one (the product of the two estimates, each
        # near its prior, would keep a drafter that proposes nothing on)
        self.yielded = AcceptanceEstimator(
            config.max_k, config.prior_accept, config.accept_memory, config.accept_prior_weight
        )
        self.short_blocks = False  # a block shorter than asked was seen: ``proposed`` and ``yielded`` kept from then
        self.calibration = ConfidenceCalibration(config.calibration_bins, config.calibration_prior, config.window)
        self.ahead_hit_rate = 0.5  # running share of ahead blocks that were used
        self._ahead_steps = 0
        self._cost_cache: tuple | None = None  # (the models' versions, StepCosts by (kmax, ahead))
        self._choice_cache: tuple | None = None  # (inputs, k) of the last choice before drafting
        self.overhead_ms = [0.0, 0.0]  # running step overhead of k = 0 and k >= 1 steps
        self._overhead_seen = [0, 0]
        self._overhead_used = (0.0, 0.0)  # what choices charge: overhead_ms as of the last verify refit
        self._plan_cache: tuple | None = None  # (inputs, k, probe interval) of the last plan
        self.probing = ProbeSchedule(config.probe)  # skipped steps, probes made and their cost
        # (k asked, tokens the drafter proposed or None) of the last draft call, until its verify is observed: a
        # drafter that proposes fewer than asked (n-gram without a match) is refused the positions it did not draft
        self._asked: tuple[int, int | None] | None = None
        self._on = False  # the last plan drafted (not a probe): speculation is on
        self._untimed = 0  # drafting steps planned while 1-token verifies were not yet timed DECODES_TIMED times

    def observe_draft(self, k: int, ms: float, steady: bool = True, probe: bool = False) -> None:
        """A draft call asked for k tokens and took ms (drafting ahead is not observed: it overlaps).
        ``steady``: the drafter was in step (the request's previous step drafted); otherwise the call
        also caught up on skipped tokens (or started the drafter's session), so it is an upper bound of a
        steady call: a timing of k only where it undercuts k's cost and k is not settled (module docstring).
        ``probe``: ``plan`` made it a probe (charged with what its step spends beyond a skipped one; forgivable as a
        possible one-off only if k was never timed)."""
        self._asked = (k, None)
        if probe:
            self.probing.observe(ms + self.probe_extra_ms(k), forgivable=not self.draft.timed(k))
        if steady or (not self.draft.settled(k) and ms < self.draft.predict(k)):
            self.draft.observe(k, ms)

    def probe_extra_ms(self, k: int) -> float:
        """What a step verifying k drafted tokens spends beyond a skipped step, its draft call aside: the verify of
        k + 1 tokens against 1 and a drafted step's extra overhead (by the current fit; >= 0)."""
        verify = self.cost.table(max(k, 1))
        extra = verify[k] - verify[0] + self._overhead_used[1] - self._overhead_used[0]
        return max(extra, 0.0)

    def observe_overhead(self, drafted: bool, ms: float) -> None:
        """One step's wall time outside its draft and verify calls; charged from the next verify refit on."""
        i = int(drafted)
        self._overhead_seen[i] += 1
        old = self.overhead_ms[i]
        self.overhead_ms[i] = ms if self._overhead_seen[i] == 1 else old + self.config.ema * (ms - old)

    def observe_verify(
        self,
        num_drafted: int,
        num_accepted: int,
        experts: int,
        ms: float,
        confidence: np.ndarray | None = None,
        ahead: bool = False,
        overhead_ms: float | None = None,
        unverified: np.ndarray | None = None,
    ) -> None:
        """One verified chain; ``confidence`` [num_drafted] is the confidence of its tokens (a confidence head's, or
        q), ``ahead`` whether the drafter drafted the next block meanwhile, ``overhead_ms`` the step's time outside
        its draft and verify calls, ``unverified`` the confidence of the drafted tokens the step cut."""
        if overhead_ms is not None:
            self.observe_overhead(num_drafted > 0, overhead_ms)
        asked, self._asked = self._asked, None
        cut = 0 if unverified is None else len(unverified)
        missing, proposed = 0, None
        if asked is not None and asked[1] is not None and num_drafted + cut == asked[1]:
            missing = max(0, asked[0] - asked[1])  # positions the drafter did not propose: refused
            proposed = min(asked[1], asked[0])  # a block of asked[1] of the asked[0] tokens
        elif asked is not None and asked[1] is None and num_drafted == 0:
            missing, proposed = asked[0], 0  # an empty block (truncate never saw it): position 0 refused
        if missing and not self.short_blocks:  # the first short block: the yield was the acceptance until now
            self.short_blocks = True
            self.yielded.hits[:], self.yielded.trials[:] = self.accept.hits, self.accept.trials
        if self.short_blocks and proposed is not None:
            self.proposed.observe(asked[0], proposed)
        version = self.cost.version
        self.cost.observe(num_drafted + 1, experts, ms, ahead)
        if self.cost.version != version:
            # a drafted step's overhead before any was seen is a skipped one's (0 made drafting look cheaper than a
            # skipped step to a chooser whose drafter only ever proposed empty blocks)
            self._overhead_used = (self.overhead_ms[0], self.overhead_ms[1 if self._overhead_seen[1] else 0])
        soft = [] if unverified is None or not len(unverified) else self.calibration.calibrated(unverified)
        self.accept.observe(num_drafted, num_accepted, soft)
        if self.short_blocks:
            self.yielded.observe(num_drafted, num_accepted, soft + [0.0] * missing)
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
        probe of ``ProbePolicy.tokens`` (specserve/loop/probing.py). Shared by all requests of the drafter: probes
        are spaced over all of its steps."""
        key = (
            limit,
            ahead,
            self.cost.version,
            self.draft.version,
            self.accept.version,
            self.proposed.version,
            self.yielded.version,
            self._overhead_used,
            self.probing.version,
            self._on,
        )
        if self._plan_cache is None or self._plan_cache[0] != key:  # else nothing it reads has changed
            k = self.choose_k(limit, ahead=ahead)
            self._plan_cache = (key, k, self.probe_interval() if k == 0 else 0)
        _, k, interval = self._plan_cache
        if limit <= 0:
            return 0, False
        self._on = k > 0 and self.accept.hits[0] >= 1.0  # drafting, and a drafted token was accepted lately
        if k > 0 and self.cost.seen(1) < DECODES_TIMED:
            self._untimed += 1
            if self._untimed % DECODE_EVERY == 0:
                return 0, False  # a target-only step, to time one
        if k > 0:
            self.probing.drafted()
            return k, False
        if not self.probing.due(interval):
            return 0, False
        return min(self.config.probe.tokens, limit), True

    def probe_interval(self) -> int:
        """Skipped steps before the next probe (specserve/loop/probing.py), a skipped step costing the verify fit's
        1-token step plus a skipped step's overhead; before any probe was timed its cost is the draft fit's plus what
        its step spends beyond a skipped one (``probe_extra_ms``)."""
        step_ms = self.cost.predict(1) + self._overhead_used[0]
        tokens = self.config.probe.tokens
        return self.probing.interval(self.draft.predict(tokens) + self.probe_extra_ms(tokens), step_ms)

    def alpha(self, kmax: int, confidence=None) -> list[float]:  # [kmax] plain floats; confidence [n] or None
        alpha = self.accept.alpha[:kmax]
        if confidence is not None:
            m = min(len(confidence), kmax)
            alpha[:m] = self.calibration.calibrated(confidence[:m])
        return alpha

    def choose_k(
        self,
        limit: int,
        confidence: np.ndarray | None = None,
        sunk_ms: float | None = None,
        ahead: bool = False,
        least: int = 0,
    ) -> int:
        """Best k in [least, min(limit, max_k)] by specserve/loop/verify_length.py's rule over ``step_costs``' table.

        Before drafting (``sunk_ms`` None) a step costs draft_ms(k) + verify_ms(k + 1) + overhead(k); to
        cut a block already drafted, it costs sunk_ms + verify_ms(k + 1), k = 0 (verify none of it) included.
        ``ahead``: a step with k >= 1 drafts the next block meanwhile (its verify pays the contention);
        ``confidence[i]``: the drafter's confidence in token i (a confidence head's, or its q), calibrated. A choice
        before drafting without confidence is cached until an estimate it reads changes (a step that skips drafting
        then costs a lookup)."""
        kmax = max(0, min(limit, self.config.max_k))
        if sunk_ms is not None and self._asked is not None and self._asked[1] is None:
            self._asked = (self._asked[0], limit)  # the block the last draft call proposed: ``limit`` tokens
        if kmax == 0:
            return 0
        key = None
        if confidence is None and sunk_ms is None:
            key = (
                kmax,
                bool(ahead),
                self.cost.version,
                self.draft.version,
                self.accept.version,
                self.proposed.version,
                self.yielded.version,
                self._overhead_used,
                least,
                self._on,
            )
            if self._choice_cache is not None and self._choice_cache[0] == key:
                return self._choice_cache[1]
        if sunk_ms is not None:  # a drafted block's cost is sunk (no margin), its length known
            k = best_length(self.alpha(kmax, confidence), self.step_costs(kmax, bool(ahead)), sunk_ms, least)
        else:  # a draft call may propose less than asked: its chance of yielding each position, and the verify then
            alpha, costs = self.planned(kmax, bool(ahead), confidence)
            k = best_length(alpha, costs, None, least, self.config.keep_margin if self._on else self.config.margin)
        if key is not None:
            self._choice_cache = (key, k)
        return k

    def planned(self, kmax: int, ahead: bool = False, confidence=None) -> tuple[list[float], StepCosts]:
        """What a draft call asking for k = 0..kmax tokens yields, before it is made: the chance of each position being
        proposed and accepted (``yielded``) and the step costs with the verify expected over the block's length by
        ``proposed`` (a block of l < k tokens verifies l + 1: an empty one is a target-only step's verify). (alpha,
        ``step_costs``) for a drafter that has proposed all it was asked for (neither estimate is kept until it did not:
        their observations were a quarter of a step's chooser time). A table per (kmax, ahead, proposed's
        version), made with the step costs and dropped with them."""
        alpha, costs = self.alpha(kmax, confidence), self.step_costs(kmax, ahead)
        if not self.short_blocks:
            return alpha, costs  # nothing short seen: the yield is the acceptance, the block full
        proposed = self.proposed.alpha[:kmax]
        key = (kmax, ahead, self.proposed.version)
        planned = self._cost_cache[1].get(key)  # made with the step costs, dropped with them
        if planned is None:
            verify, reach = [costs.verify_ms[0]], [1.0]  # reach[l]: the chance the block has >= l tokens
            for p in proposed:
                reach.append(reach[-1] * p)
            for k in range(1, kmax + 1):  # l = 0..k - 1: the block stopped at l; k: it is full
                shares = [reach[i] - reach[i + 1] for i in range(k)] + [reach[k]]
                verify.append(sum(w * costs.verify_ms[i] for i, w in enumerate(shares)))
            planned = self._cost_cache[1][key] = StepCosts(tuple(verify), costs.draft_ms, costs.overhead_ms)
        return self.yielded.alpha[:kmax], planned

    def step_costs(self, kmax: int, ahead: bool = False) -> StepCosts:
        """The table specserve/loop/verify_length.py reads: verify ms of k + 1 tokens (expected experts) and draft ms of k,
        k = 0..kmax, and the step overheads: made once per (kmax, ahead) until a cost model changes, then read."""
        version = (self.cost.version, self.draft.version, self._overhead_used)
        if self._cost_cache is None or self._cost_cache[0] != version:
            self._cost_cache = (version, {})
        tables = self._cost_cache[1]
        costs = tables.get((kmax, ahead))
        if costs is None:
            verify = self.cost.table(kmax, ahead)
            costs = tables[kmax, ahead] = StepCosts(verify, tuple(self.draft.costs(kmax)), tuple(self._overhead_used))
        return costs
