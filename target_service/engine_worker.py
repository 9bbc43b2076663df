"""The target's engine on its own thread (runtime/worker.py ``OneThread``): sessions, admission, batched verify.

Servicers only await. Verify requests are batched per step: whatever is queued when the engine thread becomes
free runs as ONE ``engine.verify_batch`` call, so N concurrent sessions share one forward. The hand-over is plain
loop callbacks (``EngineWorker._dispatch``): a verify that finds the engine free goes to its thread at once, and
the thread's answer completes the callers' futures directly, with no batcher task in between. Admission
(specserve/runtime/admission.py) reserves each session's KV blocks; see server.py for what callers state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specserve.contract.types import DraftBlock, SharedRows, VerifyResult
from specserve.runtime import tracing as tn
from specserve.runtime.admission import Admission, AdmissionConfig
from specserve.runtime.errors import LimitExceeded
from specserve.runtime.hidden_share import HiddenBuffer, HiddenShareError
from specserve.runtime.servers_common import cancel_and_wait
from specserve.runtime.worker import OneThread
from specserve.target_service.engine.engine import (
    DuplicateSession,
    UnknownSession,
)

DEFAULT_DRAFT_HEADROOM = 1  # tokens reserved beyond the prompt (the pending token) when the caller states none


@dataclass(frozen=True)
class TargetLimits:
    max_sessions: int = 64  # open sessions; more queue
    max_queued: int = 64  # waiting Prefills; more get RESOURCE_EXHAUSTED
    max_draft_tokens: int = 256  # tokens (chain length or tree nodes) of one drafted block
    session_idle_timeout_s: float = 300.0  # a session no call touched for this long is released

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if not self.session_idle_timeout_s > 0:
            raise ValueError(f"session_idle_timeout_s must be > 0, got {self.session_idle_timeout_s}")


# called on the engine thread with a session's result, its queue ms and the batch size; True when it sent
# the caller its answer itself (the shared-memory path: the reply leaves without waiting for the loop)
Answer = Callable[[VerifyResult, float, int], bool]


@dataclass
class _Queued:
    session_id: str
    block: DraftBlock
    future: asyncio.Future
    answer: Answer | None = None
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class _Call:
    """A non-verify engine call (prefill, release, stats) waiting for the engine thread."""

    fn: Callable
    args: tuple
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class VerifyOutcome:
    result: VerifyResult
    queue_ms: float
    batch_size: int
    answered: bool = False  # the caller's answer already went out from the engine thread (Answer)


class EngineWorker:
    """Owns the engine on one thread. prefill/release/info run there one at a time; verify requests
    queue up and run as one batched ``verify_batch`` call whenever the thread is free. Calls and
    batches take the thread in arrival order (a batch's place is its oldest verify's)."""

    def __init__(
        self, engine, max_batch: int = 256, thread: OneThread | None = None, limits: TargetLimits | None = None
    ) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.limits = limits or TargetLimits()
        usage = engine.kv_usage()  # before any engine call: the engine thread is idle
        self.block_size = usage.block_size
        self.max_context = engine.info().max_context
        self.admission = Admission(
            AdmissionConfig(self.limits.max_sessions, self.limits.max_queued, capacity=usage.num_blocks)
        )
        self.reserved: dict[str, int] = {}  # session id -> KV blocks reserved at admission
        self._thread = thread or OneThread("target-engine")
        self._queue: list[_Queued] = []  # verifies waiting for the engine thread
        self._calls: deque[_Call] = deque()  # other engine calls waiting for it
        self._busy = False  # a call or a batch runs on the engine thread
        self._reaper: asyncio.Task | None = None
        self._closed = False
        self.active: dict[str, int] = {}  # session id -> len(S)
        self.last_used: dict[str, float] = {}  # session id -> loop time of its last call
        self.expired = 0  # sessions released by the idle timeout
        self.steps = 0
        # session id -> its shared buffer of hidden rows (made, written and freed on the engine thread)
        self.shares: dict[str, HiddenBuffer] = {}

    @classmethod
    async def build(cls, factory: Callable[[], object], **kw) -> EngineWorker:
        """Build the engine on the engine thread itself (model loading never blocks the loop)."""
        thread = OneThread("target-engine")
        engine = await thread.call(factory)
        return cls(engine, thread=thread, **kw)

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._expire_idle(), name="target-idle-sessions")

    async def close(self) -> None:
        self._closed = True  # releases asked for from now on are dropped (the process is ending)
        await cancel_and_wait(self._reaper)
        await self._thread.aclose()  # the job on the thread ends first; nothing new starts (closed)
        for sid in list(self.shares):  # the engine thread is gone: no name stays in /dev/shm
            self.shares.pop(sid).close()
        gone = RuntimeError("the target is shutting down")
        for waiting in (*self._calls, *self._queue):
            if not waiting.future.done():
                waiting.future.set_exception(gone)
        self._calls.clear()
        self._queue.clear()

    def _touch(self, session_id: str) -> None:
        self.last_used[session_id] = asyncio.get_running_loop().time()

    async def _expire_idle(self) -> None:
        """Release sessions no call touched for ``session_idle_timeout_s`` (a client or gateway that
        went away without releasing cannot hold KV blocks for ever)."""
        timeout = self.limits.session_idle_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(max(timeout / 4, 0.05), 10.0))
            now = loop.time()
            queued = {q.session_id for q in self._queue}
            for sid, used in list(self.last_used.items()):
                if now - used > timeout and self.active.get(sid, -1) >= 0 and sid not in queued:
                    self.expired += 1
                    print(f"target: session {sid[:40]} released after {now - used:.0f} s idle", flush=True)
                    await self.release(sid)

    async def call(self, fn, *args):
        """Run fn on the engine thread once it is free (calls run in arrival order; one whose caller
        was cancelled before it started does not run)."""
        if self._closed:
            raise RuntimeError("the target is shutting down")
        fut = asyncio.get_running_loop().create_future()
        self._calls.append(_Call(fn, args, fut))
        self._dispatch()
        return await fut

    def blocks_for(self, prompt_len: int, reserve_tokens: int | None) -> int:
        """KV blocks to reserve for a session: what it may occupy, within the model's context."""
        tokens = prompt_len + DEFAULT_DRAFT_HEADROOM if reserve_tokens is None else max(reserve_tokens, prompt_len + 1)
        tokens = min(tokens, self.max_context + self.limits.max_draft_tokens + 1)
        return math.ceil(tokens / self.block_size)

    async def prefill(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling,
        hidden_layers: tuple[int, ...],
        reserve_tokens: int | None = None,
        share_hidden: bool = False,
        logprobs=None,  # LogprobsSpec | None: the session's log-probabilities (engine.prefill)
    ):
        """share_hidden: keep the session's hidden rows in a shared buffer (sized for the tokens it may
        occupy: reserve_tokens, capped at the context) and return SharedRows instead of bytes."""
        if session_id in self.active:
            raise DuplicateSession(session_id)
        self.active[session_id] = -1  # reserved while admission and the prefill run
        units = self.blocks_for(len(prompt_ids), reserve_tokens)
        try:
            await self.admission.acquire(units)
        except BaseException:
            self.active.pop(session_id, None)
            raise
        self.reserved[session_id] = units
        if session_id not in self.active:  # released while it waited
            self._unreserve(session_id)
            raise UnknownSession(session_id)
        try:
            rows = min(self.max_context, max(reserve_tokens or self.max_context, len(prompt_ids) + 1)) if share_hidden else 0
            result = await self.call(self._prefill_on_host, session_id, prompt_ids, sampling, hidden_layers, rows,
                                     logprobs)
        except asyncio.CancelledError:
            # the caller went away; the prefill itself still runs to its end on the engine thread
            self.active.pop(session_id, None)
            asyncio.get_running_loop().create_task(self._free(session_id))
            raise
        except BaseException:
            self.active.pop(session_id, None)  # the engine refused it and holds no session
            self._unreserve(session_id)
            raise
        if session_id in self.active:  # not released meanwhile
            self.active[session_id] = len(prompt_ids) + 1
            self._touch(session_id)
        return result

    def _unreserve(self, session_id: str) -> None:
        units = self.reserved.pop(session_id, None)
        if units is not None:
            self.admission.release(units)

    async def _free(self, session_id: str) -> None:
        """Free the engine's session, then its admission (the blocks are free before anyone is admitted)."""
        try:
            if not self._closed:
                await self.call(self._release_on_thread, session_id)
        except RuntimeError:  # the engine thread shut down meanwhile: the process is ending
            if not self._closed:
                raise
        finally:
            self._unreserve(session_id)

    async def verify(self, session_id: str, block: DraftBlock, answer: Answer | None = None) -> VerifyOutcome:
        """Queue one session's step. ``answer`` (optional) runs on the engine thread as soon as the
        session's result is there (before the loop hears of it); it must only encode and send."""
        if len(block) > self.limits.max_draft_tokens:
            raise LimitExceeded(
                f"draft: {len(block)} drafted tokens exceed the limit of {self.limits.max_draft_tokens} (--max-draft-tokens)"
            )
        if self.active.get(session_id, -1) < 0:
            raise UnknownSession(session_id)
        self._touch(session_id)
        fut = asyncio.get_running_loop().create_future()
        self._queue.append(_Queued(session_id, block, fut, answer))
        self._dispatch()
        return await fut

    async def release(self, session_id: str) -> bool:
        if session_id not in self.active or self._closed:
            return False
        del self.active[session_id]
        self.last_used.pop(session_id, None)
        for item in [q for q in self._queue if q.session_id == session_id]:
            self._queue.remove(item)
            if not item.future.done():
                item.future.set_exception(UnknownSession(session_id))
        if session_id in self.reserved:  # admitted (else it still waits in admission and gives up there)
            await self._free(session_id)
        return True

    def _dispatch(self) -> None:
        """On the loop: give the engine thread its next job if it is free: the oldest waiting call,
        or every waiting verify (up to max_batch) as one batch, whichever waited longer."""
        while not self._busy and not self._closed:
            while self._calls and self._calls[0].future.done():  # its caller gave up before it started
                self._calls.popleft()
            if self._calls and (not self._queue or self._calls[0].enqueued <= self._queue[0].enqueued):
                call = self._calls.popleft()
                self._busy = True
                self._thread.submit(call.fn, call.args, lambda res, err, fut=call.future: self._call_done(fut, res, err))
                return
            if not self._queue:
                return
            items = self._take_batch()
            if items:
                self._busy = True
                started = time.perf_counter()
                pairs = [(q.session_id, q.block) for q in items]
                answers = [(q.answer, (started - q.enqueued) * 1e3) for q in items]
                self._thread.submit(self._run_and_answer, (pairs, answers),
                                    lambda res, err: self._batch_done(items, started, res, err))
                return

    def _take_batch(self) -> list[_Queued]:
        items = [q for q in self._queue[: self.max_batch] if not q.future.done()]
        del self._queue[: self.max_batch]
        return [q for q in items if q.session_id in self.active]

    def _call_done(self, fut: asyncio.Future, result, error: BaseException | None) -> None:
        self._busy = False
        if not fut.done():
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
        self._dispatch()

    def _batch_done(self, items: list[_Queued], started: float, results, error: BaseException | None) -> None:
        """On the loop, when the engine thread has answered a batch: complete each caller's future."""
        self._busy = False
        try:
            self._settle_batch(items, started, results, error)
        finally:
            self._dispatch()

    def _settle_batch(self, items: list[_Queued], started: float, results, error: BaseException | None) -> None:
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
            if q.session_id in self.active:
                self.active[q.session_id] += len(res.emitted)
                self._touch(q.session_id)
            if not q.future.done():
                q.future.set_result(VerifyOutcome(res, (started - q.enqueued) * 1e3, len(items), sent))

    def _run_and_answer(self, pairs: list[tuple[str, DraftBlock]], answers: list[tuple[Answer | None, float]]):
        """On the engine thread: the batch, then each result's Answer at once (one that fails or declines
        leaves the answer to the loop, as without one)."""
        results = self._run_batch(pairs)
        answered = [False] * len(results)
        for i, (res, (answer, queue_ms)) in enumerate(zip(results, answers)):
            if answer is not None and not isinstance(res, Exception):
                try:
                    answered[i] = bool(answer(res, queue_ms, len(pairs)))
                except Exception:  # noqa: BLE001 - the loop answers instead
                    answered[i] = False
        return results, answered

    def _prefill_on_host(self, session_id, prompt_ids, sampling, hidden_layers, share_rows: int, logprobs=None):
        """On the engine thread: prefill, with the hidden rows copied to host memory there (a device
        copy synchronizes, and the event loop must never wait on the device), or, with ``share_rows``,
        written into a new shared buffer of that many rows (its handle goes out once, in the reply)."""
        buffer = None
        if share_rows and hidden_layers:
            try:
                buffer = HiddenBuffer.create(share_rows, len(hidden_layers) * self.engine.info().hidden_size,
                                             self.engine.dtype, self.engine.device)
            except HiddenShareError as exc:
                print(f"target: {exc}; session {session_id[:40]} sends its hidden rows as bytes", file=sys.stderr,
                      flush=True)
        try:
            res = self.engine.prefill(session_id, prompt_ids, sampling, hidden_layers,
                                      hidden_out=None if buffer is None else buffer.tensor, logprobs=logprobs)
        except BaseException:
            if buffer is not None:
                buffer.close()
            raise
        if buffer is not None and res.hidden.shape[0] > buffer.rows:  # (sized above for the prompt and more)
            buffer.close()
            buffer = None
        if buffer is None:
            return res if res.hidden is None else dataclasses.replace(res, hidden=_host(res.hidden))
        self.shares[session_id] = buffer
        return dataclasses.replace(res, hidden=SharedRows(0, len(prompt_ids), handle=buffer.handle.to_proto()))

    def _release_on_thread(self, session_id: str) -> bool:
        released = self.engine.release(session_id)  # first: the engine's session holds the buffer's tensor too
        buffer = self.shares.pop(session_id, None)
        if buffer is not None:
            buffer.close()
        return released

    def _on_host(self, session_id: str, res: VerifyResult) -> VerifyResult:
        """On the engine thread: the step's hidden rows as bytes (copied to host here), or as the range of
        the session's shared buffer the engine wrote them to (complete: the step's result was read after)."""
        if res.hidden is None:
            return res
        buffer = self.shares.get(session_id)
        if buffer is not None:
            buffer.unlink()  # its drafter has mapped it by now (or never will): no name stays in /dev/shm
            stop = self.engine.session(session_id).cached_len
            if stop <= buffer.rows:
                return dataclasses.replace(res, hidden=SharedRows(stop - res.hidden.shape[0], stop))
            # a session past the rows it reserved: its rows go as bytes from here on
        return dataclasses.replace(res, hidden=_host(res.hidden))

    def _run_batch(self, pairs: list[tuple[str, DraftBlock]]) -> list:
        """On the engine thread: one batched forward; if the batch fails, each session alone, so one
        bad request cannot fail the others (the engine checks its input before it changes state)."""
        if len(pairs) == 1:
            return [self._on_host(pairs[0][0], self.engine.verify(*pairs[0]))]
        try:
            return [self._on_host(sid, r) for (sid, _), r in zip(pairs, self.engine.verify_batch(pairs))]
        except Exception:  # noqa: BLE001 - isolate the failing session below
            out = []
            for sid, block in pairs:
                try:
                    out.append(self._on_host(sid, self.engine.verify(sid, block)))
                except Exception as exc:  # noqa: BLE001 - returned to that session's caller
                    out.append(exc)
            return out


def observe_worker(worker: EngineWorker) -> None:
    """The target's own metrics (sessions, reserved KV blocks, verify steps), read at export or scrape."""
    tn.observe_service(
        gauges={
            tn.TARGET_SESSIONS: lambda: len(worker.reserved),
            tn.TARGET_KV_BLOCKS_RESERVED: lambda: worker.admission.units_held,
            tn.TARGET_KV_BLOCKS_TOTAL: lambda: worker.admission.config.capacity,
        },
        counters={tn.TARGET_VERIFY_STEPS: lambda: worker.steps},
    )


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float32)
