"""The draft gRPC service: StartSession, Propose, ProposeStream, Release, GetInfo, GetStats.

One drafter thread owns the Proposer (a single-thread executor); servicers only await.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch
from opentelemetry import trace

from specserve.contract.types import TreeSpec
from specserve.draft_service.proposer import ProposerError
from specserve.errors import SpecserveError
from specserve.protos import convert
from specserve.protos.specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specserve.runtime import tracing as tn
from specserve.runtime.data_plane import ANSWERED, ShmOffer, ShmSessions
from specserve.runtime.errors import LimitExceeded, status_for
from specserve.runtime.hidden_share import (
    HiddenHandle,
    HiddenShareDenied,
    HiddenShareError,
    HiddenView,
    host_id,
    mappable_kinds,
)
from specserve.runtime.servers_common import cancel_and_wait, lenient_adder, short
from specserve.runtime.worker import OneThread

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
# registers the servicer; request bytes that do not parse get INVALID_ARGUMENT (not gRPC's UNKNOWN)
add_draft_to_server = lenient_adder(draft_pb2.DESCRIPTOR.services_by_name["DraftService"])

DEFAULT_MAX_DRAFT_TOKENS = 256  # tokens (chain length or tree nodes) one proposal may ask for


class DrafterFull(SpecserveError):
    """No room for another session or more tokens (RESOURCE_EXHAUSTED; the gateway goes target-only)."""


class UnmappableShare(SpecserveError):
    """A session's hidden-share handle cannot be mapped here (FAILED_PRECONDITION: the gateway then sends
    this draft's sessions their rows as bytes)."""


@dataclass(frozen=True)
class SharedRowsToRead:
    """Rows [start, stop) of the session's mapped buffer, then ``tail`` [m, F] (rows that came as bytes):
    read on the drafter thread (a device copy), as one [stop - start + m, F] float32 tensor."""

    start: int
    stop: int
    tail: torch.Tensor | None = None


class ProposeExpired(SpecserveError):
    """A proposal that waited for the drafter thread past its time budget (DEADLINE_EXCEEDED): its
    caller has given up on it, so it is not drafted at all."""


INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, SpecserveError, ProposerError)


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


class DrafterWorker:
    """Owns the proposer on one thread; every proposer call runs there, one at a time. Counts the
    tokens each session holds (refusing sessions and growth beyond ``limits``) and releases sessions
    that no call touched for ``limits.session_idle_timeout_s``."""

    def __init__(self, proposer, thread: OneThread | None = None, limits: DraftLimits | None = None) -> None:
        self.proposer = proposer
        self.limits = limits or DraftLimits()
        self._thread = thread or OneThread("drafter")
        self.active: set[str] = set()
        self.tokens: dict[str, int] = {}  # session id -> len(S) it holds
        self.last_used: dict[str, float] = {}  # session id -> loop time of its last call
        self.busy: dict[str, int] = {}  # session id -> calls in flight
        self.proposals = 0
        self.expired = 0
        # session id -> its mapping of the target's hidden-row buffer (opened, read and closed on the drafter thread)
        self.views: dict[str, HiddenView] = {}
        self.hidden_rows_shared = 0  # rows read from mapped buffers (GetStats)
        self._reaper: asyncio.Task | None = None
        self._closed = False

    @classmethod
    async def build(cls, factory: Callable[[], object], limits: DraftLimits | None = None) -> DrafterWorker:
        """Build the proposer on the drafter thread itself (loading never blocks the event loop)."""
        thread = OneThread("drafter")
        proposer = await thread.call(factory)
        return cls(proposer, thread, limits)

    def start_expiry(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._expire_idle(), name="draft-idle-sessions")

    async def call(self, fn, *args):
        return await self._thread.call(fn, *args)

    def _touch(self, session_id: str) -> None:
        self.last_used[session_id] = asyncio.get_running_loop().time()

    def _check_room(self, session_id: str, new_len: int) -> None:
        held = sum(self.tokens.values()) - self.tokens.get(session_id, 0)
        if held + new_len > self.limits.max_total_tokens:
            raise DrafterFull(
                f"{new_len} tokens for session {session_id[:40]!r} beside the {held} held would exceed the "
                f"limit of {self.limits.max_total_tokens} (--max-total-tokens)"
            )

    async def start(self, session_id, token_ids, hidden, sampling, share: HiddenHandle | None = None) -> None:
        """hidden: the rows as a tensor, or (with ``share``, the target's buffer) a SharedRowsToRead of it."""
        if session_id in self.active:  # a restarted request re-opens: drop the stale copy first
            await self.release(session_id)
        if len(self.active) >= self.limits.max_sessions:
            raise DrafterFull(f"{len(self.active)} sessions open, the limit is {self.limits.max_sessions} (--max-sessions)")
        self._check_room(session_id, len(token_ids))
        self.active.add(session_id)
        self.tokens[session_id] = len(token_ids)
        self._touch(session_id)
        self.busy[session_id] = self.busy.get(session_id, 0) + 1
        try:
            await self.call(self._start_on_thread, session_id, token_ids, hidden, sampling, share)
        except BaseException:
            self._forget(session_id)
            raise
        finally:
            self._done(session_id)

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
        self._touch(session_id)
        self.busy[session_id] = self.busy.get(session_id, 0) + 1
        try:
            msg, compute_ms, answered = await self.call(self._propose_to_proto, time.monotonic(), answer, session_id,
                                                        prefix_len, append_ids, append_hidden, num_tokens, tree)
        finally:
            self._done(session_id)
        if session_id in self.active:
            self.tokens[session_id] = new_len
        self.proposals += 1
        return msg, compute_ms, answered

    def _start_on_thread(self, session_id, token_ids, hidden, sampling, share: HiddenHandle | None) -> None:
        if share is not None:
            try:
                view = HiddenView.open(share)
            except HiddenShareDenied:
                raise  # PERMISSION_DENIED: a name without its key (whoever listed /dev/shm)
            except HiddenShareError as exc:
                raise UnmappableShare(str(exc)) from None
            self.views[session_id] = view
        try:
            self.proposer.start(session_id, token_ids, self._rows(session_id, hidden), sampling)
        except BaseException:
            self._close_view(session_id)
            raise

    def _rows(self, session_id: str, hidden):
        """On the drafter thread: the tensor of a SharedRowsToRead (read from the session's buffer)."""
        if not isinstance(hidden, SharedRowsToRead):
            return hidden
        view = self.views.get(session_id)
        if view is None:
            raise HiddenShareError(f"hidden rows [{hidden.start}, {hidden.stop}) of a shared buffer, but session "
                                   f"{session_id[:40]!r} maps none (StartSession gave no hidden_share)")
        rows = view.read(hidden.start, hidden.stop)
        self.hidden_rows_shared += hidden.stop - hidden.start
        if hidden.tail is not None:
            rows = torch.cat([rows, hidden.tail.to(rows.device)], dim=0)
        return rows

    def _close_view(self, session_id: str) -> None:
        view = self.views.pop(session_id, None)
        if view is not None:
            view.close()

    def _release_on_thread(self, session_id: str) -> None:
        self._close_view(session_id)
        self.proposer.release(session_id)

    def _done(self, session_id: str) -> None:
        left = self.busy.get(session_id, 1) - 1
        if left > 0:
            self.busy[session_id] = left
        else:
            self.busy.pop(session_id, None)
        if session_id in self.active:
            self._touch(session_id)

    def _forget(self, session_id: str) -> None:
        self.active.discard(session_id)
        self.tokens.pop(session_id, None)
        self.last_used.pop(session_id, None)

    async def _expire_idle(self) -> None:
        timeout = self.limits.session_idle_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(max(timeout / 4, 0.05), 10.0))
            now = loop.time()
            for sid, used in list(self.last_used.items()):
                if now - used > timeout and sid not in self.busy:
                    self.expired += 1
                    print(f"draft: session {sid[:40]} released after {now - used:.0f} s idle", flush=True)
                    await self.release(sid)

    def _propose_to_proto(self, asked_at: float, answer, *args) -> tuple[common_pb2.DraftBlock, float, bool]:
        """On the drafter thread: propose and serialize (probs may be MBs and on the device; the copy
        to host and the byte packing stay off the event loop). A proposal that waited here past the
        time budget (the thread was busy with others) is dropped: the work queue cannot pile up."""
        waited = time.monotonic() - asked_at
        if waited > self.limits.propose_budget_s:
            raise ProposeExpired(
                f"waited {waited:.1f} s for the drafter, over the budget of {self.limits.propose_budget_s} s "
                "(--propose-budget-s)"
            )
        session_id, prefix_len, append_ids, append_hidden, num_tokens, tree = args
        rows = self._rows(session_id, append_hidden)
        t0 = time.perf_counter()
        block = self.proposer.propose(session_id, prefix_len, append_ids, rows, num_tokens, tree)
        compute_ms = (time.perf_counter() - t0) * 1e3
        msg = convert.draft_block_to_proto(block)
        answered = False
        if answer is not None:
            try:
                answered = bool(answer(msg, compute_ms))
            except Exception:  # noqa: BLE001 - the loop answers instead
                answered = False
        return msg, compute_ms, answered

    async def release(self, session_id: str) -> bool:
        if session_id not in self.active or self._closed:
            return False
        self._forget(session_id)
        try:
            await self.call(self._release_on_thread, session_id)
        except RuntimeError:  # the drafter thread shut down meanwhile: the process is ending
            if not self._closed:
                raise
        return True

    async def close(self) -> None:
        self._closed = True
        await cancel_and_wait(self._reaper)
        await self._thread.aclose()
        for sid in list(self.views):
            self.views.pop(sid).close()


def observe_worker(worker: DrafterWorker) -> None:
    """The draft service's own metrics (sessions, proposals), read at export or scrape."""
    tn.observe_service(
        gauges={tn.DRAFT_SESSIONS: lambda: len(worker.active)},
        counters={tn.DRAFT_PROPOSALS: lambda: worker.proposals},
    )


def _status_for(exc: BaseException) -> grpc.StatusCode:
    return status_for(exc, INPUT_ERRORS, ((DrafterFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
                                          (ProposeExpired, grpc.StatusCode.DEADLINE_EXCEEDED),
                                          (HiddenShareDenied, grpc.StatusCode.PERMISSION_DENIED),
                                          (UnmappableShare, grpc.StatusCode.FAILED_PRECONDITION)))


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, worker: DrafterWorker, shm: ShmOffer | None = None) -> None:
        self.worker = worker
        self.limits = worker.limits
        self.info = worker.proposer.info
        self._tracer = tn.tracer()
        # sessions whose caller shares the host: their proposals over shared memory (same messages)
        self.shm = ShmSessions(
            "draft", shm or ShmOffer(), draft_pb2.ProposeRequest, self._propose_over_shm, _status_for, self.worker.release
        )
        # the target hidden-row buffers it can map (runtime/hidden_share.py), for a drafter that reads rows
        needs = self.info.needs_hidden_states and self.shm.config.shares_hidden
        self.hidden_kinds = mappable_kinds() if needs else ()
        self.host_id = host_id()
        self.hidden_rows_as_bytes = 0  # rows received as bytes (GetStats)

    def _hidden_of(self, request, tensor_field: str, rows_field: str, tensor_what: str):
        """A request's hidden rows: the tensor of ``tensor_field``, or (``rows_field`` set) the rows to read
        from the session's shared buffer, followed by the tensor's rows."""
        tensor = convert.optional_tensor(request, tensor_field, tensor_what)
        if tensor is not None:
            self.hidden_rows_as_bytes += int(tensor.shape[0]) if tensor.dim() else 0
        if not request.HasField(rows_field):
            return tensor
        r = getattr(request, rows_field)
        if not 0 <= r.start <= r.stop:
            raise convert.ConversionError(f"{rows_field}: [{r.start}, {r.stop}) is not a row range")
        return SharedRowsToRead(int(r.start), int(r.stop), tensor)

    async def _abort(self, context, exc: BaseException):
        await context.abort(_status_for(exc), short(f"{type(exc).__name__}: {exc}"))

    async def GetInfo(self, request, context):
        i = self.info
        return draft_pb2.DraftInfo(
            family=i.family,
            vocab_size=i.vocab_size,
            vocab_hash=i.vocab_hash,
            max_block_size=i.max_block_size,
            needs_hidden_states=i.needs_hidden_states,
            hidden_layers=list(i.hidden_layers),
            has_probs=i.has_probs,
            supports_tree=i.supports_tree,
            hidden_share_kinds=list(self.hidden_kinds),
            host_id=self.host_id,
        )

    async def StartSession(self, request, context):
        parent = tn.context_from_metadata(context.invocation_metadata())
        with self._tracer.start_as_current_span(tn.SPAN_DRAFT_START, context=parent, kind=trace.SpanKind.SERVER) as span:
            span.set_attribute(tn.ATTR_SESSION, request.session_id)
            span.set_attribute(tn.ATTR_DRAFT_FAMILY, self.info.family)
            try:
                if not request.session_id:
                    raise convert.ConversionError("session_id: empty")
                if not request.token_ids:
                    raise convert.ConversionError("token_ids: empty")
                share = None
                if request.HasField("hidden_share"):
                    if not self.hidden_kinds:
                        raise UnmappableShare("hidden_share: this draft service maps no shared buffers (its drafter "
                                              "reads no hidden rows, or --no-hidden-share)")
                    share = HiddenHandle.from_proto(request.hidden_share)
                    if share.kind not in self.hidden_kinds:
                        raise UnmappableShare(f"hidden_share: a {share.kind} buffer; this draft service maps "
                                              f"{list(self.hidden_kinds)}")
                    if not request.HasField("hidden_rows"):
                        raise convert.ConversionError("hidden_rows: unset beside hidden_share")
                elif request.HasField("hidden_rows"):
                    raise convert.ConversionError("hidden_rows: set without hidden_share")
                hidden = self._hidden_of(request, "hidden", "hidden_rows", "hidden")
                sampling = convert.sampling_from_proto(request.sampling)
                await self.worker.start(request.session_id, list(request.token_ids), hidden, sampling, share)
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                span.record_exception(exc)
                await self._abort(context, exc)
            channel = self.shm.offer(request.session_id, None) if request.want_shm else ""
            return draft_pb2.StartSessionResponse(session_id=request.session_id, shm_channel=channel)

    @staticmethod
    def _propose_response(request, block: common_pb2.DraftBlock, received: float, compute_ms: float):
        """A proposal's reply (on the loop, or on the drafter thread when that answers a shared-memory caller)."""
        total_ms = (time.perf_counter() - received) * 1e3
        return draft_pb2.ProposeResponse(
            session_id=request.session_id,
            draft=block,
            timings=common_pb2.StepTimings(forward_ms=total_ms, total_ms=total_ms, compute_ms=compute_ms),
        )

    async def _propose_one(self, request, call_ctx, send=None):
        """One proposal (raises; callers map exceptions to a status). ``send`` (a shared-memory session's
        ``ShmSessions.sender``): the drafter thread sends the reply itself, and this returns ANSWERED."""
        received = time.perf_counter()
        parent = tn.context_from_map(request.trace_context, call_ctx) if tn.tracing_installed() else None
        with tn.step_span(self._tracer, tn.SPAN_DRAFT_PROPOSE, parent, trace.SpanKind.SERVER) as span:
            span.set_attribute(tn.ATTR_SESSION, request.session_id)
            span.set_attribute(tn.ATTR_DRAFT_FAMILY, self.info.family)
            span.set_attribute(tn.ATTR_K, request.num_tokens)
            hidden = self._hidden_of(request, "append_hidden", "append_rows", "append_hidden")
            tree = None
            if request.is_tree:
                t = request.tree
                try:
                    tree = TreeSpec(num_nodes=t.num_nodes, top_k=t.top_k, depth=t.depth)
                except ValueError as e:
                    raise convert.ConversionError(f"tree: {e}") from None
                if tree.top_k > self.limits.max_tree_top_k:
                    raise LimitExceeded(
                        f"tree.top_k: {tree.top_k} exceeds the limit of {self.limits.max_tree_top_k} (--max-tree-top-k)"
                    )
                if tree.depth > self.limits.max_tree_depth:
                    raise LimitExceeded(
                        f"tree.depth: {tree.depth} exceeds the limit of {self.limits.max_tree_depth} (--max-tree-depth)"
                    )
            if request.num_tokens < 0:
                raise convert.ConversionError(f"num_tokens: {request.num_tokens} < 0")
            asked = tree.num_nodes if tree is not None else request.num_tokens
            if asked > self.limits.max_draft_tokens:
                raise LimitExceeded(
                    f"{'tree.num_nodes' if tree is not None else 'num_tokens'}: {asked} exceeds the limit of "
                    f"{self.limits.max_draft_tokens} (--max-draft-tokens)"
                )
            answer = None
            if send is not None:
                def answer(msg, compute_ms):  # on the drafter thread: the reply leaves at once
                    return send(self._propose_response(request, msg, received, compute_ms))
            block, compute_ms, answered = await self.worker.propose(
                request.session_id, request.prefix_len, list(request.append_ids), hidden, request.num_tokens, tree,
                answer,
            )
            span.set_attribute(tn.ATTR_TREE_SIZE, len(block.token_ids) if block.is_tree else 0)
            if answered:
                return ANSWERED
            return self._propose_response(request, block, received, compute_ms)

    async def _propose_over_shm(self, session_id: str, request):
        if request.session_id != session_id:
            raise convert.ConversionError(f"session_id: {request.session_id[:40]!r} is not this channel's session")
        return await self._propose_one(request, None, self.shm.sender(session_id))

    async def Propose(self, request, context):
        call_ctx = tn.context_from_metadata(context.invocation_metadata())
        try:
            return await self._propose_one(request, call_ctx)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await self._abort(context, exc)

    async def ProposeStream(self, request_iterator, context):
        """Per-session stream of proposals; the sessions it carried are released when it ends."""
        call_ctx = tn.context_from_metadata(context.invocation_metadata())
        sessions: set[str] = set()
        try:
            async for request in request_iterator:
                if request.session_id not in sessions:
                    self.shm.drop_offer(request.session_id)  # its caller could not attach (another host)
                sessions.add(request.session_id)
                try:
                    resp = await self._propose_one(request, call_ctx)
                except Exception as exc:  # noqa: BLE001 - mapped to a status
                    await self._abort(context, exc)
                yield resp
        finally:
            for sid in sessions:
                asyncio.get_running_loop().create_task(self.worker.release(sid))

    async def Release(self, request, context):
        self.shm.close_session(request.session_id)
        try:
            released = await self.worker.release(request.session_id)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await self._abort(context, exc)
        return draft_pb2.DraftReleaseResponse(released=released)

    async def GetStats(self, request, context):
        return draft_pb2.DraftStats(active_sessions=len(self.worker.active), proposals=self.worker.proposals,
                                    shm_proposals=self.shm.served, shm_channels=self.shm.attached,
                                    hidden_rows_shared=self.worker.hidden_rows_shared,
                                    hidden_rows_as_bytes=self.hidden_rows_as_bytes,
                                    hidden_buffers=len(self.worker.views))
