"""The session host: what the draft and the target service each run around their model.

One host per service (instance state; the draft's DrafterWorker and the target's EngineWorker each own one):

- **the model's thread** (runtime/worker.py ``OneThread``) and its queue. Without a batching hook a call goes
  straight to the thread (calls run in arrival order; one whose caller was cancelled before it started
  does not run). With one (the target's ``run_batch``), calls and steps share one queue handed over by loop
  callbacks (``_dispatch``): a call or a step that finds the thread free goes to it at once, every step
  waiting when it becomes free runs as ONE ``run_batch`` call, and the thread's answer completes the
  callers' futures directly. Calls and batches take the thread in arrival order (a batch's place is its
  oldest step's);
- **the session table**: the len(S) each open session holds (-1 while it is being opened), the loop time of
  its last call, its calls in flight (``enter``/``leave``; every ``step`` counts itself), and the idle expiry
  that releases a session no call touched for ``idle_timeout_s`` and none is in flight for;
- **the sessions' hidden-row buffers** (the target's ``HiddenBuffer``, the draft's ``HiddenView``): closed
  with their session, and all of them at ``close``, so nothing stays in /dev/shm;
- **replies that leave from the model's thread** (``answered_by``): a shared-memory session's reply is
  encoded and sent there as soon as the result is there; an answer that fails or declines leaves the reply
  to the loop.

The servicers' side (the gRPC stream, the shared-memory channels, Release) is session_serving.py.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.runtime.servers_common import cancel_and_wait
from specserve.runtime.worker import OneThread

# on the thread: one batch of (session id, step input) -> one result (or Exception) per step, in order
RunBatch = Callable[[list[tuple[str, Any]]], list]
# on the thread, with a step's result, its queue ms and the batch size: True when it sent the reply itself
Answer = Callable[[Any, float, int], bool]


@dataclass
class _Step:
    session_id: str
    payload: Any
    future: asyncio.Future
    answer: Answer | None = None
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class _Call:
    """A non-step call (open, release, stats) waiting for the model's thread."""

    fn: Callable
    args: tuple
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class StepOutcome:
    result: Any
    queue_ms: float
    batch_size: int
    answered: bool = False  # the caller's reply already went out from the model's thread (Answer)


def answered_by(answer: Callable[..., object] | None, *args) -> bool:
    """On the model's thread: run a step's answer (None: there is none); False when it declines or fails
    (the loop then replies, as without one)."""
    if answer is None:
        return False
    try:
        return bool(answer(*args))
    except Exception:  # noqa: BLE001 - the loop answers instead
        return False


async def build_on_thread(name: str, factory: Callable[[], object], kind=OneThread) -> tuple[OneThread, object]:
    """A new model thread (``kind``: OneThread, or LoopThread), and the model built on it (loading never blocks
    the event loop)."""
    thread = kind(name)
    model = await thread.call(factory)
    return thread, model


class SessionHost:
    """A service's model thread and the sessions it holds (see the module docstring).

    ``settle(session_id, result)`` (with ``run_batch``) runs on the loop for each step's result before its
    caller hears of it, whether or not the caller still waits (the step changed the model's state)."""

    def __init__(
        self,
        role: str,
        thread: OneThread,
        idle_timeout_s: float,
        run_batch: RunBatch | None = None,
        max_batch: int = 256,
        settle: Callable[[str, Any], None] | None = None,
    ) -> None:
        self.role = role  # "draft" / "target": log lines, errors
        self.thread = thread
        self.idle_timeout_s = idle_timeout_s
        self.max_batch = max_batch
        self._run_batch, self._settle = run_batch, settle
        self.sessions: dict[str, int] = {}  # session id -> len(S) it holds (-1 while it is being opened)
        self.last_used: dict[str, float] = {}  # session id -> loop time of its last call
        self.in_flight: dict[str, int] = {}  # session id -> its calls not answered yet (absent: none)
        # session id -> its hidden-row buffer (made, used and closed on the model's thread; all closed at close)
        self.buffers: dict[str, Any] = {}
        self.expired = 0  # sessions released by the idle timeout
        self.steps = 0  # steps run in batches
        self.closed = False
        self._reaper: asyncio.Task | None = None
        self._queue: list[_Step] = []  # steps waiting for the thread (with run_batch)
        self._calls: deque[_Call] = deque()  # other calls waiting for it (with run_batch)
        self._busy = False  # a call or a batch runs on the thread (with run_batch)

    # ------------------------------------------------------------------------------ sessions
    def touch(self, session_id: str) -> None:
        self.last_used[session_id] = asyncio.get_running_loop().time()

    def enter(self, session_id: str) -> None:
        """A call of the session starts (it cannot expire until it ``leave``s)."""
        self.in_flight[session_id] = self.in_flight.get(session_id, 0) + 1
        self.touch(session_id)

    def leave(self, session_id: str) -> None:
        """A call of the session has its answer (its idle time counts from now)."""
        left = self.in_flight.get(session_id, 1) - 1
        if left > 0:
            self.in_flight[session_id] = left
        else:
            self.in_flight.pop(session_id, None)
        if session_id in self.sessions:
            self.touch(session_id)

    def start_expiry(self, release: Callable[[str], Awaitable[object]], may_expire: Callable[[str], bool]) -> None:
        """Release (``release(session_id)``) the sessions no call touched for ``idle_timeout_s`` that
        ``may_expire`` lets go and that have no call in flight (a client or gateway that went away without
        releasing cannot hold the model's memory for ever)."""
        self._reaper = asyncio.get_running_loop().create_task(
            self._expire_idle(release, may_expire), name=f"{self.role}-idle-sessions"
        )

    async def _expire_idle(self, release, may_expire) -> None:
        timeout = self.idle_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(max(timeout / 4, 0.05), 10.0))
            now = loop.time()
            for sid, used in list(self.last_used.items()):
                if now - used > timeout and may_expire(sid) and sid not in self.in_flight:
                    self.expired += 1
                    print(f"{self.role}: session {sid[:40]} released after {now - used:.0f} s idle", flush=True)
                    await release(sid)

    def forget(self, session_id: str, error: Exception | None = None) -> bool:
        """Drop a session from the table (False: it is not open, or the host is closing: nothing to do);
        its steps still waiting fail with ``error``."""
        if session_id not in self.sessions or self.closed:
            return False
        del self.sessions[session_id]
        self.last_used.pop(session_id, None)
        for item in [q for q in self._queue if q.session_id == session_id]:
            self._queue.remove(item)
            if not item.future.done():
                item.future.set_exception(error or RuntimeError(f"session {session_id[:40]} was released"))
        return True

    async def release_on_thread(self, fn: Callable[[str], object], session_id: str) -> None:
        """Run the model's release of a session on its thread (nothing once the host closes: the process
        is ending)."""
        try:
            if not self.closed:
                await self.call(fn, session_id)
        except RuntimeError:  # the thread shut down meanwhile: the process is ending
            if not self.closed:
                raise

    def close_buffer(self, session_id: str) -> None:
        """On the model's thread: close the session's hidden-row buffer, if it has one."""
        buffer = self.buffers.pop(session_id, None)
        if buffer is not None:
            buffer.close()

    async def close(self) -> None:
        """Stop expiry, let the job on the thread end (nothing new starts), close every buffer and answer
        every caller still waiting (RuntimeError)."""
        self.closed = True  # releases asked for from now on are dropped (the process is ending)
        await cancel_and_wait(self._reaper)
        await self.thread.aclose()
        for sid in list(self.buffers):  # the thread is gone: no name stays in /dev/shm
            self.buffers.pop(sid).close()
        gone = RuntimeError(f"the {self.role} is shutting down")
        for waiting in (*self._calls, *self._queue):
            if not waiting.future.done():
                waiting.future.set_exception(gone)
        self._calls.clear()
        self._queue.clear()

    def has_waiting(self) -> bool:
        """Whether a step or a call waits for the model's thread (read from any thread: a hint, not a lock)."""
        return bool(self._queue or self._calls)

    # ------------------------------------------------------------------------- the model's thread
    async def call(self, fn, *args):
        """Run fn on the model's thread once it is free (calls run in arrival order; one whose caller
        was cancelled before it started does not run)."""
        if self._run_batch is None:
            return await self.thread.call(fn, *args)
        if self.closed:
            raise RuntimeError(f"the {self.role} is shutting down")
        fut = asyncio.get_running_loop().create_future()
        self._calls.append(_Call(fn, args, fut))
        self._dispatch()
        return await fut

    async def step(self, session_id: str, payload, answer: Answer | None = None) -> StepOutcome:
        """Queue one session's step for the next batch (needs ``run_batch``). ``answer`` (optional) runs on
        the thread as soon as the session's result is there (before the loop hears of it); it must only
        encode and send."""
        fut = asyncio.get_running_loop().create_future()
        self._queue.append(_Step(session_id, payload, fut, answer))
        self.enter(session_id)
        try:
            self._dispatch()
            return await fut
        finally:
            self.leave(session_id)

    def _dispatch(self) -> None:
        """On the loop: give the thread its next job if it is free: the oldest waiting call, or every
        waiting step (up to max_batch) as one batch, whichever waited longer."""
        while not self._busy and not self.closed:
            while self._calls and self._calls[0].future.done():  # its caller gave up before it started
                self._calls.popleft()
            if self._calls and (not self._queue or self._calls[0].enqueued <= self._queue[0].enqueued):
                call = self._calls.popleft()
                self._busy = True
                self.thread.submit(call.fn, call.args, lambda res, err, fut=call.future: self._call_done(fut, res, err))
                return
            if not self._queue:
                return
            items = self._take_batch()
            if items:
                self._busy = True
                started = time.perf_counter()
                pairs = [(q.session_id, q.payload) for q in items]
                answers = [(q.answer, (started - q.enqueued) * 1e3) for q in items]
                self.thread.submit(
                    self._run_and_answer, (pairs, answers), lambda res, err: self._batch_done(items, started, res, err)
                )
                return

    def _take_batch(self) -> list[_Step]:
        """The next batch's steps; one whose session is gone meanwhile fails (its caller hears of it)."""
        taken = self._queue[: self.max_batch]
        del self._queue[: self.max_batch]
        items = []
        for q in taken:
            if q.future.done():
                continue
            if q.session_id in self.sessions:
                items.append(q)
            else:
                q.future.set_exception(RuntimeError(f"session {q.session_id[:40]} was released"))
        return items

    def _call_done(self, fut: asyncio.Future, result, error: BaseException | None) -> None:
        self._busy = False
        if not fut.done():
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
        self._dispatch()

    def _batch_done(self, items: list[_Step], started: float, results, error: BaseException | None) -> None:
        """On the loop, when the thread has answered a batch: complete each caller's future."""
        self._busy = False
        try:
            self._settle_batch(items, started, results, error)
        finally:
            self._dispatch()

    def _settle_batch(self, items: list[_Step], started: float, results, error: BaseException | None) -> None:
        if error is not None:  # every waiter must hear about it
            for q in items:
                if not q.future.done():
                    q.future.set_exception(error if isinstance(error, Exception) else RuntimeError(str(error)))
            return
        results, answered = results
        self.steps += len(items)
        for q, res, sent in zip(items, results, answered):
            if isinstance(res, Exception):
                if not q.future.done():
                    q.future.set_exception(res)
                continue
            if self._settle is not None:
                self._settle(q.session_id, res)
            if not q.future.done():
                q.future.set_result(StepOutcome(res, (started - q.enqueued) * 1e3, len(items), sent))

    def _run_and_answer(self, pairs: list[tuple[str, Any]], answers: list[tuple[Answer | None, float]]):
        """On the thread: the batch, then each result's Answer at once."""
        results = self._run_batch(pairs)
        answered = [
            not isinstance(res, Exception) and answered_by(answer, res, queue_ms, len(pairs))
            for res, (answer, queue_ms) in zip(results, answers)
        ]
        return results, answered
