"""The target gRPC service: Run, Prefill, Verify, VerifyStream, Release, GetInfo, GetStats.

Run is a request's whole step loop here, beside the engine (loop_serving.py: the served path, issue #42); Prefill,
VerifyStream and Release serve a caller that drives the steps itself (a gateway whose request has stop strings or
whose drafts need TLS, the bench's gateway-driven vias).

The engine runs on its own thread behind an EngineWorker (engine_worker.py: batched verify, admission, idle
sessions); the servicer only awaits it and turns its results and errors into replies and status codes.

Admission (specserve/runtime/admission.py): a Prefill is admitted only while fewer than ``max_sessions`` sessions
are open and the KV blocks its whole request may use fit beside those reserved by the open sessions;
otherwise it queues (at most ``max_queued``), and beyond the queue it gets RESOURCE_EXHAUSTED. The
caller states how many tokens the session may occupy in the ``specserve-reserve-tokens`` metadata
(prompt + new tokens + one draft block); without it only what the prefill itself takes is reserved,
and a session that outgrows its reservation may meet a full cache (RESOURCE_EXHAUSTED, never a crash).
"""

from __future__ import annotations

import threading
import time

import grpc
from opentelemetry import trace

from specserve.contract.types import SharedRows, VerifyResult
from specserve.errors import SpecserveError
from specserve.protos import convert
from specserve.protos.specserve.v1 import target_pb2, target_pb2_grpc
from specserve.runtime import tracing as tn
from specserve.runtime.admission import AdmissionRefused
from specserve.runtime.data_plane import ShmOffer
from specserve.runtime.errors import status_for
from specserve.runtime.hidden_share import host_id, kind_for
from specserve.runtime.servers_common import registration
from specserve.runtime.session_serving import StepReply, StepServing
from specserve.target_service.engine.engine import (
    ContextTooLong,
    DuplicateSession,
    OutOfBlocks,
    UnknownSession,
)
from specserve.target_service.engine_worker import EngineWorker, WireBlock
from specserve.target_service.loop_serving import LoopDrafts, serve_run

# the service's name, and its registration (request bytes that do not parse get INVALID_ARGUMENT, not UNKNOWN)
SERVICE_NAME, add_target_to_server = registration(target_pb2, "TargetService")

RESERVE_METADATA = "specserve-reserve-tokens"  # tokens a new session may occupy (prompt + new + draft block)


# Errors caused by a request's content (not by the service): INVALID_ARGUMENT.
INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, SpecserveError, convert.ConversionError)


def _reserve_tokens(metadata) -> int | None:
    for key, value in metadata or ():
        if key == RESERVE_METADATA:
            try:
                return max(0, int(value))
            except ValueError:
                raise convert.ConversionError(f"{RESERVE_METADATA} metadata: not an integer: {value[:20]!r}") from None
    return None


_SPECIFIC_STATUS = (
    (UnknownSession, grpc.StatusCode.NOT_FOUND),
    (DuplicateSession, grpc.StatusCode.ALREADY_EXISTS),
    (ContextTooLong, grpc.StatusCode.OUT_OF_RANGE),
    ((OutOfBlocks, AdmissionRefused), grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def _status_for(exc: BaseException) -> grpc.StatusCode:
    return status_for(exc, INPUT_ERRORS, _SPECIFIC_STATUS)


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(
        self,
        worker: EngineWorker,
        model_name: str = "",
        tensor_parallel_size: int = 1,
        shm: ShmOffer | None = None,
        draft_token: str | None = None,
    ) -> None:
        """``draft_token``: the bearer token the target's own loops send the draft services (Run)."""
        self.worker = worker
        self.info = worker.engine.info()
        self.model_name = model_name
        self.tensor_parallel_size = tensor_parallel_size
        self._tracer = tn.tracer()
        # its verify steps as a unary call, a stream and (a caller on this host) a shared-memory channel
        self.steps = StepServing(
            "target", shm, target_pb2.VerifyRequest, self._verify_one, _status_for, self.worker.release
        )
        self.shm = self.steps.shm
        # hidden rows of sessions whose caller asked: in a buffer their drafter maps (runtime/hidden_share.py)
        self.hidden_kind = kind_for(worker.engine.device) if self.shm.config.shares_hidden else ""
        self.host_id = host_id()
        self.hidden_rows_shared = 0  # rows handed over as ranges (GetStats)
        self.hidden_rows_as_bytes = 0  # rows sent as bytes
        self._counts_lock = threading.Lock()
        self.wire_info = self._info_proto()
        self.loop_drafts = LoopDrafts(
            self.wire_info, draft_token, self.shm.config.enabled, self.shm.config.shares_hidden
        )

    def _count_hidden(self, hidden) -> None:
        """Count a reply's hidden rows: handed over as a range of the shared buffer, or as bytes."""
        if isinstance(hidden, SharedRows):
            with self._counts_lock:  # replies are made on the loop and, for shared-memory callers, the engine thread
                self.hidden_rows_shared += hidden.stop - hidden.start
        elif hidden is not None:
            with self._counts_lock:
                self.hidden_rows_as_bytes += int(hidden.shape[0])

    # -------------------------------------------------------------------------------- RPCs
    def _info_proto(self) -> target_pb2.TargetInfo:
        return convert.info_to_proto(
            target_pb2.TargetInfo,
            self.info,
            tensor_parallel_size=self.tensor_parallel_size,
            model_name=self.model_name,
            hidden_share_kind=self.hidden_kind,
            host_id=self.host_id,
            runs_loop=True,
        )

    async def GetInfo(self, request, context):
        return self.wire_info

    def Run(self, request, context):
        """A request's step loop here (loop_serving.py); its events as they come, then its final."""
        return serve_run(
            self.worker, self.info, self.loop_drafts, request, context, self.steps.abort, self._count_hidden
        )

    async def Prefill(self, request, context):
        received = time.perf_counter()
        parent = tn.context_from_metadata(context.invocation_metadata())
        with self._tracer.start_as_current_span(tn.SPAN_PREFILL, context=parent, kind=trace.SpanKind.SERVER) as span:
            span.set_attribute(tn.ATTR_SESSION, request.session_id)
            span.set_attribute(tn.ATTR_INPUT_TOKENS, len(request.prompt_ids))
            try:
                if not request.session_id:
                    raise convert.ConversionError("session_id: empty")
                ids = list(request.prompt_ids)
                layers = tuple(int(x) for x in request.hidden_layers)
                sampling = convert.sampling_from_proto(request.sampling)
                share = bool(request.want_hidden_share and self.hidden_kind and layers)
                res = await self.worker.prefill(
                    request.session_id,
                    ids,
                    sampling,
                    layers,
                    _reserve_tokens(context.invocation_metadata()),
                    share,
                    logprobs=convert.logprobs_spec_from_proto(request),
                )
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                span.record_exception(exc)
                await self.steps.abort(context, exc)
            span.set_attribute(tn.ATTR_FORWARD_MS, res.timings.forward_ms)
            out = convert.prefill_result_to_proto(request.session_id, res, (time.perf_counter() - received) * 1e3)
            self._count_hidden(res.hidden)
            if request.want_shm:
                out.shm_channel = self.shm.offer(request.session_id, context.time_remaining())
            return out

    def _verify_response(
        self, request, drafted: int, res: VerifyResult, received: float, queue_ms: float, batch_size: int
    ) -> target_pb2.VerifyResponse:
        """A step's reply (on the loop, or on the engine thread when that answers a shared-memory caller)."""
        resp = convert.verify_result_to_proto(
            request.session_id,
            res,
            res.num_drafted or drafted,
            (time.perf_counter() - received) * 1e3,
            queue_ms,
            batch_size,
        )
        self._count_hidden(res.hidden)
        return resp

    async def _verify_one(self, request, call_ctx, send=None):
        """One verify step (raises; StepServing maps exceptions to a status). ``send`` (a shared-memory
        session's ``ShmSessions.sender``): the engine thread sends the reply itself, and this returns
        ANSWERED."""
        received = time.perf_counter()
        parent = tn.context_from_map(request.trace_context, call_ctx) if tn.tracing_installed() else None
        with tn.step_span(self._tracer, tn.SPAN_TARGET_VERIFY, parent, trace.SpanKind.SERVER) as span:
            block = WireBlock(request.draft, self.info.vocab_size)  # decoded and checked on the engine thread
            span.set_attribute(tn.ATTR_SESSION, request.session_id)
            span.set_attribute(tn.ATTR_K, len(block))
            span.set_attribute(tn.ATTR_TREE_SIZE, len(block) if request.draft.is_tree else 0)
            reply = StepReply(
                lambda res, queue_ms, batch_size: self._verify_response(
                    request, len(block), res, received, queue_ms, batch_size
                ),
                send,
            )
            out = await self.worker.verify(request.session_id, block, reply.answer)
            res = out.result
            span.set_attribute(tn.ATTR_ACCEPTED, len(res.accepted_ids))
            span.set_attribute(tn.ATTR_EMITTED, len(res.emitted))
            span.set_attribute(tn.ATTR_BATCH_SIZE, out.batch_size)
            span.set_attribute(tn.ATTR_QUEUE_MS, out.queue_ms)
            span.set_attribute(tn.ATTR_FORWARD_MS, res.timings.forward_ms)
            span.set_attribute(tn.ATTR_SAMPLE_MS, res.timings.sample_ms)
            span.set_attribute(tn.ATTR_EXPERTS_TOUCHED, res.experts_touched)
            return reply.message(out.answered, res, out.queue_ms, out.batch_size)

    async def Verify(self, request, context):
        return await self.steps.unary(request, context)

    def VerifyStream(self, request_iterator, context):
        """Per-session stream of verify steps; the sessions it carried are released when it ends."""
        return self.steps.stream(request_iterator, context)

    async def Release(self, request, context):
        parent = tn.context_from_metadata(context.invocation_metadata())
        with self._tracer.start_as_current_span(tn.SPAN_RELEASE, context=parent, kind=trace.SpanKind.SERVER) as span:
            span.set_attribute(tn.ATTR_SESSION, request.session_id)
            released = await self.steps.release(request.session_id, context)
            return target_pb2.ReleaseResponse(released=released)

    async def GetStats(self, request, context):
        usage = await self.worker.call(self.worker.engine.kv_usage)
        return target_pb2.TargetStats(
            active_sessions=len(self.worker.reserved),
            kv_blocks_total=usage.num_blocks,
            kv_blocks_used=usage.used_blocks,
            steps=self.worker.steps,
            shm_steps=self.shm.served,
            shm_channels=self.shm.attached,
            hidden_rows_shared=self.hidden_rows_shared,
            hidden_rows_as_bytes=self.hidden_rows_as_bytes,
            hidden_buffers=len(self.worker.shares),
        )
