"""The gateway gRPC service: Generate (server streaming), GenerateUnary, SetDraft, ListDrafts.

Each request: validate -> the lead's spec loop (specserve/loop/step_loop.py) over the remote adapters
(gateway/remote.py) -> token deltas, then one final message. The client's deadline is forwarded to
both services; a client that cancels closes the loop, which releases the session on both services.
``GatewayServicer.generate`` is that path for every front end: gRPC here, the OpenAI HTTP API in
gateway/http_api.py; its failures are a GatewayError (status + one line) that each maps to its own status.

Admission: at most ``max_sessions`` requests run; up to ``max_queued`` more wait (FIFO, within their
deadline); more get RESOURCE_EXHAUSTED. With an ``auth_token`` every Gateway call must carry the
metadata ``authorization: Bearer <token>`` (compared in constant time) or gets UNAUTHENTICATED; the
health service stays open for probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import sys
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry import context as otel_context

from specserve.contract.speculation import MAX_K, KTooLong, k_on_draft
from specserve.errors import SpecserveError
from specserve.gateway.config import GatewayConfig
from specserve.gateway.draft_table import DraftTable
from specserve.gateway.grpc_handlers import MalformedMessage
from specserve.gateway.remote import RemoteTarget, TargetCallError
from specserve.gateway.validation import (
    NO_DRAFT,
    InvalidRequest,
    check_prompt_bytes,
    encode_text,
    max_token_bytes,
    validate_request,
)
from specserve.loop.adaptive import AdaptiveConfig, AdaptiveSpeculation
from specserve.loop.clients import RequestRejected, TargetUnavailable
from specserve.loop.remote_draft import incompatible
from specserve.loop.step_loop import FinalEvent, run_request
from specserve.protos import convert
from specserve.protos.specserve.v1 import gateway_pb2, gateway_pb2_grpc
from specserve.runtime import tracing as tn
from specserve.runtime.admission import Admission, AdmissionConfig, AdmissionRefused
from specserve.runtime.grpc_guard import UNAUTHENTICATED_MESSAGE
from specserve.runtime.metrics import SpecMetrics
from specserve.runtime.servers_common import short

ADMIN_METADATA = "specserve-admin-token"  # SetDraft's credential, separate from the clients' bearer token


def too_long_block(checked, draft_info) -> str:
    """The INVALID_ARGUMENT message of a request for more drafted tokens than its draft drafts per block."""
    limit = "its --max-block-size (serve and draft)"
    if draft_info.family in ("dflash", "dspark"):  # block drafters: a block holds at most block_size tokens
        limit += " or its checkpoint's block_size"
    return (
        f"num_speculative_tokens: {checked.num_speculative_tokens} exceeds the {draft_info.max_block_size} "
        f"tokens draft {checked.draft_name!r} ({draft_info.family}) drafts per block; {limit} sets that"
    )


class GatewayError(SpecserveError):
    """A request ends with this status and one-line message (the transport maps ``code`` to its own
    status: a gRPC status, or an HTTP status). ``field``: the request field at fault, if one is."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, config: GatewayConfig, target: RemoteTarget, tokenizer=None) -> None:
        if target.target_info is None:
            raise ValueError("fetch the target's info (RemoteTarget.fetch_info) before serving")
        self.config = config
        self.target = target
        self.tokenizer = tokenizer
        self._token_bytes = max_token_bytes(tokenizer) if tokenizer is not None else 0  # the prompt's byte pre-check
        self.drafts = DraftTable(
            config.draft_step_timeout_s,
            config.downstream_tls,
            target.target_info,
            config.draft_breaker,
            config.downstream_token,
            config.shm,
            config.hidden_share,
        )
        for name, address in config.drafts.items():
            self.drafts.put(self.drafts.make(name, address, trusted=name in config.trusted_drafts))
        self.default_draft = config.default_draft or next(iter(config.drafts), None)
        self.metrics = SpecMetrics(drafts=config.drafts)
        self._adaptive_by_draft: dict[str, AdaptiveSpeculation] = {}
        self.admission = Admission(AdmissionConfig(config.max_sessions, config.max_queued, what="requests"))
        self._token = None if config.auth_token is None else config.auth_token.encode()
        self._admin_token = None if config.admin_token is None else config.admin_token.encode()

    def observe(self) -> None:
        """Export the admission state (running and queued requests) as observable gauges."""
        tn.observe_service(
            gauges={
                tn.GATEWAY_REQUESTS_RUNNING: lambda: self.admission.active,
                tn.GATEWAY_REQUESTS_QUEUED: lambda: self.admission.queued,
            }
        )

    def token_ok(self, authorization: str | bytes | None) -> bool:
        """Whether an ``authorization`` value (``Bearer <token>``) carries the token (always, with none set)."""
        if self._token is None:
            return True
        raw = authorization or b""
        raw = raw if isinstance(raw, bytes) else raw.encode("utf-8", "replace")
        given = raw[len(b"Bearer ") :] if raw[:7].lower() == b"bearer " else b""
        return hmac.compare_digest(given, self._token)

    async def _authorize(self, context, request=None) -> None:
        """UNAUTHENTICATED unless the call carries ``authorization: Bearer <token>`` (when a token is set);
        then INVALID_ARGUMENT for a request whose bytes did not parse."""
        await self._check_token(context)
        if isinstance(request, MalformedMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)

    async def _check_token(self, context) -> None:
        given = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        if not self.token_ok(given):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    def _adaptive(self, draft_name: str) -> AdaptiveSpeculation:
        """The process-wide adaptive chooser of one draft (its cost model outlives requests)."""
        if draft_name not in self._adaptive_by_draft:
            self._adaptive_by_draft[draft_name] = AdaptiveSpeculation(AdaptiveConfig(max_k=MAX_K))
        return self._adaptive_by_draft[draft_name]

    async def close(self) -> None:
        await self.drafts.close()
        await self.target.close()

    # ----------------------------------------------------------------------------- generate
    @property
    def model_name(self) -> str:
        """The served model's name (what responses and the HTTP API's ``model`` field carry)."""
        if self.config.served_model_name is not None:
            return self.config.served_model_name
        info = self.target.target_info
        return info.model_name or info.model_type

    async def encode_prompt(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """A text prompt's ids, tokenized on a thread once its size could be a valid prompt's (InvalidRequest)."""
        check_prompt_bytes(text, self.target.target_info, self.config.limits, self._token_bytes)
        return await asyncio.to_thread(encode_text, self.tokenizer, text, add_special_tokens)

    async def generate(
        self, request, trace_context: otel_context.Context, time_remaining: float | None = None
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """The per-request path of every front end (gRPC Generate, the HTTP API): validate, admit, run
        the spec loop; yields token deltas then one final message. Raises GatewayError (a status and
        one line) for anything the caller did wrong or that stops the request. The caller checked the
        bearer token. ``time_remaining``: seconds to the caller's deadline (None = none)."""
        info = self.target.target_info
        arrived = time.perf_counter()  # the clock of the loop's SpecStats: TTFT counts the admission queue
        now = asyncio.get_running_loop().time()
        deadline = now + time_remaining if time_remaining is not None else None  # admission waits count too
        try:
            prompt, encoded = request.prompt, None  # read once (each read decodes the field anew)
            if prompt and not request.prompt_ids and self.tokenizer is not None:
                encoded = await self.encode_prompt(prompt)  # off the loop
            checked = validate_request(
                request, info, self.drafts, self.default_draft, self.tokenizer, self.config.limits, encoded, prompt
            )
        except InvalidRequest as exc:
            self.metrics.record_rejected("invalid")
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field) from None
        try:
            await self.admission.acquire()
        except AdmissionRefused as exc:
            self.metrics.record_rejected("busy")
            raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"gateway {exc}") from None
        self.metrics.queue_time.record(time.perf_counter() - arrived)
        finished = False
        try:
            if checked.draft_name is not None and checked.draft_name not in self.drafts:
                raise GatewayError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"draft: {checked.draft_name!r} was removed", "draft"
                )
            run = self._admitted(checked, info, trace_context, deadline, arrived)
            async with contextlib.aclosing(run) as messages:
                async for msg in messages:
                    finished = msg.HasField("final")
                    yield msg
        except GatewayError as exc:
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                self.metrics.record_rejected("invalid")
            else:
                self.metrics.record_failed(exc.code.name.lower())
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                self.metrics.cancelled.add(1)
            raise
        finally:
            self.admission.release()

    async def _events(self, request, context):
        """gRPC: the checked call's GenerateResponse messages (aborts the call with a status on failure)."""
        await self._authorize(context, request)
        parent = tn.context_from_metadata(context.invocation_metadata())
        try:
            async with contextlib.aclosing(self.generate(request, parent, context.time_remaining())) as messages:
                async for msg in messages:
                    yield msg
        except GatewayError as exc:
            await context.abort(exc.code, str(exc))

    async def _admitted(self, checked, info, trace_context, deadline: float | None, arrived: float):
        endpoint = self.drafts.acquire(checked.draft_name) if checked.draft_name else None
        most = endpoint.last_info.max_block_size if endpoint is not None and endpoint.last_info is not None else None
        try:
            k = k_on_draft(checked.num_speculative_tokens, most)  # refused above `most`, never drafted shorter
        except KTooLong:
            self.drafts.release(endpoint)
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT, too_long_block(checked, endpoint.last_info), "num_speculative_tokens"
            ) from None
        tree = checked.tree if endpoint is not None else None
        if tree is not None and endpoint.last_info is not None and not endpoint.last_info.supports_tree:
            self.drafts.release(endpoint)
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tree_nodes: draft {checked.draft_name!r} ({endpoint.last_info.family}) drafts chains only",
                "tree_nodes",
            )
        gen = dataclasses.replace(
            checked,
            num_speculative_tokens=k,
            tree=tree,
            model_name=self.model_name,
            adaptive=checked.adaptive and endpoint is not None,
            trust_draft_probs=endpoint is not None and endpoint.trusted,
        )
        token = otel_context.attach(trace_context)
        try:
            block = max(k, tree.num_nodes if tree is not None else 0)
            reserve = len(gen.prompt_ids) + gen.max_new_tokens + block + 1  # S at most, plus one draft block
            share = endpoint is not None and endpoint.maps_hidden_of(self.target.target_info)
            steps = self.metrics.steps(checked.draft_name or NO_DRAFT)
            sid = uuid.uuid4().hex
            if self._target_runs(gen):
                events = self._run_on_target(gen, sid, endpoint, deadline, reserve, steps, arrived)
            else:
                events = run_request(
                    gen,
                    self.target.session(deadline, steps, reserve_tokens=reserve, share_hidden=share),
                    endpoint.session(deadline) if endpoint is not None else None,
                    tokenizer=self.tokenizer,
                    target_info=info,
                    adaptive=self._adaptive(checked.draft_name) if gen.adaptive else None,
                    session_id=sid,
                    started=arrived,
                )
            last = None  # when the previous delta came (inter-token latency)
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, FinalEvent):
                        yield self._final(event, checked.draft_name, arrived)
                    else:
                        now = time.perf_counter()
                        if last is not None:
                            self.metrics.record_tokens(now - last, len(event.token_ids))
                        last = now
                        delta = gateway_pb2.TokenDelta(token_ids=list(event.token_ids), text=event.text)
                        if event.logprobs is not None:
                            delta.logprobs.CopyFrom(convert.token_logprobs_to_proto(event.logprobs))
                        if event.prompt_logprobs is not None:
                            delta.prompt_logprobs.CopyFrom(convert.token_logprobs_to_proto(event.prompt_logprobs))
                        yield gateway_pb2.GenerateResponse(delta=delta)
        except RequestRejected as exc:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except TargetCallError as exc:
            raise GatewayError(exc.code, str(exc)) from None
        except TargetUnavailable as exc:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except (GatewayError, grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug: report it as INTERNAL, keep serving
            raise GatewayError(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}") from None
        finally:
            otel_context.detach(token)
            if endpoint is not None:
                self.drafts.release(endpoint)

    def _target_runs(self, gen) -> bool:
        """Whether the target runs this request's step loop (Run): it can (its GetInfo), the gateway lets it
        (``target_loop``), the request has no stop strings (their cut is the gateway's, on the text, between two
        steps) and the drafts need no TLS (the target dials them with a token only)."""
        return self.config.target_loop and self.target.runs_loop and not gen.stop and self.config.downstream_tls is None

    async def _run_on_target(self, gen, sid: str, endpoint, deadline, reserve: int, steps, arrived: float):
        """The request's step loop on the target: its events as the loop's, under the gateway's request span."""
        request = convert.run_request_to_proto(
            gen,
            sid,
            endpoint.address if endpoint is not None else "",
            self.config.draft_step_timeout_s,
            reserve,
            self.config.draft_breaker.failures,
            self.config.draft_breaker.probe_every_s,
            shm=self.config.shm,
            hidden_share=endpoint is not None and endpoint.hidden_share,
        )
        with tn.tracer().start_as_current_span(tn.SPAN_REQUEST) as span:
            span.set_attribute(tn.ATTR_MODEL, gen.model_name)
            span.set_attribute(tn.ATTR_INPUT_TOKENS, len(gen.prompt_ids))
            span.set_attribute(tn.ATTR_SESSION, sid)
            events = self.target.run(
                request, deadline, metrics=steps, tokenizer=self.tokenizer, started=arrived, span=span
            )
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event

    def _final(self, event: FinalEvent, draft_name: str | None, arrived: float) -> gateway_pb2.GenerateResponse:
        stats = event.stats.as_dict()
        self.metrics.record_request(
            stats,
            event.finish_reason,
            draft_name or NO_DRAFT,
            event.prompt_tokens,
            event.completion_tokens,
            e2e_s=time.perf_counter() - arrived,
        )
        return gateway_pb2.GenerateResponse(
            final=gateway_pb2.FinalMessage(
                finish_reason=event.finish_reason,
                usage=gateway_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens),
                stats=convert.spec_stats_to_proto(stats),
                has_text=event.text is not None,
                text=event.text or "",
            )
        )

    async def Generate(self, request, context):
        """A coroutine that writes (not an async generator handed to gRPC): when the client hangs up,
        the cancellation lands here, and ``aclosing`` ends the request's generators in this task, so
        their release runs now (a generator gRPC drops is only closed whenever it is collected)."""
        async with contextlib.aclosing(self._events(request, context)) as messages:
            async for msg in messages:
                await context.write(msg)

    async def GenerateUnary(self, request, context):
        ids: list[int] = []
        async with contextlib.aclosing(self._events(request, context)) as messages:
            async for msg in messages:
                if msg.HasField("final"):
                    return gateway_pb2.GenerateResult(token_ids=ids, text=msg.final.text, final=msg.final)
                ids.extend(msg.delta.token_ids)
        await context.abort(grpc.StatusCode.INTERNAL, "the request ended without a final message")

    # -------------------------------------------------------------------------------- admin
    def _is_admin(self, context) -> bool:
        """Whether the call carries the admin token (never, with none set)."""
        if self._admin_token is None:
            return False
        given = b""
        for key, value in context.invocation_metadata() or ():
            if key == ADMIN_METADATA:
                given = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
        return hmac.compare_digest(given, self._admin_token)

    async def _check_admin(self, context) -> None:
        if self._admin_token is None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, "SetDraft is off: start the gateway with --admin-token to allow it"
            )
        if not self._is_admin(context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{ADMIN_METADATA}: missing or wrong admin token")

    async def SetDraft(self, request, context):
        await self._authorize(context, request)
        await self._check_admin(context)
        name, address = request.name, request.address
        what = f"gateway: SetDraft {short(name, 64)!r} -> {short(address, 200)!r} from {context.peer()}"
        remaining = context.time_remaining()
        wait_s = (
            self.config.set_draft_timeout_s
            if remaining is None
            else min(self.config.set_draft_timeout_s, 0.8 * remaining)
        )
        refused = await self._swap_draft(name, address, wait_s)
        if refused is not None:  # logged as what it is: a swap that did not happen
            code, message = refused
            print(f"{what} failed: {code.name}: {short(message, 300)}", file=sys.stderr, flush=True)
            await context.abort(code, message)
        print(f"{what}: {'removed' if not address else 'in use'}", file=sys.stderr, flush=True)
        return gateway_pb2.SetDraftResponse(name=name, address=address)

    async def _swap_draft(self, name: str, address: str, wait_s: float) -> tuple[grpc.StatusCode, str] | None:
        """Put, replace or (an empty address) remove draft ``name``, waiting up to ``wait_s`` for its service;
        None when done, else why not."""
        if not name or name == NO_DRAFT:
            return grpc.StatusCode.INVALID_ARGUMENT, f"name: {name!r} is empty or reserved"
        if not address:
            self.drafts.remove(name)
            if self.default_draft == name:
                self.default_draft = next(iter(self.drafts.addresses()), None)
            return None
        try:
            ep = self.drafts.make(name, address)
        except SpecserveError as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        try:
            info = await ep.fetch_info(wait_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            await ep.close()
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"address: no draft service reachable at {address}: {exc.details()}",
            )
        problem = incompatible(info, self.target.target_info)
        if problem:
            await ep.close()
            return grpc.StatusCode.FAILED_PRECONDITION, f"address: {problem}"
        self.drafts.put(ep)
        self.metrics.register_draft(name)
        self._adaptive_by_draft.pop(name, None)  # a new drafter: its costs and acceptance start afresh
        if self.default_draft is None:
            self.default_draft = name
        return None

    async def ListDrafts(self, request, context):
        """The drafts' names; their services' addresses only to a caller with the admin token (else "")."""
        await self._authorize(context, request)
        admin = self._is_admin(context)
        return gateway_pb2.ListDraftsResponse(
            drafts={name: address if admin else "" for name, address in self.drafts.addresses().items()}
        )
