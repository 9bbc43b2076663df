"""The target's engine on its own thread: its session host (runtime/session_host.py) with the batched verify.

Servicers only await. Verify requests are batched per step: whatever is queued when the engine thread becomes
free runs as ONE ``engine.verify_batch`` call, so N concurrent sessions share one forward (the host's batching
hook; its hand-over is plain loop callbacks, with no batcher task in between). The engine's thread is a LoopThread
(runtime/worker.py), on whose event loop the served step loop runs: a lone session's verify is a plain call there
(``verify_here``, loop_serving.py), with no hand-over. Admission
(specserve/runtime/admission.py) reserves each session's KV blocks; see server.py for what callers state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.contract.types import DraftBlock, SharedRows, VerifyResult
from specserve.protos import convert
from specserve.protos.specserve.v1 import common_pb2
from specserve.runtime import tracing as tn
from specserve.runtime.admission import Admission, AdmissionConfig
from specserve.runtime.errors import LimitExceeded
from specserve.runtime.hidden_fds import FdServer
from specserve.runtime.hidden_share import HiddenBuffer, HiddenShareError
from specserve.runtime.session_host import SessionHost, StepOutcome, build_on_thread
from specserve.runtime.worker import LoopThread, OneThread
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
VerifyOutcome = StepOutcome  # a verify step's result, queue ms, batch size, and whether the engine thread answered


@dataclass(frozen=True)
class WireBlock:
    """A drafted block as its wire message: decoded and checked (convert.draft_block_from_proto: ids in the
    vocabulary, q a distribution) on the engine thread, not on the event loop (q is [n, vocab] float32 bytes)."""

    message: common_pb2.DraftBlock
    vocab_size: int

    def __len__(self) -> int:
        return len(self.message.token_ids)

    def decode(self) -> DraftBlock:
        return convert.draft_block_from_proto(self.message, vocab_size=self.vocab_size)


class EngineWorker:
    """Owns the engine on one thread (its SessionHost, runtime/session_host.py, with verify_batch as the
    batching hook). prefill/release/info run there one at a time; verify requests queue up and run as one
    batched ``verify_batch`` call whenever the thread is free. Calls and batches take the thread in arrival
    order (a batch's place is its oldest verify's)."""

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
        self.host = SessionHost(
            "target",
            thread or LoopThread("target-engine"),
            self.limits.session_idle_timeout_s,
            run_batch=self._run_batch,
            max_batch=max_batch,
            settle=self._settle,
        )
        self.active = self.host.sessions  # session id -> len(S)
        # session id -> its shared buffer of hidden rows (made, written and freed on the engine thread)
        self.shares: dict[str, HiddenBuffer] = self.host.buffers
        self.fd_server = FdServer()  # offers the host_shm buffers' segments to their drafters (runtime/hidden_fds.py)

        self.direct_steps = 0  # verifies run on the engine's thread by a loop there (``verify_here``)

    @property
    def steps(self) -> int:
        return self.host.steps + self.direct_steps

    @property
    def engine_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop on the engine's thread (a LoopThread's), where the served step loop runs; None with a
        plain OneThread (the loop then runs on the service's event loop)."""
        thread = self.host.thread
        return thread.loop if isinstance(thread, LoopThread) else None

    @property
    def expired(self) -> int:
        return self.host.expired

    @classmethod
    async def build(cls, factory: Callable[[], object], **kw) -> EngineWorker:
        """Build the engine on the engine thread itself (model loading never blocks the loop)."""
        thread, engine = await build_on_thread("target-engine", factory, LoopThread)
        return cls(engine, thread=thread, **kw)

    def start(self) -> None:
        self.host.start_expiry(self.release, lambda sid: self.active.get(sid, -1) >= 0)

    async def close(self) -> None:
        await self.host.close()
        self.fd_server.close()

    async def call(self, fn, *args):
        """Run fn on the engine thread once it is free (calls run in arrival order; one whose caller
        was cancelled before it started does not run)."""
        return await self.host.call(fn, *args)

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
            rows = (
                min(self.max_context, max(reserve_tokens or self.max_context, len(prompt_ids) + 1))
                if share_hidden
                else 0
            )
            result = await self.call(
                self._prefill_on_host, session_id, prompt_ids, sampling, hidden_layers, rows, logprobs
            )
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
            self.host.touch(session_id)
        return result

    def _unreserve(self, session_id: str) -> None:
        units = self.reserved.pop(session_id, None)
        if units is not None:
            self.admission.release(units)

    async def _free(self, session_id: str) -> None:
        """Free the engine's session, then its admission (the blocks are free before anyone is admitted)."""
        try:
            await self.host.release_on_thread(self._release_on_thread, session_id)
        finally:
            self._unreserve(session_id)

    async def verify(
        self, session_id: str, block: DraftBlock | WireBlock, answer: Answer | None = None
    ) -> VerifyOutcome:
        """Queue one session's step. ``answer`` (optional) runs on the engine thread as soon as the
        session's result is there (before the loop hears of it); it must only encode and send."""
        if len(block) > self.limits.max_draft_tokens:
            raise LimitExceeded(
                f"draft: {len(block)} drafted tokens exceed the limit of {self.limits.max_draft_tokens} (--max-draft-tokens)"
            )
        if self.active.get(session_id, -1) < 0:
            raise UnknownSession(session_id)
        self.host.touch(session_id)
        return await self.host.step(session_id, block, answer)

    def verify_here(self, session_id: str, block: DraftBlock) -> VerifyOutcome | None:
        """On the engine's thread (a step loop running there, target_service/loop_serving.py): the session's step as
        a plain call, with no hand-over, when it is the host's only session and nothing waits for the thread; None
        otherwise (the caller then queues it with ``verify``, where it batches with the other sessions' steps).
        Every engine call runs on this one thread, so the host's batches and calls wait their turn behind it."""
        host = self.host
        if self.engine_loop is None or len(self.active) != 1 or host.has_waiting() or not host.thread.on_thread():
            return None
        if len(block) > self.limits.max_draft_tokens:
            raise LimitExceeded(
                f"draft: {len(block)} drafted tokens exceed the limit of {self.limits.max_draft_tokens} (--max-draft-tokens)"
            )
        if self.active.get(session_id, -1) < 0:
            raise UnknownSession(session_id)
        host.touch(session_id)
        res = self._run_batch([(session_id, block)])[0]
        if isinstance(res, Exception):
            raise res
        self.direct_steps += 1
        self._settle(session_id, res)
        return VerifyOutcome(res, 0.0, 1)

    async def release(self, session_id: str) -> bool:
        if not self.host.forget(session_id, UnknownSession(session_id)):
            return False
        if session_id in self.reserved:  # admitted (else it still waits in admission and gives up there)
            await self._free(session_id)
        return True

    def _settle(self, session_id: str, res: VerifyResult) -> None:
        """On the loop, when a session's step has run: the tokens it now holds."""
        if session_id in self.active:
            self.active[session_id] += len(res.emitted)
            self.host.touch(session_id)

    def _prefill_on_host(self, session_id, prompt_ids, sampling, hidden_layers, share_rows: int, logprobs=None):
        """On the engine thread: prefill, with the hidden rows copied to host memory there (a device
        copy synchronizes, and the event loop must never wait on the device), or, with ``share_rows``,
        written into a new shared buffer of that many rows (its handle goes out once, in the reply)."""
        buffer = None
        if share_rows and hidden_layers:
            # every refusal of the request first: a refused Prefill allocates nothing (#44: its buffer stayed mapped)
            self.engine.check_prefill(session_id, prompt_ids, sampling, hidden_layers, logprobs)
            try:
                buffer = HiddenBuffer.create(
                    share_rows,
                    len(hidden_layers) * self.engine.info().hidden_size,
                    self.engine.dtype,
                    self.engine.device,
                    self.fd_server,
                )
            except HiddenShareError as exc:
                print(
                    f"target: {exc}; session {session_id[:40]} sends its hidden rows as bytes",
                    file=sys.stderr,
                    flush=True,
                )
        try:
            res = self.engine.prefill(
                session_id,
                prompt_ids,
                sampling,
                hidden_layers,
                hidden_out=None if buffer is None else buffer.tensor,
                logprobs=logprobs,
            )
        except BaseException as exc:
            if buffer is not None:
                traceback.clear_frames(exc.__traceback__)  # the engine's frames view the buffer: let go, then unmap
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
        self.host.close_buffer(session_id)
        return released

    def _on_host(self, session_id: str, res: VerifyResult) -> VerifyResult:
        """On the engine thread: the step's hidden rows as bytes (copied to host here), or as the range of
        the session's shared buffer the engine wrote them to (complete: the step's result was read after)."""
        if res.hidden is None:
            return res
        buffer = self.shares.get(session_id)
        if buffer is not None:
            buffer.withdraw()  # its drafter has taken it by now (or never will): no name stays in /dev/shm
            stop = self.engine.session(session_id).cached_len
            if stop <= buffer.rows:
                return dataclasses.replace(res, hidden=SharedRows(stop - res.hidden.shape[0], stop))
            # a session past the rows it reserved: its rows go as bytes from here on
        return dataclasses.replace(res, hidden=_host(res.hidden))

    def _run_batch(self, pairs: list[tuple[str, DraftBlock | WireBlock]]) -> list:
        """On the engine thread: the blocks that came as wire messages decoded (one that does not is that
        session's error alone), then the rest as one batch (``_verify_batch``)."""
        out: list = [None] * len(pairs)
        ready: list[tuple[int, str, DraftBlock]] = []
        for i, (sid, block) in enumerate(pairs):
            try:
                ready.append((i, sid, block.decode() if isinstance(block, WireBlock) else block))
            except Exception as exc:  # noqa: BLE001 - returned to that session's caller
                out[i] = exc
        for (i, _, _), res in zip(ready, self._verify_batch([(sid, block) for _, sid, block in ready])):
            out[i] = res
        return out

    def _verify_batch(self, pairs: list[tuple[str, DraftBlock]]) -> list:
        """On the engine thread: one batched forward; if the batch fails, each session alone, so one
        bad request cannot fail the others (the engine checks its input before it changes state)."""
        if not pairs:
            return []
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
