"""The draft gRPC service: StartSession, Propose, ProposeStream, Release, GetInfo, GetStats.

The proposer runs on its own thread behind a DrafterWorker (drafter_worker.py: sessions, limits, idle expiry,
mapped hidden rows); the servicer only awaits it and turns its results and errors into replies and status codes.
"""

from __future__ import annotations

import functools
import time

import grpc
from opentelemetry import trace

from specserve.contract.types import SharedRows
from specserve.draft_service.drafter_errors import ProposerError
from specserve.draft_service.drafter_worker import (
    DrafterFull,
    DrafterWorker,
    ProposeExpired,
    UnmappableShare,
    WireRows,
)
from specserve.errors import SpecserveError
from specserve.protos import convert
from specserve.protos.specserve.v1 import draft_pb2, draft_pb2_grpc
from specserve.runtime import tracing as tn
from specserve.runtime.data_plane import ShmOffer
from specserve.runtime.errors import LimitExceeded, status_for
from specserve.runtime.hidden_share import HiddenHandle, HiddenShareDenied, host_id, mappable_kinds
from specserve.runtime.servers_common import registration
from specserve.runtime.session_serving import StepReply, StepServing

# the service's name, and its registration (request bytes that do not parse get INVALID_ARGUMENT, not UNKNOWN)
SERVICE_NAME, add_draft_to_server = registration(draft_pb2, "DraftService")

INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, SpecserveError, ProposerError)


def _status_for(exc: BaseException) -> grpc.StatusCode:
    return status_for(
        exc,
        INPUT_ERRORS,
        (
            (DrafterFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
            (ProposeExpired, grpc.StatusCode.DEADLINE_EXCEEDED),
            (HiddenShareDenied, grpc.StatusCode.PERMISSION_DENIED),
            (UnmappableShare, grpc.StatusCode.FAILED_PRECONDITION),
        ),
    )


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, worker: DrafterWorker, shm: ShmOffer | None = None) -> None:
        self.worker = worker
        self.limits = worker.limits
        self.info = worker.proposer.info
        self._tracer = tn.tracer()
        # its proposals as a unary call, a stream and (a caller on this host) a shared-memory channel
        self.steps = StepServing(
            "draft", shm, draft_pb2.ProposeRequest, self._propose_one, _status_for, self.worker.release
        )
        self.shm = self.steps.shm
        # the target hidden-row buffers it can map (runtime/hidden_share.py), for a drafter that reads rows
        needs = self.info.needs_hidden_states and self.shm.config.shares_hidden
        self.hidden_kinds = mappable_kinds() if needs else ()
        self.host_id = host_id()
        self.hidden_rows_as_bytes = 0  # rows received as bytes (GetStats; written on the drafter thread)

    def _hidden_of(self, request, tensor_field: str, rows_field: str) -> WireRows:
        """A request's hidden rows, decoded on the drafter thread (``_decode_hidden``)."""
        return WireRows(functools.partial(self._decode_hidden, request, tensor_field, rows_field))

    def _decode_hidden(self, request, tensor_field: str, rows_field: str):
        """On the drafter thread: the request's rows (convert.request_hidden_from_proto), those that came as bytes
        counted."""
        hidden = convert.request_hidden_from_proto(request, tensor_field, rows_field)
        tensor = hidden.tail if isinstance(hidden, SharedRows) else hidden
        if tensor is not None:
            self.hidden_rows_as_bytes += int(tensor.shape[0]) if tensor.dim() else 0
        return hidden

    async def GetInfo(self, request, context):
        return convert.info_to_proto(
            draft_pb2.DraftInfo, self.info, hidden_share_kinds=list(self.hidden_kinds), host_id=self.host_id
        )

    async def StartSession(self, request, context):
        parent = tn.context_from_metadata(context.invocation_metadata())
        with self._tracer.start_as_current_span(
            tn.SPAN_DRAFT_START, context=parent, kind=trace.SpanKind.SERVER
        ) as span:
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
                        raise UnmappableShare(
                            "hidden_share: this draft service maps no shared buffers (its drafter "
                            "reads no hidden rows, or --no-hidden-share)"
                        )
                    share = HiddenHandle.from_proto(request.hidden_share)
                    if share.kind not in self.hidden_kinds:
                        raise UnmappableShare(
                            f"hidden_share: a {share.kind} buffer; this draft service maps {list(self.hidden_kinds)}"
                        )
                    if not request.HasField("hidden_rows"):
                        raise convert.ConversionError("hidden_rows: unset beside hidden_share")
                elif request.HasField("hidden_rows"):
                    raise convert.ConversionError("hidden_rows: set without hidden_share")
                hidden = self._hidden_of(request, "hidden", "hidden_rows")
                sampling = convert.sampling_from_proto(request.sampling)
                await self.worker.start(request.session_id, list(request.token_ids), hidden, sampling, share)
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                span.record_exception(exc)
                await self.steps.abort(context, exc)
            channel = self.shm.offer(request.session_id, None) if request.want_shm else ""
            return draft_pb2.StartSessionResponse(session_id=request.session_id, shm_channel=channel)

    async def _propose_one(self, request, call_ctx, send=None):
        """One proposal (raises; StepServing maps exceptions to a status). ``send`` (a shared-memory session's
        ``ShmSessions.sender``): the drafter thread sends the reply itself, and this returns ANSWERED."""
        received = time.perf_counter()
        parent = tn.context_from_map(request.trace_context, call_ctx) if tn.tracing_installed() else None
        with tn.step_span(self._tracer, tn.SPAN_DRAFT_PROPOSE, parent, trace.SpanKind.SERVER) as span:
            span.set_attribute(tn.ATTR_SESSION, request.session_id)
            span.set_attribute(tn.ATTR_DRAFT_FAMILY, self.info.family)
            span.set_attribute(tn.ATTR_K, request.num_tokens)
            hidden = self._hidden_of(request, "append_hidden", "append_rows")
            tree = None
            if request.is_tree:
                tree = convert.tree_spec_from_proto(request.tree)
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
            # the reply is made on the loop, or on the drafter thread when that answers a shared-memory caller
            reply = StepReply(
                lambda msg, compute_ms: convert.propose_response_to_proto(
                    request.session_id, msg, (time.perf_counter() - received) * 1e3, compute_ms
                ),
                send,
            )
            block, compute_ms, answered = await self.worker.propose(
                request.session_id,
                request.prefix_len,
                list(request.append_ids),
                hidden,
                request.num_tokens,
                tree,
                reply.answer,
            )
            span.set_attribute(tn.ATTR_TREE_SIZE, len(block.token_ids) if block.is_tree else 0)
            return reply.message(answered, block, compute_ms)

    async def Propose(self, request, context):
        return await self.steps.unary(request, context)

    def ProposeStream(self, request_iterator, context):
        """Per-session stream of proposals; the sessions it carried are released when it ends."""
        return self.steps.stream(request_iterator, context)

    async def Release(self, request, context):
        released = await self.steps.release(request.session_id, context)
        return draft_pb2.DraftReleaseResponse(released=released)

    async def GetStats(self, request, context):
        return draft_pb2.DraftStats(
            active_sessions=len(self.worker.active),
            proposals=self.worker.proposals,
            shm_proposals=self.shm.served,
            shm_channels=self.shm.attached,
            hidden_rows_shared=self.worker.hidden_rows_shared,
            hidden_rows_as_bytes=self.hidden_rows_as_bytes,
            hidden_buffers=len(self.worker.views),
        )
