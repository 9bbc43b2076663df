"""What a request's steps leave behind besides their tokens: one observer fed once per draft and per verify.

``StepObserver`` keeps the loop (specserve/loop/step_loop.py) the algorithm: the loop tells it what happened, and it
feeds the request's ``SpecStats``, the verify span's attributes, the per-step ``StepRecord`` (benchmark JSONL,
metrics) and what adaptive speculation (specserve/loop/adaptive.py) learns from each step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from specserve.contract.types import DraftBlock, VerifyResult
from specserve.loop.adaptive import AdaptiveSpeculation
from specserve.loop.stats import SpecStats
from specserve.runtime import tracing as names


class StepRecord(NamedTuple):
    """One verify step, for per-step artifacts (benchmark JSONL) and metrics. (A NamedTuple, not a frozen dataclass:
    one is made every step, and a frozen dataclass's __init__ sets each of its fields through object.__setattr__.)"""

    step: int
    context_len: int  # tokens of S before the step (the pending token included)
    drafted: int
    accepted: int
    draft_ms: float  # drafter wall time spent for this step's block (0 when drafted ahead)
    verify_ms: float  # target forward time measured by the target (device time on GPU)
    verify_wall_ms: float  # verify call as the loop saw it (forward + sampling + transport)
    experts_touched: int
    tree: bool
    ahead: bool = False  # the drafter drafted the next block during this verify (contends with it)
    verify_service_ms: float = 0.0  # the target service's own handling of the verify (0 in process)
    verify_compute_ms: float = 0.0  # of which the engine's own verify call on its thread (timings.compute_ms)
    # draft-ahead (``ahead``): the drafter's wall time on the next block, how long the step still waited for it after
    # the verify came back (ahead_ms - ahead_wait_ms overlapped the verify), and whether that block was usable
    ahead_ms: float = 0.0
    ahead_wait_ms: float = 0.0
    ahead_hit: bool | None = None  # None: no block drafted ahead came back


class VerifyWalls(NamedTuple):
    """How one verify step went, as the loop saw it (made every step: a NamedTuple, as StepRecord)."""

    context_len: int  # tokens of S before the step
    verify_wall_ms: float  # the verify call
    step_ms: float  # the verify and waiting for the block drafted ahead, if one was
    ahead: bool  # a block was drafted ahead during the verify
    ahead_hit: bool | None = None  # the block drafted ahead is usable (None: none came back)
    ahead_ms: float = 0.0  # the drafter's time on it
    step_started: float | None = None  # perf_counter when the step's propose began (its overhead: the rest)
    cut_confidence: np.ndarray | None = None  # [n] confidence of drafted tokens the verify length cut (not verified)


def drafted_confidence(block: DraftBlock) -> np.ndarray | None:  # [n] float, or None
    """Each drafted token's chance of acceptance as the drafter sees it: its confidence head's (DraftBlock.confidence),
    else its q of the token; None for a tree or a drafter with neither."""
    if not block.is_chain or not len(block):
        return None
    if block.confidence:
        return np.asarray(block.confidence, dtype=float)
    if block.probs is None:
        return None
    return block.probs[list(range(len(block))), list(block.token_ids)].float().numpy()


class StepObserver:
    """One request's recording (see the module docstring). ``adaptive``: the request's chooser, or None;
    ``on_step(StepRecord)``: called after every verify step, or None."""

    def __init__(
        self,
        stats: SpecStats,
        adaptive: AdaptiveSpeculation | None,
        on_step: Callable[[StepRecord], None] | None,
        tree: bool,
    ) -> None:
        self.stats, self.adaptive, self.on_step, self.tree = stats, adaptive, on_step, tree
        self._draft_ms = 0.0  # the drafter's time on the block the next verify checks

    def drafted(self, k: int, ms: float, steady: bool = True, probe: bool = False) -> None:
        """A block of k tokens drafted (for this step, not ahead) in ``ms``; ``steady``: the drafter only
        caught up on the last step's tokens; ``probe``: adaptive's probe (AdaptiveSpeculation.plan)."""
        self.stats.draft_ms += ms
        self._draft_ms = ms
        if self.adaptive is not None and not self.tree:
            self.adaptive.observe_draft(k, ms, steady=steady, probe=probe)

    def drafted_ahead(self, ms: float) -> None:
        self.stats.draft_ahead_ms += ms

    @staticmethod
    def verify_span(span, block: DraftBlock, res: VerifyResult) -> None:
        span.set_attribute(names.ATTR_K, len(block))
        span.set_attribute(names.ATTR_TREE_SIZE, 0 if block.is_chain else len(block))
        span.set_attribute(names.ATTR_ACCEPTED, len(res.accepted_ids))
        span.set_attribute(names.ATTR_EMITTED, len(res.accepted_ids) + 1)
        span.set_attribute(names.ATTR_FORWARD_MS, res.timings.forward_ms)
        span.set_attribute(names.ATTR_EXPERTS_TOUCHED, res.experts_touched)

    def verified(self, block: DraftBlock, res: VerifyResult, walls: VerifyWalls) -> None:
        """A verify step's outcome: stats, StepRecord, adaptive's observations."""
        if walls.ahead_hit is not None:
            if walls.ahead_hit:
                self.stats.draft_ahead_hits += 1
                self.stats.draft_hidden_ms += min(walls.ahead_ms, walls.verify_wall_ms)
            if self.adaptive is not None:
                self.adaptive.observe_ahead(walls.ahead_hit)
        self.stats.record_step(len(block), len(res.accepted_ids))
        if self.on_step is not None:
            self.on_step(
                StepRecord(
                    step=self.stats.steps,
                    context_len=walls.context_len,
                    drafted=len(block),
                    accepted=len(res.accepted_ids),
                    draft_ms=self._draft_ms,
                    verify_ms=res.timings.forward_ms,
                    verify_wall_ms=walls.verify_wall_ms,
                    experts_touched=res.experts_touched,
                    tree=not block.is_chain,
                    ahead=walls.ahead,
                    verify_service_ms=res.timings.total_ms,
                    verify_compute_ms=res.timings.compute_ms,
                    ahead_ms=walls.ahead_ms,
                    ahead_wait_ms=max(0.0, walls.step_ms - walls.verify_wall_ms) if walls.ahead else 0.0,
                    ahead_hit=walls.ahead_hit,
                )
            )
        draft_ms, self._draft_ms = self._draft_ms, 0.0
        self.stats.verify_ms += res.timings.forward_ms
        if self.adaptive is not None and block.is_chain:
            overhead = None
            if walls.step_started is not None:
                overhead = max(0.0, (time.perf_counter() - walls.step_started) * 1e3 - draft_ms - walls.step_ms)
            self.adaptive.observe_verify(
                len(block),
                len(res.accepted_ids),
                res.experts_touched,
                walls.step_ms,
                confidence=drafted_confidence(block),
                ahead=walls.ahead,
                overhead_ms=overhead,
                unverified=walls.cut_confidence,
            )
