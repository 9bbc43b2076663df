"""The gateway's OpenAI-compatible HTTP API (Starlette, served by uvicorn on the gateway's event loop).

    POST /v1/completions, POST /v1/chat/completions   (stream: server-sent events, then ``data: [DONE]``)
    GET  /v1/models                                    the served model and its drafts
    GET  /health                                       200 while the target answers its health check
    GET  /metrics                                      Prometheus text of the gateway's OpenTelemetry metrics (token)

Every generation goes through ``GatewayServicer.generate``, the per-request path of gRPC Generate
(validation, admission, spec loop, spans, metrics); this module only translates bodies (requests:
gateway/openai_schema.py, responses: gateway/openai_responses.py), renders chat prompts (gateway/chat_template.py)
and maps a GatewayError to the API's error shape and HTTP status. A client that disconnects cancels its request (both
services release its session), streamed or not. The W3C trace context of the HTTP headers is the
parent of the request's spans, so an HTTP request is one trace across gateway, draft and target.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specserve.gateway.chat_template import ChatTemplate, ChatTemplateError
from specserve.gateway.http_streaming import EventStream, Generation, gather_all, sse, until_disconnect
from specserve.gateway.metrics_relay import ScrapeCache, ScrapePacer, ScrapesBusy, relay_text
from specserve.gateway.openai_responses import (
    EXTENSION,
    FINISH_REASONS,
    ChoiceResult,
    LogprobsLog,
    ResponseHead,
    StopHoldback,
    stats_extension,
    usage_body,
)
from specserve.gateway.openai_schema import ApiError, ApiRequest, from_gateway_error, parse_request
from specserve.gateway.server import UNAUTHENTICATED_MESSAGE, GatewayError, GatewayServicer
from specserve.gateway.validation import InvalidRequest
from specserve.runtime import tracing as tn

HEALTH_TIMEOUT_S = 1.0
_PARSE_ON_LOOP_BYTES = 256 * 1024  # a body up to this is parsed on the loop (< 1 ms), a larger one on a thread
IGNORED_HEADER = "specserve-ignored-fields"  # names the body fields a response did not act on
METRICS_INTERVAL_S = 5.0  # the relayed series on /metrics are at most this old (--metrics-interval-s)


def _error(exc: ApiError) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class HttpApi:
    """The routes, over one GatewayServicer."""

    def __init__(
        self,
        servicer: GatewayServicer,
        telemetry,
        chat_template: ChatTemplate | None,
        max_body_bytes: int = 4 << 20,
        metrics_interval_s: float = METRICS_INTERVAL_S,
    ) -> None:
        self.servicer = servicer
        self.relayed = ScrapeCache(  # the target's and drafts' series, asked for at most once an interval
            lambda: relay_text(servicer.target, servicer.drafts.endpoints()), metrics_interval_s
        )
        self.scrapes = ScrapePacer()  # one /metrics at a time, 10 a second at most
        self.max_body_bytes = max_body_bytes  # the gateway's --max-message-bytes
        self.telemetry = telemetry
        self.chat_template = chat_template
        self.started = int(time.time())
        self._warned: set[str] = set()  # ignored body fields already logged

    def app(self) -> Starlette:
        async def http_error(_request, exc: HTTPException):
            message = {404: "no such route", 405: "method not allowed"}.get(exc.status_code, str(exc.detail))
            routes = "/v1/models, /v1/completions, /v1/chat/completions"
            return _error(ApiError(exc.status_code, f"{message}: see {routes}"))

        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ],
            exception_handlers={HTTPException: http_error},
        )

    # ------------------------------------------------------------------------------- routes
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    def _model_card(self) -> dict:
        drafts = self.servicer.drafts.addresses()
        return {
            "id": self.servicer.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "specserve",
            "specserve": {"drafts": sorted(drafts), "default_draft": self.servicer.default_draft},
        }

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            return _error(exc)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        try:
            self._authorize(request)
            name = request.path_params["model_id"]
            if name != self.servicer.model_name:
                raise ApiError(
                    404,
                    f"model: {name!r} does not exist (this gateway serves {self.servicer.model_name!r})",
                    "model",
                    "model_not_found",
                )
        except ApiError as exc:
            return _error(exc)
        return JSONResponse(self._model_card())

    async def health(self, _request: Request) -> Response:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.servicer.target.channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
            serving = resp.status == health_pb2.HealthCheckResponse.SERVING
        except Exception:  # noqa: BLE001 - any failure to answer: not healthy
            serving = False
        if not serving:
            return _error(ApiError(503, f"the target service at {self.servicer.target.address} is not serving"))
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        """The gateway's own series, then the target's and drafts' relayed from their GetStats (cached: at most one
        GetStats a service per interval). Takes the clients' token when one is set; scrapes take turns (ScrapePacer)."""
        from prometheus_client import CONTENT_TYPE_LATEST

        try:
            self._authorize(request)
            async with self.scrapes.turn():
                body = self.telemetry.prometheus_text() + await self.relayed.get()
        except ApiError as exc:
            return _error(exc)
        except ScrapesBusy as exc:
            return _error(ApiError(429, f"/metrics: {exc}; scrape less often"))
        return Response(body, headers={"content-type": CONTENT_TYPE_LATEST})

    # ---------------------------------------------------------------------------- generation
    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request's raw headers carry the clients' token (the HTTP server keeps such a connection's place)."""
        return self.servicer.token_ok(next((v for k, v in headers if k == b"authorization"), None))

    def _authorize(self, request: Request) -> None:
        if not self.servicer.token_ok(request.headers.get("authorization")):
            raise ApiError(401, UNAUTHENTICATED_MESSAGE, code="invalid_api_key")

    async def _parse(self, request: Request, chat: bool) -> ApiRequest:
        self._authorize(request)
        raw = bytearray()
        try:
            async for part in request.stream():
                raw += part
                if len(raw) > self.max_body_bytes:
                    raise ApiError(
                        413, f"request body: more than the limit of {self.max_body_bytes} bytes (--max-message-bytes)"
                    )
        except ClientDisconnect:  # gone, or closed at the read timeout: nobody reads the answer
            raise ApiError(408, "request body: the connection ended before the body did") from None
        try:  # a large body is parsed on a thread, but json.loads holds the GIL for its whole call (~10 ms for 4 MB
            # here), so the loop's other requests still wait that long; what the thread buys is the loop's turn
            # before and after the parse, not during it
            body = json.loads(raw) if len(raw) <= _PARSE_ON_LOOP_BYTES else await asyncio.to_thread(json.loads, raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body: not valid JSON ({exc})") from None
        except RecursionError:
            raise ApiError(400, "request body: not valid JSON (nested too deeply)") from None
        api = parse_request(body, chat)
        self._check_share(api)
        if api.model != self.servicer.model_name:
            raise ApiError(
                404,
                f"model: {api.model!r} does not exist (this gateway serves {self.servicer.model_name!r})",
                "model",
                "model_not_found",
            )
        if chat:
            await self._render_chat(api)
        return api

    def _check_share(self, api: ApiRequest) -> None:
        """One request's choices hold at most its share of the sessions, and their output tokens together at most
        --max-output-tokens (each choice is a request of its own to admission and to the target)."""
        config = self.servicer.config
        choices, share = len(api.prompts) * api.n, config.max_choices
        if choices > share:
            raise ApiError(
                400,
                f"n: {len(api.prompts)} prompt(s) x n = {api.n} make {choices} choices; one request may "
                f"hold {share} sessions (a quarter of the gateway's --max-sessions {config.max_sessions})",
                "n",
            )
        limit, each = config.limits.max_new_tokens, api.request.max_new_tokens
        if choices > 1 and not api.fill_max_tokens and choices * each > limit:
            raise ApiError(
                400,
                f"max_tokens: {choices} choices x {each} tokens exceed the {limit} output tokens one "
                "request may ask for (--max-output-tokens)",
                "max_tokens",
            )

    async def _render_chat(self, api: ApiRequest) -> None:
        """Chat: the prompt is the conversation rendered by the checkpoint's chat template, tokenized as
        transformers' apply_chat_template does (the template writes any special tokens itself)."""
        name = self.servicer.model_name
        if self.chat_template is None:
            raise ApiError(
                400,
                f"messages: the model {name!r} has no chat template (tokenizer_config.json "
                "chat_template); use /v1/completions",
                "messages",
            )
        tokenizer = self.servicer.tokenizer
        if tokenizer is None:
            raise ApiError(400, "messages: this gateway has no tokenizer (start it with --model)", "messages")
        try:
            text = self.chat_template.render(list(api.messages))
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), "messages") from None
        try:
            ids = await self.servicer.encode_prompt(text, add_special_tokens=False)  # size checked, off the loop
        except InvalidRequest as exc:
            raise ApiError(400, str(exc).replace("prompt:", "messages:", 1), "messages") from None
        api.request.prompt_ids.extend(ids)
        if api.fill_max_tokens:  # the room left, the output limit shared by the choices
            info, limit = self.servicer.target.target_info, self.servicer.config.limits.max_new_tokens
            api.request.max_new_tokens = max(1, min(limit // api.n, info.max_context - len(ids)))

    async def _echo_ids(self, api: ApiRequest) -> list[list[int]]:
        """Echo: each prompt's token ids (a text prompt tokenized here as validation would, and sent as ids, so
        the echoed tokens are the scored ones; its size checked first and tokenized off the loop)."""
        out = []
        for req in api.prompts:
            text = req.prompt  # read once (each read decodes the field anew)
            if text and self.servicer.tokenizer is not None:
                try:
                    req.prompt_ids.extend(await self.servicer.encode_prompt(text))
                except InvalidRequest as exc:
                    raise ApiError(400, str(exc), "prompt") from None
                req.ClearField("prompt")
            out.append(list(req.prompt_ids))
        return out

    def _prompt_text(self, req, ids: list[int]) -> str:
        tokenizer = self.servicer.tokenizer
        return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            api = await self._parse(request, chat)
        except ApiError as exc:
            return _error(exc)
        if api.ignored:
            self._warn_ignored(api.ignored)
        try:
            echo_ids = await self._echo_ids(api) if api.echo else None
        except ApiError as exc:
            return _error(exc)
        head = ResponseHead(
            chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), self.servicer.model_name
        )
        parent = tn.context_from_metadata(request.headers.items())
        choices = api.choices()
        gens = [Generation(self.servicer.generate(req, parent)) for _, req in choices]
        view = _Choices(self, api, choices, echo_ids)
        streaming = False
        try:
            # the first message of every choice decides between an error status and a 200: validation, admission
            # and the prefill all come before it
            try:
                firsts = await until_disconnect(request.receive, gather_all([g.next() for g in gens]))
            except GatewayError as exc:
                return _error(from_gateway_error(exc.code, str(exc), exc.field, chat))
            if firsts is None:
                return Response(status_code=499)  # the client went away (nobody reads this)
            headers = {IGNORED_HEADER: ", ".join(api.ignored)} if api.ignored else None
            if api.stream:
                streaming = True
                return EventStream(self._events(api, head, view, firsts, gens), gens, headers)
            whole = await until_disconnect(request.receive, self._whole(api, head, view, firsts, gens))
            if whole is None:
                return Response(status_code=499)
            if headers:
                whole.headers.update(headers)
            return whole
        finally:
            if not streaming:
                for g in gens:
                    await g.close()

    def _warn_ignored(self, names: tuple[str, ...]) -> None:
        new = [n for n in names if n not in self._warned]
        if new:
            self._warned.update(new)
            print(
                f"gateway: HTTP request fields ignored (not acted on): {', '.join(new)} (said once per field; "
                f"each response names them in its {IGNORED_HEADER} header)",
                file=sys.stderr,
                flush=True,
            )

    async def _whole(self, api: ApiRequest, head: ResponseHead, view: _Choices, firsts, gens) -> Response:
        async def one(index: int, msg, generation: Generation) -> ChoiceResult:
            ids: list[int] = []
            log = view.start(index, msg)
            while not msg.HasField("final"):
                ids.extend(msg.delta.token_ids)
                view.add(log, msg.delta)
                msg = await generation.next()
            return view.result(index, msg.final, ids, log)

        try:
            results = await gather_all([one(i, f, g) for i, (f, g) in enumerate(zip(firsts, gens))])
        except GatewayError as exc:
            return _error(from_gateway_error(exc.code, str(exc), exc.field, api.chat))
        return JSONResponse(head.whole(results, view.usage([r.final for r in results], results)))

    async def _events(self, api: ApiRequest, head: ResponseHead, view: _Choices, firsts, gens):
        """The SSE chunks of one request: per choice, text deltas (stop-string starts held back; an echo first),
        a chunk with the finish reason and the speculation statistics; the usage chunk if asked for, then
        [DONE]. An error after the first token is one ``data: {"error": ...}`` event (the status was sent)."""
        usage = api.include_usage
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, first, generation: Generation) -> None:
            msg = first
            try:
                while True:
                    await queue.put((index, msg))
                    if msg.HasField("final"):
                        return
                    msg = await generation.next()
            except GatewayError as exc:
                await queue.put((index, exc))

        pumps = [asyncio.ensure_future(pump(i, f, g)) for i, (f, g) in enumerate(zip(firsts, gens))]
        texts = [StopHoldback(req.stop) for _, req in view.choices]
        ids: list[list[int]] = [[] for _ in gens]
        logs = [None] * len(gens)
        finals: list = [None] * len(gens)
        try:
            for index in range(len(gens)):
                logs[index] = view.start(index, firsts[index])
                echo = view.echo_text(index)
                if api.chat or echo or logs[index] is not None and logs[index].tokens:
                    part = None if logs[index] is None or not logs[index].tokens else logs[index].body()
                    yield sse(
                        head.chunk(echo if not api.chat else "", first=True, usage=usage, index=index, logprobs=part)
                    )
            left = len(gens)
            while left:
                index, msg = await queue.get()
                if isinstance(msg, GatewayError):
                    yield sse(from_gateway_error(msg.code, str(msg), msg.field, api.chat).body())
                    return
                if not msg.HasField("final"):
                    ids[index].extend(msg.delta.token_ids)
                    part = view.add(logs[index], msg.delta)
                    piece = "" if api.score_only else texts[index].push(msg.delta.text)
                    if piece or part is not None:
                        yield sse(head.chunk(piece, usage=usage, index=index, logprobs=part))
                    continue
                final = finals[index] = msg.final
                left -= 1
                rest = "" if api.score_only else texts[index].finish(final.text)
                last = head.chunk(
                    rest or None if api.chat else rest,
                    FINISH_REASONS.get(final.finish_reason, "stop"),
                    usage=usage,
                    index=index,
                )
                last[EXTENSION] = stats_extension(final, [] if api.score_only else ids[index])
                yield sse(last)
        finally:
            for p in pumps:
                p.cancel()
        if usage:
            yield sse(head.usage_chunk(view.usage(finals)))
        yield sse("[DONE]")


class _Choices:
    """What one request's choices show beyond the gateway's messages: echoed prompts, logprobs, score-only."""

    def __init__(self, api_: HttpApi, api: ApiRequest, choices, echo_ids: list[list[int]] | None) -> None:
        self.http, self.api, self.choices, self.echo_ids = api_, api, choices, echo_ids

    def echo_text(self, index: int) -> str:
        if self.echo_ids is None:
            return ""
        prompt, req = self.choices[index]
        return req.prompt or self.http._prompt_text(req, self.echo_ids[prompt])

    def start(self, index: int, first) -> LogprobsLog | None:
        """The choice's logprobs log (None unless asked), holding the echoed prompt's tokens."""
        if self.api.logprobs is None:
            return None
        log = LogprobsLog(self.http.servicer.tokenizer, self.api.chat)
        if self.echo_ids is not None:
            ids = self.echo_ids[self.choices[index][0]]
            if ids:
                log.add_unscored(ids[0])
            if first.HasField("delta") and first.delta.HasField("prompt_logprobs"):
                log.add(first.delta.prompt_logprobs)
        return log

    def add(self, log: LogprobsLog | None, delta) -> dict | None:
        """A delta's tokens into the log; their part of the API's logprobs (None when none were asked)."""
        if log is None or self.api.score_only or not delta.HasField("logprobs"):
            return None
        return log.add(delta.logprobs)

    def result(self, index: int, final, ids: list[int], log: LogprobsLog | None) -> ChoiceResult:
        if self.api.score_only:
            text, ids = self.echo_text(index), []
        else:
            text = self.echo_text(index) + final.text
        return ChoiceResult(index, text, final, ids, log)

    def usage(self, finals, results: list[ChoiceResult] | None = None) -> dict:
        """Prompt tokens once per prompt, completion tokens of every choice (score-only: none)."""
        prompts = {}
        for (prompt, _), final in zip(self.choices, finals):
            prompts[prompt] = final.usage.prompt_tokens
        done = 0 if self.api.score_only else sum(f.usage.completion_tokens for f in finals)
        return usage_body(list(finals), sum(prompts.values()), done)
