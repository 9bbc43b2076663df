"""The draft's proposer on its own thread (runtime/worker.py ``OneThread``): sessions, their token limits,
idle expiry and the mapped hidden-row buffers.

A proposal is a step of the session host (runtime/session_host.py), like the target's verify: one queue, one
in-flight count, one reply path (a shared-memory caller's reply leaves from the drafter thread). Proposals run
one at a time (``max_batch=1``: a drafter batches nothing, and each reply leaves as soon as its block is there).

Servicers only await (server.py is the gRPC servicer).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.contract.types import SharedRows
from specserve.draft_service.drafter_errors import ProposerError
from specserve.errors import SpecserveError
from specserve.protos import convert
from specserve.protos.specserve.v1 import common_pb2
from specserve.runtime import tracing as tn
from specserve.runtime.device_stream import enter_own_stream
from specserve.runtime.hidden_share import (
    HOST_SHM,
    HiddenHandle,
    HiddenShareDenied,
    HiddenShareError,
    HiddenView,
    fetch_segment,
)
from specserve.runtime.session_host import SessionHost, build_on_thread
from specserve.runtime.worker import OneThread

DEFAULT_MAX_DRAFT_TOKENS = 256  # tokens (chain length or tree nodes) one proposal may ask for


class DrafterFull(SpecserveError):
    """No room for another session or more tokens (RESOURCE_EXHAUSTED; the gateway goes target-only)."""


class UnmappableShare(SpecserveError):
    """A session's hidden-share handle cannot be mapped here (FAILED_PRECONDITION: the gateway then sends
    this draft's sessions their rows as bytes)."""


@dataclass(frozen=True)
class WireRows:
    """A request's hidden rows still in their wire message: ``decode()`` (a tensor, a SharedRows of the session's
    mapped buffer, or None) runs on the drafter thread, not on the event loop (rows as bytes are [n, layers * hidden] float32)."""

    decode: Callable[[], object]


class ProposeExpired(SpecserveError):
    """A proposal that waited for the drafter thread past its time budget (DEADLINE_EXCEEDED): its
    caller has given up on it, so it is not drafted at all."""


@dataclass(frozen=True)
class DraftLimits:
    """What one draft service holds at most, and what one proposal may ask (flags of `specserve draft`)."""

    max_sessions: int = 64  # open sessions; StartSession beyond: RESOURCE_EXHAUSTED
    max_total_tokens: int = 262144  # tokens of S held over all sessions (bounds the drafter's memory)
    session_idle_timeout_s: float = 300.0  # a session no call touched for this long is released
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS  # chain length or tree nodes of one proposal
    max_tree_top_k: int = 16  # children expanded per tree node
    max_tree_depth: int = 64  # tree levels (the drafter also caps them at its max_block_size)
    propose_budget_s: float = 5.0  # a proposal still waiting for the drafter thread after this is dropped

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_total_tokens", "max_draft_tokens", "max_tree_top_k", "max_tree_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("session_idle_timeout_s", "propose_budget_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class _Proposal:
    """One propose step's input (the host's payload): asked at ``asked_at`` (time.monotonic); the session
    will hold ``new_len`` tokens of S once it has drafted."""

    asked_at: float
    prefix_len: int
    append_ids: list[int]
    append_hidden: object  # a tensor, WireRows, SharedRows or None
    num_tokens: int
    tree: object  # TreeSpec | None
    new_len: int


@dataclass(frozen=True)
class _Proposed:
    """One propose step's result: the block as its wire message and the proposer's own ms."""

    message: common_pb2.DraftBlock
    compute_ms: float
    new_len: int


class DrafterWorker:
    """Owns the proposer on one thread (its SessionHost, runtime/session_host.py); every proposer call runs
    there, one at a time. Counts the tokens each session holds (refusing sessions and growth beyond
    ``limits``) and releases sessions that no call touched for ``limits.session_idle_timeout_s``."""

    def __init__(self, proposer, thread: OneThread | None = None, limits: DraftLimits | None = None) -> None:
        self.proposer = proposer
        self.limits = limits or DraftLimits()
        self.host = SessionHost(
            "draft",
            thread or OneThread("drafter"),
            self.limits.session_idle_timeout_s,
            run_batch=self._run_proposals,
            max_batch=1,
            settle=self._settle,
        )
        self.active = self.host.sessions  # session id -> len(S) it holds
        self.proposals = 0
        # session id -> its mapping of the target's hidden-row buffer (opened, read and closed on the drafter thread)
        self.views: dict[str, HiddenView] = self.host.buffers
        self.hidden_rows_shared = 0  # rows read from mapped buffers (GetStats)
        self._undoing: set[asyncio.Task] = set()  # cancelled starts being undone (_undo_start)

    @property
    def expired(self) -> int:
        return self.host.expired

    @classmethod
    async def build(cls, factory: Callable[[], object], limits: DraftLimits | None = None) -> DrafterWorker:
        """Build the proposer on the drafter thread itself (loading never blocks the event loop); on a GPU the thread
        then runs its work on a stream of its own (runtime/device_stream.py: harmless in a process of its own, and
        what lets a drafter in one process with a target overlap its verify)."""
        thread, proposer = await build_on_thread("drafter", factory)
        await thread.call(enter_own_stream, getattr(proposer, "device", None))
        return cls(proposer, thread, limits)

    def start_expiry(self) -> None:
        self.host.start_expiry(self.release, lambda sid: True)

    async def call(self, fn, *args):
        return await self.host.call(fn, *args)

    def _check_room(self, session_id: str, new_len: int) -> None:
        held = sum(self.active.values()) - self.active.get(session_id, 0)
        if held + new_len > self.limits.max_total_tokens:
            raise DrafterFull(
                f"{new_len} tokens for session {session_id[:40]!r} beside the {held} held would exceed the "
                f"limit of {self.limits.max_total_tokens} (--max-total-tokens)"
            )

    async def start(self, session_id, token_ids, hidden, sampling, share: HiddenHandle | None = None) -> None:
        """hidden: the rows as a tensor, or (with ``share``, the target's buffer) a SharedRows of it."""
        if session_id in self.active:  # a restarted request re-opens: drop the stale copy first
            await self.release(session_id)
        if len(self.active) >= self.limits.max_sessions:
            raise DrafterFull(
                f"{len(self.active)} sessions open, the limit is {self.limits.max_sessions} (--max-sessions)"
            )
        self._check_room(session_id, len(token_ids))
        self.active[session_id] = len(token_ids)
        self.host.enter(session_id)
        fetched = _Fetched()
        fetch: asyncio.Future | None = None  # the segment's fetch while it has not come back
        try:
            if share is not None and share.kind == HOST_SHM:  # the segment's hand-over waits on the target: not
                fetch = asyncio.ensure_future(asyncio.to_thread(self._fetch, share))  # on the drafter's thread
                fetched.fd = await asyncio.shield(fetch)
                fetch = None
            await self.call(self._start_on_thread, session_id, token_ids, hidden, sampling, share, fetched)
        except asyncio.CancelledError:
            # the caller went (a gateway killed mid-StartSession): a fetch or a start already on its thread runs
            # to its end there (the start maps the target's buffer and opens the proposer's session); both are
            # undone after it, as the target frees a cancelled prefill (before: they stayed for the process's life)
            self._forget(session_id)
            undo = asyncio.get_running_loop().create_task(self._undo_start(session_id, fetch, fetched))
            self._undoing.add(undo)  # held until it ends (the loop keeps only a weak reference)
            undo.add_done_callback(self._undoing.discard)
            raise
        except BaseException:
            self._forget(session_id)
            fetched.close()
            raise
        finally:
            self.host.leave(session_id)
        fetched.close()  # a descriptor no start took (none: the start maps it)

    async def _undo_start(self, session_id: str, fetch: asyncio.Future | None, fetched: _Fetched) -> None:
        """A cancelled start's cleanup: the fetched descriptor closed once its fetch is back (no start ran), else
        the session's buffer and proposer state released on the drafter thread after the start (calls run in
        order; a start that had not begun does not run)."""
        if fetch is not None:
            try:
                os.close(await fetch)
            except Exception:  # noqa: BLE001 - the fetch failed: nothing to close
                pass
            return
        try:
            await self.host.release_on_thread(self._release_on_thread, session_id)
        finally:
            fetched.close()

    @staticmethod
    def _fetch(share: HiddenHandle) -> int:
        try:
            return fetch_segment(share)
        except HiddenShareDenied:
            raise  # PERMISSION_DENIED: a name without its key (whoever listed /dev/shm)
        except HiddenShareError as exc:
            raise UnmappableShare(str(exc)) from None

    async def propose(
        self, session_id, prefix_len, append_ids, append_hidden, num_tokens, tree, answer=None
    ) -> tuple[common_pb2.DraftBlock, float, bool]:
        """The drafted block as its wire message, the proposer's own time in ms (its compute_ms), and
        whether ``answer(block message, compute_ms)`` (optional; run on the drafter thread as soon as the
        block is there) already sent the caller its reply."""
        if session_id not in self.active:
            raise ProposerError(f"session_id {session_id!r} is not open (StartSession first)")
        new_len = max(0, prefix_len) + len(append_ids)
        self._check_room(session_id, new_len)
        step = _Proposal(time.monotonic(), prefix_len, append_ids, append_hidden, num_tokens, tree, new_len)
        host_answer = None if answer is None else (lambda res, queue_ms, batch: answer(res.message, res.compute_ms))
        out = await self.host.step(session_id, step, host_answer)
        return out.result.message, out.result.compute_ms, out.answered

    def _settle(self, session_id: str, res: _Proposed) -> None:
        """On the loop, when a proposal has run: the tokens the session now holds."""
        self.proposals += 1
        if session_id in self.active:
            self.active[session_id] = res.new_len

    def _start_on_thread(
        self, session_id, token_ids, hidden, sampling, share: HiddenHandle | None, fetched: _Fetched
    ) -> None:
        if share is not None:
            try:
                view = HiddenView.open(share, fetched.take())
            except HiddenShareDenied:
                raise  # PERMISSION_DENIED: a name without its key (whoever listed /dev/shm)
            except HiddenShareError as exc:
                raise UnmappableShare(str(exc)) from None
            self.views[session_id] = view
        try:
            self.proposer.start(session_id, token_ids, self._rows(session_id, hidden), sampling)
        except BaseException:
            self.host.close_buffer(session_id)
            raise

    def _rows(self, session_id: str, hidden):
        """On the drafter thread: the rows of a WireRows (decoded here), and the tensor of a SharedRows (rows
        [start, stop) read from the session's mapped buffer, a device copy, then its tail: one
        [stop - start + m, F] tensor)."""
        if isinstance(hidden, WireRows):
            hidden = hidden.decode()
        if not isinstance(hidden, SharedRows):
            return hidden
        view = self.views.get(session_id)
        if view is None:
            raise HiddenShareError(
                f"hidden rows [{hidden.start}, {hidden.stop}) of a shared buffer, but session "
                f"{session_id[:40]!r} maps none (StartSession gave no hidden_share)"
            )
        rows = view.read(hidden.start, hidden.stop)
        self.hidden_rows_shared += hidden.stop - hidden.start
        if hidden.tail is not None:
            rows = torch.cat([rows, hidden.tail.to(rows.device)], dim=0)
        return rows

    def _release_on_thread(self, session_id: str) -> None:
        self.host.close_buffer(session_id)
        self.proposer.release(session_id)

    def _forget(self, session_id: str) -> None:
        self.active.pop(session_id, None)
        self.host.last_used.pop(session_id, None)

    def _run_proposals(self, pairs: list[tuple[str, _Proposal]]) -> list:
        """On the drafter thread: the host's batch (one proposal: max_batch=1), each result or its error."""
        out: list = []
        for session_id, step in pairs:
            try:
                out.append(self._propose_on_thread(session_id, step))
            except Exception as exc:  # noqa: BLE001 - returned to that session's caller
                out.append(exc)
        return out

    def _propose_on_thread(self, session_id: str, step: _Proposal) -> _Proposed:
        """Propose and serialize (probs may be MBs and on the device; the copy to host and the byte packing
        stay off the event loop). A proposal that waited here past the time budget (the thread was busy with
        others) is dropped: the work queue cannot pile up."""
        waited = time.monotonic() - step.asked_at
        if waited > self.limits.propose_budget_s:
            raise ProposeExpired(
                f"waited {waited:.1f} s for the drafter, over the budget of {self.limits.propose_budget_s} s "
                "(--propose-budget-s)"
            )
        rows = self._rows(session_id, step.append_hidden)
        t0 = time.perf_counter()
        block = self.proposer.propose(session_id, step.prefix_len, step.append_ids, rows, step.num_tokens, step.tree)
        compute_ms = (time.perf_counter() - t0) * 1e3
        return _Proposed(convert.draft_block_to_proto(block), compute_ms, step.new_len)

    async def release(self, session_id: str) -> bool:
        if not self.host.forget(session_id, ProposerError(f"session_id {session_id[:40]!r} was released")):
            return False
        await self.host.release_on_thread(self._release_on_thread, session_id)
        return True

    async def close(self) -> None:
        await self.host.close()


def observe_worker(worker: DrafterWorker) -> None:
    """The draft service's own metrics (sessions, proposals), read at export or scrape."""
    tn.observe_service(
        gauges={tn.DRAFT_SESSIONS: lambda: len(worker.active)},
        counters={tn.DRAFT_PROPOSALS: lambda: worker.proposals},
    )


class _Fetched:
    """A host_shm segment's descriptor between its fetch and the mapping that takes it (closed if nothing does)."""

    def __init__(self) -> None:
        self.fd = -1

    def take(self) -> int:
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        fd = self.take()
        if fd >= 0:
            os.close(fd)
