"""Remote adapters: the TargetClient protocol of specserve/loop/clients.py over gRPC, and the bidi-stream plumbing the
draft's adapter (gateway/remote_draft.py) shares.

One ``RemoteTarget`` / ``RemoteDraftEndpoint`` per service address (one channel, shared by all
requests); ``.session(deadline)`` gives the per-request adapter the spec loop drives. Verify and
propose steps go over one long-lived bidi stream per request (opened at the first step), each message
carrying the W3C trace context of the caller's current span.

Failure contract (what the loop relies on):
- target: a refused input -> RequestRejected; down / past the deadline / internal -> TargetCallError
  (a TargetUnavailable carrying the gRPC status code to return to the client);
- draft: anything at all (down, slower than its step timeout, stream broken) -> DraftError, and a block
  that does not even decode -> MalformedDraft. The loop then goes on target-only.

Data plane: with ``shm`` (the default) a session asks at its start (Prefill, StartSession) for a
shared-memory channel; when the service offers one and it opens here (same host), that session's
verify / propose steps go through it (specserve/runtime/data_plane.py: the same messages, the same
failure contract: a status frame is mapped like the stream's status, a peer that goes away is
UNAVAILABLE / DraftError at once, a slow one times out as on the stream). Else they use the stream.

Hidden rows (EAGLE-3, DFlash): a session whose draft can map the target's buffers on their host
(``share_hidden``, decided per request by the gateway: RemoteDraftEndpoint.maps_hidden_of) asks the
target to keep them in a shared buffer (specserve/runtime/hidden_share.py); the prefill's and every
step's hidden rows then come back as ``SharedRows`` (a row range; the prefill's also carries the
buffer's handle as the wire message), which the loop relays to the draft untouched: the gateway never
maps the buffer.

The draft endpoint's circuit breaker is described in gateway/remote_draft.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
from google.protobuf.message import DecodeError

from specserve.contract.types import (
    DraftBlock,
    LogprobsSpec,
    PrefillResult,
    SamplingParams,
    VerifyResult,
)
from specserve.loop.clients import RequestRejected, TargetUnavailable
from specserve.loop.detok import IncrementalText
from specserve.loop.stats import SpecStats
from specserve.loop.step_loop import FinalEvent, TokenEvent, end_request_span
from specserve.loop.step_observer import StepRecord
from specserve.protos import convert
from specserve.protos.specserve.v1 import (
    target_pb2,
    target_pb2_grpc,
)
from specserve.runtime import tracing as tn
from specserve.runtime.data_plane import ShmClient, StatusFrame
from specserve.runtime.grpc_stream import RELEASE_TIMEOUT_S, BidiStream, Deadline
from specserve.runtime.hidden_share import host_id
from specserve.runtime.metrics import StepRecorder
from specserve.runtime.servers_common import TlsFiles, aio_channel, bearer_metadata
from specserve.runtime.shm_ring import RingError, RingTimeout

RESERVE_METADATA = "specserve-reserve-tokens"  # the target reserves KV blocks for this many tokens

# target status codes that mean "your input was refused", not "the target is broken"
_REJECTED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)


class TargetCallError(TargetUnavailable):
    """A target call failed; ``code`` is the status the gateway returns (UNAVAILABLE unless the
    deadline passed or the target reported an internal error)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _target_error(exc: grpc.aio.AioRpcError) -> Exception:
    code, details = exc.code(), exc.details() or ""
    if code in _REJECTED:
        return RequestRejected(f"target refused the request: {details}")
    if code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED):
        code = grpc.StatusCode.UNAVAILABLE
    return TargetCallError(code, f"target {exc.code().name}: {details}")


def _result_of(convert_reply, resp):
    """The contract value of a target's reply; a reply whose hidden rows do not convert is the target's fault."""
    try:
        return convert_reply(resp)
    except convert.ConversionError as exc:
        raise TargetCallError(grpc.StatusCode.INTERNAL, f"target sent {exc}") from None


# ------------------------------------------------------------------------------------ target
class RemoteTarget:
    """The target service at one address (one channel for every request)."""

    def __init__(self, address: str, tls: TlsFiles | None = None, token: str | None = None, shm: bool = True) -> None:
        self.address = address
        self.shm = shm  # ask for the shared-memory data plane per session (used when it opens here)
        self.channel = aio_channel(address, tls)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self.target_info: target_pb2.TargetInfo | None = None
        self.auth = bearer_metadata(token)  # sent on every call (the target's --auth-token)
        self._host_id = host_id()

    def asks_shm(self) -> bool:
        """Ask for a session's channel only where it can be opened: the target reports this host (or no host:
        then try). A channel offered and never attached nor withdrawn costs the target the session."""
        reported = self.target_info.host_id if self.target_info is not None else ""
        return self.shm and (not reported or reported == self._host_id)

    async def fetch_info(self, timeout_s: float, wait_for_ready: bool = True) -> target_pb2.TargetInfo:
        self.target_info = await self.stub.GetInfo(
            target_pb2.TargetInfoRequest(), timeout=timeout_s, wait_for_ready=wait_for_ready, metadata=self.auth
        )
        return self.target_info

    @property
    def runs_loop(self) -> bool:
        """Whether the target runs a request's step loop itself (Run), as its GetInfo said."""
        return self.target_info is not None and self.target_info.runs_loop

    def run(self, request: target_pb2.RunRequest, deadline: float | None, **kw):
        """A request's step loop on the target (``TargetRun``: its events as the loop's)."""
        return TargetRun(self, request, Deadline(deadline), **kw).events()

    def session(
        self,
        deadline: float | None,
        metrics: StepRecorder | None = None,
        reserve_tokens: int | None = None,
        share_hidden: bool = False,
    ) -> RemoteTargetSession:
        """reserve_tokens: the most tokens the session may occupy (the target reserves KV blocks for them);
        share_hidden: its draft maps this target's hidden-row buffers (with the data plane on only)."""
        return RemoteTargetSession(self, deadline, metrics, reserve_tokens, share_hidden and self.shm)

    async def close(self) -> None:
        await self.channel.close()


class RemoteTargetSession:
    """TargetClient for one request: prefill (unary), verify steps (one VerifyStream), release."""

    def __init__(
        self,
        target: RemoteTarget,
        deadline: float | None,
        metrics: StepRecorder | None,
        reserve_tokens: int | None = None,
        share_hidden: bool = False,
    ) -> None:
        self._target = target
        self._share_hidden = share_hidden
        reserve = () if reserve_tokens is None else ((RESERVE_METADATA, str(int(reserve_tokens))),)
        self._reserve = (*target.auth, *reserve)
        self._deadline = Deadline(deadline)
        self._metrics = metrics
        self._stream = BidiStream(self._open_stream)
        self._shm: ShmClient | None = None  # this session's shared-memory channel, when it has one
        self._last_step_end = time.perf_counter()

    @property
    def transport(self) -> str:
        """How this session's verify steps travel: "shm" or "grpc"."""
        return "shm" if self._shm is not None else "grpc"

    def _timeout(self) -> float | None:
        left = self._deadline.remaining()
        if left is not None and left <= 0:
            raise TargetCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        return left

    def _open_stream(self):
        return self._target.stub.VerifyStream(timeout=self._timeout(), metadata=tn.outgoing_metadata(self._target.auth))

    async def info(self):
        if self._target.target_info is None:
            try:
                await self._target.fetch_info(self._timeout() or 10.0, wait_for_ready=False)
            except grpc.aio.AioRpcError as exc:
                raise _target_error(exc) from None
        return self._target.target_info

    async def prefill(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        hidden_layers: tuple[int, ...],
        logprobs: LogprobsSpec | None = None,
    ) -> PrefillResult:
        req = target_pb2.PrefillRequest(
            session_id=session_id,
            prompt_ids=list(prompt_ids),
            sampling=convert.sampling_to_proto(sampling),
            hidden_layers=list(hidden_layers),
            want_shm=self._target.asks_shm(),
            want_hidden_share=self._share_hidden and bool(hidden_layers),
        )
        if logprobs is not None:
            req.logprobs.CopyFrom(convert.logprobs_spec_to_proto(logprobs))
        try:
            resp = await self._target.stub.Prefill(
                req, timeout=self._timeout(), metadata=tn.outgoing_metadata(self._reserve)
            )
        except grpc.aio.AioRpcError as exc:
            raise _target_error(exc) from None
        self._shm = await ShmClient.attach(resp.shm_channel)
        self._last_step_end = time.perf_counter()
        return _result_of(convert.prefill_result_from_proto, resp)

    async def verify(self, session_id: str, block: DraftBlock) -> VerifyResult:
        req = target_pb2.VerifyRequest(
            session_id=session_id,
            draft=convert.draft_block_to_proto(block),
            trace_context=tn.current_trace_context(),
        )
        resp = await (self._verify_shm(req) if self._shm is not None else self._verify_stream(req))
        result = _result_of(convert.verify_result_from_proto, resp)
        now = time.perf_counter()
        if self._metrics is not None:
            self._metrics.record_step(len(block), len(result.accepted_ids), (now - self._last_step_end) * 1e3)
        self._last_step_end = now
        return result

    async def _verify_stream(self, req):
        try:
            return await self._stream.exchange(req, self._timeout())
        except grpc.aio.AioRpcError as exc:
            self._stream.close()
            raise _target_error(exc) from None
        except (EOFError, asyncio.TimeoutError) as exc:
            self._stream.close()
            raise TargetCallError(grpc.StatusCode.UNAVAILABLE, f"target verify stream: {exc!r}") from None

    async def _verify_shm(self, req):
        timeout = self._timeout()
        try:
            return await self._shm.exchange(req, target_pb2.VerifyResponse, timeout)
        except StatusFrame as exc:
            raise _target_error(exc.as_rpc_error()) from None
        except RingTimeout:
            left = self._deadline.remaining()
            code = grpc.StatusCode.DEADLINE_EXCEEDED if left is not None and left <= 0 else grpc.StatusCode.UNAVAILABLE
            raise TargetCallError(code, "target verify over shared memory: no answer in time") from None
        except (RingError, DecodeError) as exc:
            raise TargetCallError(grpc.StatusCode.UNAVAILABLE, f"target verify over shared memory: {exc}") from None

    async def release(self, session_id: str) -> None:
        self._stream.close()
        if self._shm is not None:
            self._shm.close()  # the target sees the channel end (and releases); the unary Release below too
        await asyncio.shield(self._release(session_id))

    async def _release(self, session_id: str) -> None:
        try:
            await self._target.stub.Release(
                target_pb2.ReleaseRequest(session_id=session_id),
                timeout=RELEASE_TIMEOUT_S,
                metadata=tn.outgoing_metadata(self._target.auth),
            )
        except grpc.aio.AioRpcError:
            pass  # the target also frees a session when its verify stream ends


class TargetRun:
    """One request whose step loop the target runs (its Run call; target_service/loop_serving.py): the target's
    RunEvents as the loop's TokenEvent / FinalEvent, so the gateway streams them as it streams its own loop's. The
    text is made here (the tokenizer stays with the gateway); a request's stats are the target's, on the gateway's
    clock (TTFT from ``started``); the per-step metrics are recorded as each step's event arrives. Failures map as the
    target session's (RequestRejected, TargetCallError); closing the events cancels the call, and the target's loop
    releases both sessions."""

    def __init__(
        self,
        target: RemoteTarget,
        request: target_pb2.RunRequest,
        deadline: Deadline,
        metrics: StepRecorder | None = None,
        tokenizer=None,
        started: float | None = None,
        span=None,
        on_step=None,
    ) -> None:
        """``on_step(StepRecord, RunTokens)``: each step as its event arrives (a benchmark's rows), or None."""
        self._target, self._request, self._deadline = target, request, deadline
        self._metrics, self._tokenizer, self._span = metrics, tokenizer, span
        self._on_step = on_step
        self.stats = SpecStats() if started is None else SpecStats(started=started)
        self.token_ids: list[int] = []  # emitted so far

    async def events(self):
        left = self._deadline.remaining()
        if left is not None and left <= 0:
            raise TargetCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        call = self._target.stub.Run(self._request, timeout=left, metadata=tn.outgoing_metadata(self._target.auth))
        text = IncrementalText(self._tokenizer, ())
        stats, ids = self.stats, self.token_ids
        finished = False  # the final came: the call then ends by itself, after the target's releases
        last = time.perf_counter()
        try:
            async for msg in call:
                if msg.HasField("final"):
                    fin = msg.final
                    stats.draft_fallback = fin.stats.draft_fallback
                    stats.draft_ms, stats.draft_hidden_ms = fin.stats.draft_ms, fin.stats.draft_hidden_ms
                    stats.draft_ahead_hits = fin.stats.draft_ahead_hits
                    if self._span is not None:
                        end_request_span(self._span, stats, len(ids), fin.finish_reason)
                    final_text = text.text if self._tokenizer is not None else None
                    prompt_len = len(self._request.prompt_ids)
                    finished = True
                    yield FinalEvent(tuple(ids), final_text, fin.finish_reason, prompt_len, len(ids), stats)
                    return
                tok = msg.tokens
                now = time.perf_counter()
                if tok.step:
                    stats.record_step(tok.drafted, tok.accepted)
                    stats.verify_ms += tok.verify_ms
                    if self._metrics is not None:
                        self._metrics.record_step(tok.drafted, tok.accepted, (now - last) * 1e3)
                    if self._on_step is not None:
                        self._on_step(self._record(stats.steps, tok), tok)
                else:
                    stats.first_token()
                last = now
                new = list(tok.token_ids)
                ids.extend(new)
                stats.completion_tokens = len(ids)
                delta, _ = text.push(new)
                yield TokenEvent(
                    tuple(new),
                    delta,
                    _result_of(lambda m: convert.token_logprobs_from_proto(m, "logprobs"), tok),
                    _result_of(lambda m: convert.token_logprobs_from_proto(m, "prompt_logprobs"), tok),
                )
        except grpc.aio.AioRpcError as exc:
            raise _target_error(exc) from None
        finally:
            if finished:  # the call ends once the target's loop released both sessions (as the gateway's own loop
                await self._drain(call)  # ends after its releases): a draft's failed release counts before the next
            else:
                call.cancel()
        raise TargetCallError(grpc.StatusCode.UNAVAILABLE, "target Run ended without a final message")

    def _record(self, step: int, tok: target_pb2.RunTokens) -> StepRecord:
        return StepRecord(
            step=step,
            context_len=tok.context_len,
            drafted=tok.drafted,
            accepted=tok.accepted,
            draft_ms=tok.draft_ms,
            verify_ms=tok.verify_ms,
            verify_wall_ms=tok.verify_wall_ms,
            experts_touched=tok.experts_touched,
            tree=self._request.tree_nodes > 0,
            verify_compute_ms=tok.verify_compute_ms,
        )

    @staticmethod
    async def _drain(call) -> None:
        """Wait for the call's end (the target's releases), at most RELEASE_TIMEOUT_S per session and service."""
        try:
            async with asyncio.timeout(2 * RELEASE_TIMEOUT_S + 1.0):
                async for _ in call:
                    pass
        except (grpc.aio.AioRpcError, TimeoutError):
            call.cancel()
