"""Remote adapters: the TargetClient / DraftClient protocols of gateway/clients.py over gRPC.

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

Circuit breaker (per draft endpoint): after ``breaker_failures`` timeouts / UNAVAILABLE in a row the
draft is not asked any more (every request goes target-only at once, releases are skipped: the draft
expires idle sessions itself) while a background probe calls its GetInfo every ``probe_every_s``
until it answers; then requests use it again.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch
from google.protobuf.message import DecodeError

from specserve.contract.types import (
    DraftBlock,
    PrefillResult,
    SamplingParams,
    VerifyResult,
)
from specserve.gateway.clients import DraftError, RequestRejected, TargetUnavailable
from specserve.gateway.spec_loop import MalformedDraft
from specserve.protos import convert
from specserve.protos.specserve.v1 import (
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specserve.runtime import tracing as tn
from specserve.runtime.data_plane import ShmClient, StatusFrame
from specserve.runtime.servers_common import TlsFiles, aio_channel, bearer_metadata
from specserve.runtime.shm_ring import PeerGone, RingError, RingTimeout

RELEASE_TIMEOUT_S = 2.0  # releases run even past the request's deadline, but never hang
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


class _Deadline:
    """A request's absolute deadline on the event loop's clock (None = no deadline)."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline

    def remaining(self, cap: float | None = None) -> float | None:
        if self.deadline is None:
            return cap
        left = self.deadline - asyncio.get_running_loop().time()
        return left if cap is None else min(left, cap)


class _Stream:
    """A bidi stream used strictly request -> response, opened on first use."""

    def __init__(self, opener) -> None:
        self._opener = opener
        self._call = None

    async def exchange(self, request, timeout: float | None):
        if self._call is None:
            self._call = self._opener()
        try:
            await self._call.write(request)
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:  # the peer ended the call meanwhile
            status = await self._status()
            if status is not None:
                raise status from None
            raise EOFError(f"the stream already ended: {exc}") from None
        read = self._call.read()
        resp = await (asyncio.wait_for(read, timeout) if timeout is not None else read)
        if resp is grpc.aio.EOF:
            raise EOFError("the stream ended without a response")
        return resp

    async def _status(self) -> grpc.aio.AioRpcError | None:
        """The ended call's status as an AioRpcError (None when it ended OK or cannot tell)."""
        try:
            code = await asyncio.wait_for(self._call.code(), 1.0)
            details = await asyncio.wait_for(self._call.details(), 1.0)
        except Exception:  # noqa: BLE001 - no status to report
            return None
        if code == grpc.StatusCode.OK:
            return None
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


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

    async def fetch_info(self, timeout_s: float, wait_for_ready: bool = True) -> target_pb2.TargetInfo:
        self.target_info = await self.stub.GetInfo(
            target_pb2.TargetInfoRequest(), timeout=timeout_s, wait_for_ready=wait_for_ready, metadata=self.auth
        )
        return self.target_info

    def session(
        self, deadline: float | None, metrics: tn.SpecMetrics | None = None, reserve_tokens: int | None = None
    ) -> RemoteTargetSession:
        """reserve_tokens: the most tokens the session may occupy (the target reserves KV blocks for them)."""
        return RemoteTargetSession(self, deadline, metrics, reserve_tokens)

    async def close(self) -> None:
        await self.channel.close()


class RemoteTargetSession:
    """TargetClient for one request: prefill (unary), verify steps (one VerifyStream), release."""

    def __init__(
        self, target: RemoteTarget, deadline: float | None, metrics: tn.SpecMetrics | None, reserve_tokens: int | None = None
    ) -> None:
        self._target = target
        reserve = () if reserve_tokens is None else ((RESERVE_METADATA, str(int(reserve_tokens))),)
        self._reserve = (*target.auth, *reserve)
        self._deadline = _Deadline(deadline)
        self._metrics = metrics
        self._stream = _Stream(self._open_stream)
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
        self, session_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, hidden_layers: tuple[int, ...]
    ) -> PrefillResult:
        req = target_pb2.PrefillRequest(
            session_id=session_id,
            prompt_ids=list(prompt_ids),
            sampling=convert.sampling_to_proto(sampling),
            hidden_layers=list(hidden_layers),
            want_shm=self._target.shm,
        )
        try:
            resp = await self._target.stub.Prefill(
                req, timeout=self._timeout(), metadata=tn.outgoing_metadata(self._reserve)
            )
        except grpc.aio.AioRpcError as exc:
            raise _target_error(exc) from None
        self._shm = ShmClient.attach(resp.shm_channel)
        self._last_step_end = time.perf_counter()
        return PrefillResult(
            next_token=resp.next_token,
            hidden=convert.optional_tensor(resp, "hidden"),
            timings=convert.timings_from_proto(resp.timings),
        )

    async def verify(self, session_id: str, block: DraftBlock) -> VerifyResult:
        req = target_pb2.VerifyRequest(
            session_id=session_id,
            draft=convert.draft_block_to_proto(block),
            trace_context=tn.current_trace_context(),
        )
        resp = await (self._verify_shm(req) if self._shm is not None else self._verify_stream(req))
        result = VerifyResult(
            accepted_ids=tuple(resp.accepted_ids),
            next_token=resp.next_token,
            hidden=convert.optional_tensor(resp, "hidden"),
            num_drafted=resp.num_drafted,
            experts_touched=resp.experts_touched,
            timings=convert.timings_from_proto(resp.timings),
        )
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


# ------------------------------------------------------------------------------------- draft
_DOWN = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class BreakerConfig:
    failures: int = 3  # timeouts / UNAVAILABLE in a row that open the breaker
    probe_every_s: float = 1.0  # while open: one GetInfo this often (and with this timeout)

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError(f"breaker failures must be >= 1, got {self.failures}")
        if not self.probe_every_s > 0:
            raise ValueError(f"probe_every_s must be > 0, got {self.probe_every_s}")


class _Breaker:
    """Consecutive failures of one draft endpoint; open = do not ask it, probe it in the background."""

    def __init__(self, endpoint: RemoteDraftEndpoint, config: BreakerConfig) -> None:
        self.endpoint, self.config = endpoint, config
        self.consecutive = 0
        self.is_open = False
        self.opened = 0  # times it opened (for tests and logs)
        self._probe: asyncio.Task | None = None

    def succeeded(self) -> None:
        if not self.is_open:
            self.consecutive = 0

    def failed(self) -> None:
        self.consecutive += 1
        if self.is_open or self.consecutive < self.config.failures:
            return
        self.is_open = True
        self.opened += 1
        ep = self.endpoint
        print(f"gateway: draft {ep.name} at {ep.address} failed {self.consecutive} times in a row; requests go "
              "target-only until it answers again", file=sys.stderr, flush=True)
        self._probe = asyncio.get_running_loop().create_task(self._probe_until_up(), name=f"probe-{ep.name}")

    async def _probe_until_up(self) -> None:
        every = self.config.probe_every_s
        while True:
            await asyncio.sleep(every)
            try:
                await self.endpoint.stub.GetInfo(draft_pb2.DraftInfoRequest(), timeout=every, metadata=self.endpoint.auth)
            except grpc.aio.AioRpcError:
                continue
            self.is_open, self.consecutive = False, 0
            print(f"gateway: draft {self.endpoint.name} answers again", file=sys.stderr, flush=True)
            return

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            try:
                await self._probe
            except asyncio.CancelledError:
                pass


class RemoteDraftEndpoint:
    """A draft service at one address (one channel for every request)."""

    def __init__(
        self,
        name: str,
        address: str,
        step_timeout_s: float = 5.0,
        tls: TlsFiles | None = None,
        target_info: target_pb2.TargetInfo | None = None,
        trusted: bool = False,
        breaker: BreakerConfig | None = None,
        token: str | None = None,
        shm: bool = True,
    ) -> None:
        self.auth = bearer_metadata(token)  # sent on every call (the draft's --auth-token)
        self.shm = shm  # ask for the shared-memory data plane per session (used when it opens here)
        self.name = name
        self.address = address
        self.trusted = trusted  # the operator trusts its q: verified with it (else proposal-only)
        self.breaker = _Breaker(self, breaker or BreakerConfig())
        self.step_timeout_s = step_timeout_s
        self.target_info = target_info  # set: a drafter for another vocabulary is never used
        self.channel = aio_channel(address, tls)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        self.last_info: draft_pb2.DraftInfo | None = None

    async def fetch_info(self, timeout_s: float, wait_for_ready: bool = False) -> draft_pb2.DraftInfo:
        self.last_info = await self.stub.GetInfo(
            draft_pb2.DraftInfoRequest(), timeout=timeout_s, wait_for_ready=wait_for_ready, metadata=self.auth
        )
        return self.last_info

    def session(self, deadline: float | None) -> RemoteDraft:
        return RemoteDraft(self, deadline)

    async def close(self) -> None:
        await self.breaker.close()
        await self.channel.close()


class RemoteDraft:
    """DraftClient for one request. Every failure is a DraftError: a draft never fails a request."""

    def __init__(self, endpoint: RemoteDraftEndpoint, deadline: float | None) -> None:
        self._ep = endpoint
        self._deadline = _Deadline(deadline)
        self._stream = _Stream(self._open_stream)
        self._shm: ShmClient | None = None  # this session's shared-memory channel, when it has one
        self._shm_broken = False  # the channel ended: proposals fail (as on a stream the draft ended)
        self.service_ms = 0.0  # draft time the draft service measured, summed over this session's proposals

    @property
    def transport(self) -> str:
        """How this session's proposals travel: "shm" or "grpc"."""
        return "shm" if self._shm is not None else "grpc"

    def _timeout(self) -> float:
        if self._ep.breaker.is_open:
            raise DraftError(f"draft {self._ep.name} at {self._ep.address}: not answering (circuit open)")
        left = self._deadline.remaining(self._ep.step_timeout_s)
        if left <= 0:
            raise DraftError("no time left before the request's deadline")
        return left

    def _open_stream(self):
        return self._ep.stub.ProposeStream(metadata=tn.outgoing_metadata(self._ep.auth))

    async def _unary(self, method, request):
        try:
            resp = await method(request, timeout=self._timeout(), metadata=tn.outgoing_metadata(self._ep.auth))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _DOWN:
                self._ep.breaker.failed()
            raise DraftError(f"draft {self._ep.name} at {self._ep.address}: {exc.code().name}: {exc.details()}") from None
        except DraftError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the draft only drops speculation
            raise DraftError(f"draft {self._ep.name} at {self._ep.address}: {exc!r}") from None
        self._ep.breaker.succeeded()
        return resp

    async def info(self):
        info = await self._unary(self._ep.stub.GetInfo, draft_pb2.DraftInfoRequest())
        self._ep.last_info = info
        if self._ep.target_info is not None:
            problem = incompatible(info, self._ep.target_info)
            if problem:  # e.g. restarted with another model: this request goes on target-only
                raise DraftError(f"draft {self._ep.name} at {self._ep.address}: {problem}")
        return info

    async def start(
        self, session_id: str, token_ids: Sequence[int], hidden: torch.Tensor | None, sampling: SamplingParams
    ) -> None:
        req = draft_pb2.StartSessionRequest(
            session_id=session_id, token_ids=list(token_ids), sampling=convert.sampling_to_proto(sampling),
            want_shm=self._ep.shm,
        )
        if hidden is not None:
            req.hidden.CopyFrom(convert.tensor_to_proto(hidden))
        resp = await self._unary(self._ep.stub.StartSession, req)
        self._shm = ShmClient.attach(resp.shm_channel)

    async def propose(
        self,
        session_id: str,
        prefix_len: int,
        append_ids: Sequence[int],
        append_hidden: torch.Tensor | None,
        num_tokens: int,
        tree=None,
    ) -> DraftBlock:
        req = draft_pb2.ProposeRequest(
            session_id=session_id,
            prefix_len=prefix_len,
            append_ids=list(append_ids),
            num_tokens=num_tokens,
            trace_context=tn.current_trace_context(),
        )
        if append_hidden is not None:
            req.append_hidden.CopyFrom(convert.tensor_to_proto(append_hidden))
        if tree is not None:
            req.is_tree = True
            req.tree.CopyFrom(convert.tree_spec_to_proto(tree.num_nodes, tree.top_k, tree.depth))
        if self._shm is not None or self._shm_broken:
            resp = await self._propose_shm(req)
        else:
            resp = await self._propose_stream(req)
        self._ep.breaker.succeeded()
        self.service_ms += resp.timings.total_ms
        try:
            return convert.draft_block_from_proto(resp.draft)
        except convert.ConversionError as exc:
            raise MalformedDraft(f"draft {self._ep.name}: {exc}") from None

    async def _propose_shm(self, req):
        where = f"draft {self._ep.name} over shared memory"
        if self._shm is None:
            raise DraftError(f"{where}: the channel already ended")
        timeout = self._timeout()
        try:
            return await self._shm.exchange(req, draft_pb2.ProposeResponse, timeout)
        except StatusFrame as exc:
            if exc.code in _DOWN:
                self._ep.breaker.failed()
            raise DraftError(f"{where}: {exc.code.name}: {exc.details}") from None
        except RingTimeout:
            self._ep.breaker.failed()
            raise DraftError(f"{where}: no answer within {timeout:.3g} s") from None
        except PeerGone as exc:
            self._ep.breaker.failed()
            raise DraftError(f"{where}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any failure of the draft only drops speculation
            raise DraftError(f"{where}: {exc!r}") from None
        finally:
            if self._shm is not None and self._shm.channel.closed:
                self._shm, self._shm_broken = None, True

    async def _propose_stream(self, req):
        try:
            return await self._stream.exchange(req, self._timeout())
        except DraftError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the draft only drops speculation
            self._stream.close()
            is_rpc = isinstance(exc, grpc.aio.AioRpcError)
            if isinstance(exc, asyncio.TimeoutError) or (is_rpc and exc.code() in _DOWN):
                self._ep.breaker.failed()
            what = f"{exc.code().name}: {exc.details()}" if is_rpc else repr(exc)
            raise DraftError(f"draft {self._ep.name} at {self._ep.address}: {what}") from None

    async def release(self, session_id: str) -> None:
        self._stream.close()
        if self._shm is not None:
            self._shm.close()  # the draft sees the channel end and releases the session
        if self._ep.breaker.is_open:
            return  # not answering: it frees the session when the stream ends or the session idles out
        await asyncio.shield(self._release(session_id))

    async def _release(self, session_id: str) -> None:
        try:
            await self._ep.stub.Release(
                draft_pb2.DraftReleaseRequest(session_id=session_id), timeout=RELEASE_TIMEOUT_S, metadata=self._ep.auth
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _DOWN:
                self._ep.breaker.failed()
            # the draft also frees a session when its propose stream ends


def incompatible(draft: draft_pb2.DraftInfo, target: target_pb2.TargetInfo) -> str:
    """Why a drafter cannot serve this target ("" when it can). The vocabulary rule of
    specserve/models/vocab.py: two tokenizer fingerprints must be equal, else the sizes
    (a vocabulary-agnostic drafter, size 0 and no fingerprint, fits every target)."""
    d_hash, t_hash = draft.vocab_hash, target.vocab_hash
    if d_hash.startswith("sha256:") and t_hash.startswith("sha256:"):
        if d_hash != t_hash:
            return f"drafter vocabulary {d_hash[:20]} differs from the target's {t_hash[:20]}"
    elif draft.vocab_size and target.vocab_size and draft.vocab_size != target.vocab_size:
        return f"drafter vocab_size {draft.vocab_size} differs from the target's {target.vocab_size}"
    if draft.needs_hidden_states and any(not 0 <= layer <= target.num_layers for layer in draft.hidden_layers):
        return f"drafter reads target layers {list(draft.hidden_layers)} but the target has {target.num_layers}"
    return ""
