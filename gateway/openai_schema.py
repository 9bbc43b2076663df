"""The OpenAI HTTP API's bodies <-> the gateway's GenerateRequest and GenerateResponse messages.

Requests (``POST /v1/completions``, ``POST /v1/chat/completions``): ``model``, ``prompt`` (text, token
ids, or a list of one of those) or ``messages``, ``max_tokens`` (chat: ``max_completion_tokens`` too),
``temperature``, ``top_p``, ``seed``, ``stop`` (a string or a list), ``n`` (1 only), ``stream``,
``stream_options.include_usage``, and specserve's speculation settings as extra fields (``draft``,
``num_speculative_tokens``, ``tree_nodes``, ``tree_top_k``, ``tree_depth``, ``speculation`` = fixed |
adaptive, ``draft_ahead``). Only the API's shape is checked here (types, ``n``, fields specserve does not
serve); every limit is gateway/validation.py's, with the gRPC API's messages. Responses carry the
request's speculation statistics in the extension field ``specserve``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from specserve.errors import SpecserveError
from specserve.protos.specserve.v1 import common_pb2, gateway_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the API's default for /v1/completions; chat: the room left
EXTENSION = "specserve"  # the extension field of responses (speculation statistics)
INT32 = 2**31
# fields of the API that change the output and that specserve does not serve: allowed only at these values
_UNSERVED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # gateway -> API
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                429: "rate_limit_error", 503: "service_unavailable_error"}


class ApiError(SpecserveError):
    """An answer in the API's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def api_param(field: str | None, chat: bool) -> str | None:
    """The API's name of a GenerateRequest field named in a validation message."""
    if field is None:
        return None
    head = field.split("[")[0].split(".")[-1]
    if head in ("prompt", "prompt_ids"):
        return "messages" if chat else "prompt"
    return {"max_new_tokens": "max_tokens"}.get(head, head)


def from_gateway_error(code: grpc.StatusCode, message: str, field: str | None, chat: bool) -> ApiError:
    """A GatewayError (gRPC status + message) as the API's error with its HTTP status."""
    return ApiError(_HTTP_STATUS.get(code, 500), message, api_param(field, chat), code.name.lower())


def _bad(param: str, problem: str) -> ApiError:
    return ApiError(400, f"{param}: {problem}", param)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"expected a number, got {value!r}")
    return float(value)


def _int(body: dict, name: str, default: int | None = None, low: int = -INT32, high: int = INT32) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"expected an integer, got {value!r}")
    if not low <= value < high:
        raise _bad(name, f"{value} is out of range [{low}, {high})")
    return value


def _str(body: dict, name: str, default: str = "") -> str:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _bad(name, f"expected a string, got {value!r}")
    return value


@dataclass(frozen=True)
class ApiRequest:
    """One parsed request: what the HTTP layer needs beside the GenerateRequest."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool
    messages: tuple[dict, ...]  # chat: [{"role", "content"}] with text content
    request: gateway_pb2.GenerateRequest  # chat: the prompt is still to render
    fill_max_tokens: bool = False  # chat without max_tokens: the room the context leaves (up to the limit)


def _token_ids(value) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = [t for t in value if not 0 <= t < INT32]
        if bad:
            raise _bad("prompt", f"token ids {bad[:4]} are out of range")
        return value
    return None


def _prompt(body: dict, req: gateway_pb2.GenerateRequest) -> None:
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        req.prompt = value
        return
    ids = _token_ids(value)
    if ids is not None:
        req.prompt_ids.extend(ids)
        return
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise _bad("prompt", f"one prompt per request ({len(value)} given)")
    raise _bad("prompt", f"expected a string or a list of token ids, got {value!r:.80}")


def _content(i: int, content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"messages[{i}].content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", f"expected a string or text parts, got {content!r:.80}")


def _messages(body: dict) -> tuple[dict, ...]:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise _bad("messages", "expected a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "expected an object with a role and content")
        out.append({"role": m["role"], "content": _content(i, m.get("content", ""))})
    return tuple(out)


def parse_request(body, chat: bool) -> ApiRequest:
    """Check the API's shape of a request body and build its GenerateRequest; raises ApiError (400)."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body: expected a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "required (the served model's name, see GET /v1/models)")
    for name, allowed in _UNSERVED.items():
        if name in body and body[name] not in allowed:
            raise _bad(name, f"{body[name]!r:.40} is not supported by specserve")
    if _int(body, "n", 1) != 1:
        raise _bad("n", "only n = 1 is supported")
    stream = body.get("stream", False) or False
    if not isinstance(stream, bool):
        raise _bad("stream", f"expected true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options", f"expected an object, got {options!r}")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _bad("stream_options.include_usage", f"expected true or false, got {include_usage!r}")
    if options and not stream:
        raise _bad("stream_options", "only allowed with stream = true")

    seed = _int(body, "seed", None, 0, 2**64)
    sampling = common_pb2.SamplingParams(
        temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0)
    )
    if seed is not None:
        sampling.seed = seed
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", f"expected a string or a list of strings, got {body.get('stop')!r:.80}")
    speculation = _str(body, "speculation", "fixed")
    if speculation not in ("fixed", "adaptive"):
        raise _bad("speculation", f"expected 'fixed' or 'adaptive', got {speculation!r}")
    draft_ahead = body.get("draft_ahead", False)
    if not isinstance(draft_ahead, bool):
        raise _bad("draft_ahead", f"expected true or false, got {draft_ahead!r}")
    max_tokens = _int(body, "max_tokens")
    if chat and max_tokens is None:
        max_tokens = _int(body, "max_completion_tokens")
    if not chat and max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    req = gateway_pb2.GenerateRequest(
        max_new_tokens=max_tokens or 0,  # any value given goes to validation (its limits and messages)
        sampling=sampling,
        draft=_str(body, "draft"),
        num_speculative_tokens=_int(body, "num_speculative_tokens", 0),
        stop=stop,
        speculation=gateway_pb2.SPECULATION_ADAPTIVE if speculation == "adaptive" else gateway_pb2.SPECULATION_FIXED,
        draft_ahead=draft_ahead,
        tree_nodes=_int(body, "tree_nodes", 0),
        tree_top_k=_int(body, "tree_top_k", 0),
        tree_depth=_int(body, "tree_depth", 0),
    )
    messages: tuple[dict, ...] = ()
    if chat:
        messages = _messages(body)
    else:
        _prompt(body, req)
    return ApiRequest(chat, model, stream, include_usage, messages, req, fill_max_tokens=max_tokens is None)


# ---------------------------------------------------------------------------------- responses
def stats_extension(final: gateway_pb2.FinalMessage, token_ids: list[int]) -> dict:
    """The ``specserve`` field: the request's speculation statistics (and its token ids)."""
    s = final.stats
    return {
        "token_ids": list(token_ids),
        "finish_reason": final.finish_reason,  # eos | stop | length (the API folds eos into stop)
        "steps": s.steps,
        "mean_accepted_length": s.mean_accepted_length,
        "accepted_per_position": list(s.accepted_per_position),
        "draft_fallback": s.draft_fallback,
        "tokens_per_s": s.tokens_per_s,
        "ttft_s": s.ttft_s,
        "draft_ms": s.draft_ms,
        "draft_hidden_ms": s.draft_hidden_ms,
        "draft_ahead_hits": s.draft_ahead_hits,
        "chosen_k": dict(sorted(s.chosen_k.items(), key=lambda kv: int(kv[0]))),
    }


def usage_body(final: gateway_pb2.FinalMessage) -> dict:
    p, c = final.usage.prompt_tokens, final.usage.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


@dataclass(frozen=True)
class ResponseHead:
    """What every response and chunk of one request shares."""

    chat: bool
    id: str
    created: int
    model: str

    def _base(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish: str | None, first: bool = False, whole: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if whole:
            return {"index": 0, "message": {"role": "assistant", "content": text or ""}, "logprobs": None,
                    "finish_reason": finish}
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", **delta}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def whole(self, text: str, final: gateway_pb2.FinalMessage, token_ids: list[int]) -> dict:
        """The non-streamed response."""
        body = self._base("chat.completion" if self.chat else "text_completion")
        body["choices"] = [self._choice(text, FINISH_REASONS.get(final.finish_reason, "stop"), whole=True)]
        body["usage"] = usage_body(final)
        body[EXTENSION] = stats_extension(final, token_ids)
        return body

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False, usage=False) -> dict:
        """One streamed chunk (``usage``: the field is there, null, when the request asked for usage)."""
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [self._choice(text, finish, first=first)]
        if usage:
            body["usage"] = None
        return body

    def usage_chunk(self, final: gateway_pb2.FinalMessage) -> dict:
        """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage_body(final)
        return body


class StopHoldback:
    """Streamed text that never shows a stop string's start before it is known not to be one.

    The gateway's deltas may end with the first characters of a stop string (a later token may complete
    it, and the final text is cut before it); ``push`` holds back the longest tail that is a prefix of a
    stop string, and ``finish`` gives what the final text adds to what was sent. Sent chunks therefore
    concatenate to the non-streamed text.
    """

    def __init__(self, stop) -> None:
        self._stop = tuple(s for s in stop if s)
        self._text = ""  # every delta so far
        self.sent = 0  # characters of _text sent

    def _held(self) -> int:
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def push(self, delta: str) -> str:
        self._text += delta
        ready = len(self._text) - self._held()
        out = self._text[self.sent : ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        return out

    def finish(self, final_text: str) -> str:
        sent = self._text[: self.sent]
        return final_text[len(sent) :] if final_text.startswith(sent) else ""
