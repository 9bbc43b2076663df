"""The target runs a request's step loop beside its engine: the Run call (issue #42, the served path).

The gateway validates and admits a request, then hands it to the target (``RunRequest``: the request, the draft
service's address it chose, the draft's step timeout); the target runs the one step loop of every mode
(specserve/loop/step_loop.py's ``run_request``) on its engine's thread (a LoopThread's event loop, as the in-process
loop runs on specserve/loop/engine_thread.py's): its target is the engine on its session host (``HostTarget``: a
lone session's verify is a plain call there, ``EngineWorker.verify_here``; with other sessions open it is the host's
queued step, so it batches with theirs; the prefill and the release are the host's calls on the service's loop), its
drafter the draft service at that address (specserve/loop/remote_draft.py, over the session's shared-memory ring
where it opens, waited on from the engine's loop; its gRPC calls on the service's loop: ``EngineLoopDraft``). A
lone session's step is then one ring round trip to the draft and no hand-over, where the gateway's loop took four
process hops (gateway -> draft -> gateway -> target -> gateway). ARCHITECTURE.md, "The loop on the engine's thread". The gateway gets a
``RunEvent`` a step (the emitted tokens, what the step drafted and accepted, the engine's and the proposer's compute)
and one ``RunFinal``; it keeps the text (detokenization, stop strings), the stream to the client and the metrics.

What the loop decides moves with it: the adaptive chooser (one per draft address, outliving requests), draft-ahead,
a draft outage's lossless target-only fallback (a DraftError inside this loop: the step runs target-only at once),
the draft's circuit breaker (one endpoint per address). A request's trace: ``target.run`` under the gateway's
request span, and inside it the loop's per-step ``draft.propose`` and ``target.verify`` spans (the draft service's
propose spans their children). Cancelling the call (the client hung up, the deadline) ends the loop, which releases
both sessions.

Drafts are dialed without TLS, with ``draft_token`` as their bearer token (the gateway runs the loop itself when its
drafts need TLS: GatewayConfig.target_loop).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace

from specserve.contract.speculation import MAX_K
from specserve.contract.types import DraftBlock, LogprobsSpec, PrefillResult, SamplingParams, VerifyResult
from specserve.loop.adaptive import AdaptiveConfig, AdaptiveSpeculation
from specserve.loop.remote_draft import BreakerConfig, RemoteDraft, RemoteDraftEndpoint
from specserve.loop.step_loop import FinalEvent, run_request
from specserve.protos import convert
from specserve.protos.specserve.v1 import target_pb2
from specserve.runtime import tracing as tn
from specserve.runtime.servers_common import check_address
from specserve.target_service.engine_worker import EngineWorker

MAX_DRAFT_ENDPOINTS = 64  # draft addresses the target keeps a channel to; past it the least recent unused one closes


async def _on(loop: asyncio.AbstractEventLoop, coro):
    """``coro`` run on ``loop`` (the service's, from the engine's thread), awaited here; the caller's context (its
    trace) goes with it, and cancelling the wait cancels it there."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


class HostTarget:
    """The engine on its session host as the loop's TargetClient (one request): a prefill and a verify are the host's
    calls (admission, the verify batch, the hidden-row buffers), as a gateway's Prefill and VerifyStream were.

    ``service_loop`` set: the loop runs on the engine's thread (``EngineWorker.engine_loop``); a verify there is a
    plain call (``verify_here``) while its session is the host's only one, else it is queued on the service's loop
    (``service_loop``), as are the prefill and the release (the host's admission and batches live there)."""

    def __init__(
        self,
        worker: EngineWorker,
        info,
        reserve_tokens: int | None,
        draft: RemoteDraftEndpoint | None,
        wire_info: target_pb2.TargetInfo,
        count_hidden=None,
        service_loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """``count_hidden(rows)``: the service's count of the hidden rows it hands out (GetStats), or None."""
        self.worker, self._info, self._reserve = worker, info, reserve_tokens
        self._draft, self._wire_info = draft, wire_info
        self._count = count_hidden or (lambda rows: None)
        self._service = service_loop

    async def _host(self, coro):
        return await (coro if self._service is None else _on(self._service, coro))

    async def info(self):
        return self._info

    async def prefill(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        hidden_layers: tuple[int, ...],
        logprobs: LogprobsSpec | None = None,
    ) -> PrefillResult:
        # the draft maps this target's hidden-row buffers (its GetInfo came first: the loop asks it before the prefill)
        share = bool(hidden_layers) and self._draft is not None and self._draft.maps_hidden_of(self._wire_info)
        res = await self._host(
            self.worker.prefill(
                session_id, list(prompt_ids), sampling, tuple(hidden_layers), self._reserve, share, logprobs=logprobs
            )
        )
        self._count(res.hidden)
        return res

    async def verify(self, session_id: str, block: DraftBlock) -> VerifyResult:
        out = self.worker.verify_here(session_id, block) if self._service is not None else None
        if out is None:
            out = await self._host(self.worker.verify(session_id, block))
        span = trace.get_current_span()  # the loop's target.verify span (none while tracing is off)
        if span.is_recording():
            span.set_attribute(tn.ATTR_BATCH_SIZE, out.batch_size)
            span.set_attribute(tn.ATTR_QUEUE_MS, out.queue_ms)
        self._count(out.result.hidden)
        return out.result

    async def release(self, session_id: str) -> None:
        await self._host(self.worker.release(session_id))


class EngineLoopDraft:
    """A RemoteDraft called from the loop on the engine's thread: a proposal over its shared-memory ring waits there
    (the ring follows the loop that waits on it); its gRPC calls (GetInfo, StartSession, Release, and proposals on
    the gRPC stream) run on the service's loop, where its endpoint's channel lives."""

    def __init__(self, draft: RemoteDraft, service_loop: asyncio.AbstractEventLoop) -> None:
        self.draft, self._service = draft, service_loop

    async def info(self):
        return await _on(self._service, self.draft.info())

    async def start(self, session_id, token_ids, hidden, sampling) -> None:
        await _on(self._service, self.draft.start(session_id, token_ids, hidden, sampling))

    async def propose(self, session_id, prefix_len, append_ids, append_hidden, num_tokens, tree=None):
        call = self.draft.propose(session_id, prefix_len, append_ids, append_hidden, num_tokens, tree)
        return await (call if self.draft.on_ring else _on(self._service, call))

    propose_ahead = propose

    async def release(self, session_id: str) -> None:
        self.draft.close_ring()  # here: its doorbell is watched by this loop
        await _on(self._service, self.draft.release(session_id))


class LoopDrafts:
    """The draft services the target's loops draft with: one endpoint (channel, circuit breaker) and one adaptive
    chooser per address, kept while in use and up to MAX_DRAFT_ENDPOINTS."""

    def __init__(self, wire_info: target_pb2.TargetInfo, token: str | None, shm: bool, hidden_share: bool) -> None:
        self.wire_info, self.token, self.shm, self.hidden_share = wire_info, token, shm, hidden_share
        self._endpoints: dict[str, RemoteDraftEndpoint] = {}  # address -> endpoint, least recent first
        self._adaptive: dict[str, AdaptiveSpeculation] = {}
        self._users: dict[str, int] = {}

    def acquire(
        self, address: str, name: str, step_timeout_s: float, breaker: BreakerConfig | None = None
    ) -> RemoteDraftEndpoint:
        """The endpoint at ``address`` with the gateway's step timeout and breaker settings (``release`` it after)."""
        ep = self._endpoints.pop(address, None)
        if ep is None:
            ep = RemoteDraftEndpoint(
                name or address,
                check_address(address),  # HOST:PORT or unix:PATH (AddressError: INVALID_ARGUMENT)
                step_timeout_s,
                target_info=self.wire_info,
                token=self.token,
                shm=self.shm,
                hidden_share=self.hidden_share,
                who="target",
            )
            self._adaptive.pop(address, None)  # a new endpoint: its drafter's costs start afresh
        ep.step_timeout_s = step_timeout_s  # the gateway's (--draft-step-timeout-s)
        if breaker is not None:
            ep.breaker.config = breaker  # the gateway's (--draft-breaker-failures)
        self._endpoints[address] = ep  # the most recent last
        self._users[address] = self._users.get(address, 0) + 1
        self._evict()
        return ep

    def release(self, address: str) -> None:
        left = self._users.get(address, 1) - 1
        if left > 0:
            self._users[address] = left
        else:
            self._users.pop(address, None)

    def adaptive(self, address: str) -> AdaptiveSpeculation:
        if address not in self._adaptive:
            self._adaptive[address] = AdaptiveSpeculation(AdaptiveConfig(max_k=MAX_K))
        return self._adaptive[address]

    def _evict(self) -> None:
        for address in list(self._endpoints):
            if len(self._endpoints) <= MAX_DRAFT_ENDPOINTS:
                return
            if not self._users.get(address):
                self._adaptive.pop(address, None)
                asyncio.get_running_loop().create_task(self._endpoints.pop(address).close())

    async def close(self) -> None:
        for ep in list(self._endpoints.values()):
            await ep.close()
        self._endpoints.clear()


def acquire_draft(drafts: LoopDrafts, request: target_pb2.RunRequest) -> RemoteDraftEndpoint | None:
    """On the service's loop: the request's draft endpoint (``drafts.release(request.draft_address)`` it after), or
    None; ConversionError for malformed breaker settings."""
    breaker = None
    if request.draft_breaker_failures:
        probe = request.draft_probe_every_s or BreakerConfig.probe_every_s
        try:
            breaker = BreakerConfig(request.draft_breaker_failures, probe)
        except ValueError as exc:
            raise convert.ConversionError(f"draft_breaker_failures / draft_probe_every_s: {exc}") from None
    address = request.draft_address
    if not address:
        return None
    ep = drafts.acquire(address, request.draft_name, request.draft_step_timeout_s, breaker)
    ep.breaker.loop = asyncio.get_running_loop()  # its probe runs where its channel lives
    return ep


async def run_events(
    worker: EngineWorker,
    info,
    drafts: LoopDrafts,
    request: target_pb2.RunRequest,
    ep: RemoteDraftEndpoint | None,
    deadline: float | None,
    count_hidden=None,
    service_loop: asyncio.AbstractEventLoop | None = None,
):
    """One Run call's events (RunEvent messages), the loop running here; raises what the engine raised (the servicer
    maps it to a status) or ConversionError for a malformed request. ``ep``: ``acquire_draft``'s; ``count_hidden``:
    HostTarget's; ``service_loop``: the service's loop when this runs on the engine's (HostTarget)."""
    gen = convert.run_request_from_proto(request)
    address = request.draft_address
    remote = ep.session(deadline, shm=not request.no_draft_shm) if ep is not None else None
    draft = remote if remote is None or service_loop is None else EngineLoopDraft(remote, service_loop)
    share_with = None if request.no_hidden_share else ep  # the draft whose hidden rows may go in a buffer
    target = HostTarget(
        worker, info, request.reserve_tokens or None, share_with, drafts.wire_info, count_hidden, service_loop
    )
    step = [None]  # the StepRecord of the step whose tokens come next (None: the prefill's first token)
    seen = (0.0, 0.0)  # the draft service's proposer ms and handling ms summed, as of the last event
    events = run_request(
        gen,
        target,
        draft,
        target_info=info,
        adaptive=drafts.adaptive(address) if gen.adaptive else None,
        session_id=request.session_id,
        on_step=lambda rec: step.__setitem__(0, rec),
        request_span=tn.SPAN_TARGET_RUN,
    )
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, FinalEvent):
                yield target_pb2.RunEvent(
                    final=target_pb2.RunFinal(
                        finish_reason=event.finish_reason,
                        prompt_tokens=event.prompt_tokens,
                        completion_tokens=event.completion_tokens,
                        stats=convert.spec_stats_to_proto(event.stats.as_dict()),
                    )
                )
                continue
            msg = target_pb2.RunTokens(token_ids=event.token_ids)
            rec, step[0] = step[0], None
            if rec is not None:
                compute, service = (remote.compute_ms, remote.service_ms) if remote is not None else (0.0, 0.0)
                msg.step, msg.drafted, msg.accepted = True, rec.drafted, rec.accepted
                msg.verify_compute_ms, msg.draft_compute_ms = rec.verify_compute_ms, compute - seen[0]
                msg.draft_service_ms = service - seen[1]
                seen = (compute, service)
                msg.verify_ms, msg.experts_touched, msg.context_len = (
                    rec.verify_ms,
                    rec.experts_touched,
                    rec.context_len,
                )
                msg.draft_ms, msg.verify_wall_ms = rec.draft_ms, rec.verify_wall_ms
            if event.logprobs is not None:
                msg.logprobs.CopyFrom(convert.token_logprobs_to_proto(event.logprobs))
            if event.prompt_logprobs is not None:
                msg.prompt_logprobs.CopyFrom(convert.token_logprobs_to_proto(event.prompt_logprobs))
            yield target_pb2.RunEvent(tokens=msg)


_END = object()  # after a Run's last event


def _ended(finished: asyncio.Future, out: asyncio.Queue) -> None:
    """On the service's loop: the Run's loop task is over (its releases included)."""
    if not finished.done():
        finished.set_result(None)
    out.put_nowait(_END)  # (after its own: a task cancelled before it started put none)


async def serve_run(worker, info, drafts: LoopDrafts, request, context, abort, count_hidden=None):
    """The Run call's replies. The loop runs in a task of its own under the caller's trace context: on the engine's
    thread (``worker.engine_loop``: a verify there is a plain call, no hand-over a step) or, without one, on this
    loop; it hands its events over a queue (from the engine's thread, one ``call_soon_threadsafe`` an event), so a
    step's reply (a gRPC write, which waits for its send) is written here while the next step proposes and verifies;
    a failure ends the call with ``abort(context, exc)`` (the servicer's status for it). The call ends after the
    loop's end (its releases included); a caller that goes away cancels the loop."""
    here = asyncio.get_running_loop()
    engine = worker.engine_loop
    thread = worker.host.thread if engine is not None else None  # the LoopThread
    out: asyncio.Queue = asyncio.Queue()
    try:
        ep = acquire_draft(drafts, request)
    except Exception as exc:  # noqa: BLE001 - mapped to a status
        await abort(context, exc)
        return
    remaining = context.time_remaining()
    deadline = None if remaining is None else here.time() + remaining

    if engine is None:
        put = out.put_nowait
    else:

        def put(item) -> None:  # on the engine's thread
            try:
                here.call_soon_threadsafe(out.put_nowait, item)
            except RuntimeError:  # the service's loop closed: nobody reads
                pass

    async def pump() -> None:
        try:
            events = run_events(
                worker, info, drafts, request, ep, deadline, count_hidden, None if engine is None else here
            )
            async with contextlib.aclosing(events):
                async for msg in events:
                    put(msg)
                    if thread is not None and thread.handed:  # a step never waits: the engine's loop takes a turn
                        thread.handed = False
                        await asyncio.sleep(0)
        except Exception as exc:  # noqa: BLE001 - handed to the call, mapped to a status there
            put(exc)
        finally:
            put(_END)

    finished = here.create_future()

    def done(_task) -> None:  # on the loop that ran it
        try:
            here.call_soon_threadsafe(_ended, finished, out)
        except RuntimeError:  # the service's loop closed
            pass

    tasks: list[asyncio.Task] = []

    def start() -> None:  # on the loop that runs it, in this call's context (the caller's trace)
        task = asyncio.get_running_loop().create_task(pump())
        task.add_done_callback(done)
        tasks.append(task)

    token = otel_context.attach(tn.context_from_metadata(context.invocation_metadata()))
    try:
        if engine is None:
            start()
        else:
            thread.hand(start)  # (call_soon copies this context: the caller's trace)
    finally:
        otel_context.detach(token)
    try:
        while (item := await out.get()) is not _END:
            if isinstance(item, Exception):
                await abort(context, item)
            yield item
    finally:
        if not finished.done():  # the caller went away (or the call ended): the loop's end releases both sessions
            if engine is None:
                tasks[0].cancel()
            else:
                thread.hand(lambda: tasks[0].cancel())  # after start (call_soon keeps the order)
        try:
            await asyncio.shield(finished)
        except BaseException:  # noqa: BLE001 - its outcome was handed over (or the caller is gone)
            pass
        if ep is not None:
            drafts.release(request.draft_address)
