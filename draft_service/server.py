"""The draft gRPC service: StartSession, Propose, ProposeStream, Release, GetInfo, GetStats.

One drafter thread owns the Proposer (a single-thread executor); servicers only await.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
from opentelemetry import trace

from specserve.contract.types import TreeSpec
from specserve.draft_service.proposer import ProposerError
from specserve.errors import SpecserveError
from specserve.protos import convert
from specserve.protos.specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specserve.runtime import tracing as tn
from specserve.runtime.errors import LimitExceeded, status_for
from specserve.runtime.worker import OneThread

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name

DEFAULT_MAX_DRAFT_TOKENS = 256  # tokens (chain length or tree nodes) one proposal may ask for


INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, SpecserveError, ProposerError)


class DrafterWorker:
    """Owns the proposer on one thread; every proposer call runs there, one at a time."""

    def __init__(self, proposer, thread: OneThread | None = None) -> None:
        self.proposer = proposer
        self._thread = thread or OneThread("drafter")
        self.active: set[str] = set()
        self.proposals = 0

    @classmethod
    async def build(cls, factory: Callable[[], object]) -> DrafterWorker:
        """Build the proposer on the drafter thread itself (loading never blocks the event loop)."""
        thread = OneThread("drafter")
        proposer = await thread.call(factory)
        return cls(proposer, thread)

    async def call(self, fn, *args):
        return await self._thread.call(fn, *args)

    async def start(self, session_id, token_ids, hidden, sampling) -> None:
        if session_id in self.active:  # a restarted request re-opens: drop the stale copy first
            await self.call(self.proposer.release, session_id)
        self.active.add(session_id)
        try:
            await self.call(self.proposer.start, session_id, token_ids, hidden, sampling)
        except BaseException:
            self.active.discard(session_id)
            raise

    async def propose(self, session_id, prefix_len, append_ids, append_hidden, num_tokens, tree) -> common_pb2.DraftBlock:
        if session_id not in self.active:
            raise ProposerError(f"session_id {session_id!r} is not open (StartSession first)")
        msg = await self.call(self._propose_to_proto, session_id, prefix_len, append_ids, append_hidden, num_tokens, tree)
        self.proposals += 1
        return msg

    def _propose_to_proto(self, *args) -> common_pb2.DraftBlock:
        """On the drafter thread: propose and serialize (probs may be MBs and on the device; the copy
        to host and the byte packing stay off the event loop)."""
        return convert.draft_block_to_proto(self.proposer.propose(*args))

    async def release(self, session_id: str) -> bool:
        if session_id not in self.active:
            return False
        self.active.discard(session_id)
        await self.call(self.proposer.release, session_id)
        return True

    async def close(self) -> None:
        await self._thread.aclose()


def observe_worker(worker: DrafterWorker) -> None:
    """The draft service's own metrics (sessions, proposals), read at export or scrape."""
    tn.observe_service(
        gauges={tn.DRAFT_SESSIONS: lambda: len(worker.active)},
        counters={tn.DRAFT_PROPOSALS: lambda: worker.proposals},
    )


def _status_for(exc: BaseException) -> grpc.StatusCode:
    return status_for(exc, INPUT_ERRORS)


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, worker: DrafterWorker, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS) -> None:
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        self.worker = worker
        self.max_draft_tokens = max_draft_tokens
        self.info = worker.proposer.info
        self._tracer = tn.tracer()

    async def _abort(self, context, exc: BaseException):
        await context.abort(_status_for(exc), f"{type(exc).__name__}: {exc}")

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
                hidden = convert.optional_tensor(request, "hidden")
                sampling = convert.sampling_from_proto(request.sampling)
                await self.worker.start(request.session_id, list(request.token_ids), hidden, sampling)
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                span.record_exception(exc)
                await self._abort(context, exc)
            return draft_pb2.StartSessionResponse(session_id=request.session_id)

    async def _propose_one(self, request, call_ctx) -> draft_pb2.ProposeResponse:
        received = time.perf_counter()
        parent = tn.context_from_map(request.trace_context, call_ctx)
        with self._tracer.start_as_current_span(
            tn.SPAN_DRAFT_PROPOSE, context=parent, kind=trace.SpanKind.SERVER
        ) as span:
            span.set_attribute(tn.ATTR_SESSION, request.session_id)
            span.set_attribute(tn.ATTR_DRAFT_FAMILY, self.info.family)
            span.set_attribute(tn.ATTR_K, request.num_tokens)
            hidden = convert.optional_tensor(request, "append_hidden")
            tree = None
            if request.is_tree:
                t = request.tree
                try:
                    tree = TreeSpec(num_nodes=t.num_nodes, top_k=t.top_k, depth=t.depth)
                except ValueError as e:
                    raise convert.ConversionError(f"tree: {e}") from None
            if request.num_tokens < 0:
                raise convert.ConversionError(f"num_tokens: {request.num_tokens} < 0")
            asked = tree.num_nodes if tree is not None else request.num_tokens
            if asked > self.max_draft_tokens:
                raise LimitExceeded(
                    f"{'tree.num_nodes' if tree is not None else 'num_tokens'}: {asked} exceeds the limit of "
                    f"{self.max_draft_tokens} (--max-draft-tokens)"
                )
            block = await self.worker.propose(
                request.session_id, request.prefix_len, list(request.append_ids), hidden, request.num_tokens, tree
            )
            span.set_attribute(tn.ATTR_TREE_SIZE, len(block.token_ids) if block.is_tree else 0)
            total_ms = (time.perf_counter() - received) * 1e3
            return draft_pb2.ProposeResponse(
                session_id=request.session_id,
                draft=block,
                timings=common_pb2.StepTimings(forward_ms=total_ms, total_ms=total_ms),
            )

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
        try:
            released = await self.worker.release(request.session_id)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await self._abort(context, exc)
        return draft_pb2.DraftReleaseResponse(released=released)

    async def GetStats(self, request, context):
        return draft_pb2.DraftStats(active_sessions=len(self.worker.active), proposals=self.worker.proposals)
