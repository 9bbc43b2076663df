"""The OpenAI HTTP API's bodies <-> the gateway's GenerateRequest and GenerateResponse messages.

Requests (``POST /v1/completions``, ``POST /v1/chat/completions``): ``model``, ``prompt`` (text, token
ids, or a list of either: one choice set per prompt) or ``messages``, ``max_tokens`` (chat:
``max_completion_tokens`` too; completions with ``echo``: 0 scores the prompt only), ``temperature``, ``top_p``
(in (0, 1]), ``seed`` (choice j of n draws with seed + j), ``stop`` (a string or a list), ``n``, ``stream``,
``stream_options.include_usage``, ``logprobs`` (completions: alternatives per token; chat: true/false, with
``top_logprobs``), ``echo`` (completions: the prompt's text and logprobs first), and specserve's speculation
settings as extra fields (``draft``, ``num_speculative_tokens``, ``tree_nodes``, ``tree_top_k``, ``tree_depth``,
``speculation`` = fixed | adaptive, ``draft_ahead``). Only the API's shape is checked here (types, counts,
fields specserve does not serve); every limit is gateway/validation.py's, with the gRPC API's messages. Fields
that are not acted on (unknown ones, or API fields such as ``user``) are ignored and named in the response's
``specserve-ignored-fields`` header. Responses (gateway/openai_responses.py) carry each choice's speculation
statistics in the extension field ``specserve``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from specserve.contract.types import MAX_TOP_LOGPROBS
from specserve.errors import SpecserveError
from specserve.protos.specserve.v1 import common_pb2, gateway_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the API's default for /v1/completions; chat: the room left
INT32 = 2**31
MAX_CHOICES = 64  # prompts x n of one request (each choice is a request of its own to admission)
# fields of the API that change the output and that specserve does not serve: allowed only at these values
_UNSERVED = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
_SERVED = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "draft",
    "num_speculative_tokens",
    "tree_nodes",
    "tree_top_k",
    "tree_depth",
    "speculation",
    "draft_ahead",
    *_UNSERVED,
}
_SERVED_COMPLETIONS = _SERVED | {"prompt", "echo"}
_SERVED_CHAT = _SERVED | {"messages", "max_completion_tokens", "top_logprobs"}
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


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


# what a validation message says in the wire's terms, said in the API's (it has no prompt_ids)
_HTTP_WORDING = ((" (set prompt or prompt_ids)", ""), ("send prompt_ids", "send the prompt as token ids"))


def api_message(message: str, field: str | None, param: str | None) -> str:
    """A validation message (``field: problem``) in the API's field names: ``max_tokens: ...`` for
    ``max_new_tokens: ...``, ``prompt`` (or ``messages``) for ``prompt_ids``, ``temperature`` for
    ``sampling.temperature``."""
    if field is None or param is None or not message.startswith(f"{field}: "):
        return message
    problem = message[len(field) + 2 :]
    for wire, api in _HTTP_WORDING:
        problem = problem.replace(wire, api)
    return f"{param}: {problem}"


def from_gateway_error(code: grpc.StatusCode, message: str, field: str | None, chat: bool) -> ApiError:
    """A GatewayError (gRPC status + message) as the API's error with its HTTP status, in the API's names."""
    param = api_param(field, chat)
    return ApiError(_HTTP_STATUS.get(code, 500), api_message(message, field, param), param, code.name.lower())


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
    """One parsed request: what the HTTP layer needs beside its GenerateRequests."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool
    messages: tuple[dict, ...]  # chat: [{"role", "content"}] with text content
    prompts: tuple[gateway_pb2.GenerateRequest, ...]  # one per prompt (chat: one, its prompt still to render)
    fill_max_tokens: bool = False  # chat without max_tokens: the room the context leaves (up to the limit)
    n: int = 1  # choices per prompt
    logprobs: int | None = None  # alternatives per token when logprobs were asked for, else None
    echo: bool = False  # completions: the prompt (text, logprobs) before each choice's completion
    score_only: bool = False  # echo with max_tokens 0: one token is generated and dropped (the prompt's logprobs)
    ignored: tuple[str, ...] = ()  # body fields not acted on

    @property
    def request(self) -> gateway_pb2.GenerateRequest:
        return self.prompts[0]

    def choices(self) -> list[tuple[int, gateway_pb2.GenerateRequest]]:
        """(prompt index, request) of each choice, in the API's order (choice index = prompt * n + j); choice j
        of a seeded request draws with seed + j."""
        out = []
        for i, req in enumerate(self.prompts):
            for j in range(self.n):
                one = gateway_pb2.GenerateRequest()
                one.CopyFrom(req)
                if j and req.sampling.HasField("seed"):
                    one.sampling.seed = (req.sampling.seed + j) % 2**64
                out.append((i, one))
        return out


def _token_ids(value) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = [t for t in value if not 0 <= t < INT32]
        if bad:
            raise _bad("prompt", f"token ids {bad[:4]} are out of range")
        return value
    return None


def _prompts(body: dict, req: gateway_pb2.GenerateRequest) -> list[gateway_pb2.GenerateRequest]:
    """One request per prompt: a string, a list of token ids, or a list of several of either."""
    value = body.get("prompt")
    batch = value if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value) else [value]
    out = []
    for one in batch:
        r = gateway_pb2.GenerateRequest()
        r.CopyFrom(req)
        if isinstance(one, str):
            r.prompt = one
        elif (ids := _token_ids(one)) is not None:
            r.prompt_ids.extend(ids)
        else:
            raise _bad("prompt", f"expected a string, a list of token ids or a list of those, got {value!r:.80}")
        out.append(r)
    return out


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


def _not_unicode(body) -> tuple[str, int] | None:
    """(where, character index) of the first string of a parsed body that is no Unicode text: JSON's ``\\ud800``
    escapes decode to lone surrogates, which cannot be UTF-8 (protobuf strings, the tokenizer). Walked without
    recursion; ASCII strings are passed by a flag of the string, others encoded once."""
    todo = [("", body)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as exc:
                    return where or "request body", exc.start
        elif isinstance(value, dict):
            for key, item in value.items():
                todo.append((where, key))  # a key is text too
                key = key.encode("utf-8", "backslashreplace").decode() if isinstance(key, str) else key  # printable
                name = f"{where}.{key}" if where else str(key)
                todo.append((name, item))
        elif isinstance(value, list):
            todo.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
    return None


def parse_request(body, chat: bool) -> ApiRequest:
    """Check the API's shape of a request body and build its GenerateRequest; raises ApiError (400)."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body: expected a JSON object")
    bad = _not_unicode(body)
    if bad is not None:
        where, at = bad
        raise _bad(
            where, f"character {at} is a lone surrogate (a \\ud800-\\udfff escape without its pair), not Unicode text"
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "required (the served model's name, see GET /v1/models)")
    for name, allowed in _UNSERVED.items():
        if name in body and body[name] not in allowed:
            raise _bad(name, f"{body[name]!r:.40} is not supported by specserve")
    ignored = tuple(sorted(k for k in body if k not in (_SERVED_CHAT if chat else _SERVED_COMPLETIONS)))
    n = _int(body, "n", 1, 1, MAX_CHOICES + 1)
    logprobs, echo = _logprobs(body, chat), False
    if not chat:
        echo = body.get("echo", False) or False
        if not isinstance(echo, bool):
            raise _bad("echo", f"expected true or false, got {echo!r}")
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
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise _bad("top_p", f"must be in (0, 1], got {body['top_p']!r}")
    sampling = common_pb2.SamplingParams(temperature=_number(body, "temperature", 1.0), top_p=top_p)
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
    score_only = echo and max_tokens == 0  # the prompt's logprobs only: one token is made and dropped
    req = gateway_pb2.GenerateRequest(
        max_new_tokens=1 if score_only else max_tokens or 0,  # any value given goes to validation (its limits)
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
    if logprobs is not None:
        req.logprobs.top = logprobs
        req.logprobs.prompt = echo
    messages: tuple[dict, ...] = ()
    if chat:
        messages, prompts = _messages(body), [req]
    else:
        prompts = _prompts(body, req)
    if len(prompts) * n > MAX_CHOICES:
        raise _bad("n", f"{len(prompts)} prompts x n = {n} make more than {MAX_CHOICES} choices")
    return ApiRequest(
        chat,
        model,
        stream,
        include_usage,
        messages,
        tuple(prompts),
        fill_max_tokens=max_tokens is None,
        n=n,
        logprobs=logprobs,
        echo=echo,
        score_only=score_only,
        ignored=ignored,
    )


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token when the request asks for logprobs (completions: ``logprobs`` = that count;
    chat: ``logprobs`` true, ``top_logprobs`` the count), else None."""
    if not chat:
        return _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS + 1)
    on = body.get("logprobs", False) or False
    if not isinstance(on, bool):
        raise _bad("logprobs", f"expected true or false, got {on!r}")
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS + 1)
    if top is not None and not on:
        raise _bad("top_logprobs", "needs logprobs = true")
    return (top or 0) if on else None
