"""The OpenAI HTTP API's response bodies from the gateway's messages: the whole response and a stream's chunks
(ResponseHead), a choice's logprobs as the API shows them (LogprobsLog), usage, the ``specserve`` extension field
with each choice's speculation statistics, and the held-back tail of streamed text that may start a stop string
(StopHoldback). The requests' side is gateway/openai_schema.py."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.protos.specserve.v1 import common_pb2, gateway_pb2

EXTENSION = "specserve"  # the extension field of responses (speculation statistics)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # gateway -> API


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


def token_text(tokenizer, token_id: int) -> str:
    """A token's text in a logprobs entry (``token_id:N`` without a tokenizer)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


class LogprobsLog:
    """One choice's tokens with the target's log-probabilities, as the API shows them: completions
    ``{tokens, token_logprobs, top_logprobs, text_offset}``, chat ``{content: [{token, logprob, bytes,
    top_logprobs}]}``. An echoed prompt's first token has no logprob (None), as in the API."""

    def __init__(self, tokenizer, chat: bool, offset: int = 0) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.tokens: list[str] = []
        self.logprobs: list[float | None] = []
        self.tops: list[list[tuple[str, float]] | None] = []
        self.offsets: list[int] = []
        self._at = offset

    def _text(self, token_id: int) -> str:
        return token_text(self.tokenizer, token_id)

    def add_unscored(self, token_id: int) -> None:
        self._put(self._text(token_id), None, None)

    def add(self, lp: common_pb2.TokenLogprobs, count: int | None = None) -> dict:
        """The first ``count`` (default all) tokens of a wire TokenLogprobs; returns their part alone (a stream's
        chunk shows only its own tokens)."""
        start = len(self.tokens)
        top = lp.top
        for i in range(len(lp.token_ids) if count is None else min(count, len(lp.token_ids))):
            alternatives = [
                (self._text(t), float(v))
                for t, v in zip(lp.top_ids[i * top : (i + 1) * top], lp.top_logprobs[i * top : (i + 1) * top])
            ]
            self._put(self._text(lp.token_ids[i]), float(lp.logprobs[i]), alternatives)
        return self.body(start)

    def _put(self, text: str, logprob: float | None, tops) -> None:
        self.tokens.append(text)
        self.logprobs.append(logprob)
        self.tops.append(tops)
        self.offsets.append(self._at)
        self._at += len(text)

    def body(self, start: int = 0) -> dict:
        tokens, lps, tops = self.tokens[start:], self.logprobs[start:], self.tops[start:]
        if not self.chat:
            return {
                "tokens": tokens,
                "token_logprobs": lps,
                "top_logprobs": [None if t is None else dict(t) for t in tops],
                "text_offset": self.offsets[start:],
            }

        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                {**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top or ()]}
                for t, lp, top in zip(tokens, lps, tops)
            ]
        }


@dataclass
class ChoiceResult:
    """One finished choice of a non-streamed response."""

    index: int
    text: str
    final: gateway_pb2.FinalMessage
    token_ids: list[int]
    logprobs: LogprobsLog | None = None


def usage_body(
    finals: list[gateway_pb2.FinalMessage], prompt_tokens: int | None = None, completion_tokens: int | None = None
) -> dict:
    """Usage of a request: prompt tokens once per prompt (``prompt_tokens``, default each final's), completion
    tokens of every choice."""
    p = sum(f.usage.prompt_tokens for f in finals) if prompt_tokens is None else prompt_tokens
    c = sum(f.usage.completion_tokens for f in finals) if completion_tokens is None else completion_tokens
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

    def _choice(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        first: bool = False,
        whole: bool = False,
        logprobs: dict | None = None,
    ) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if whole:
            return {
                "index": index,
                "message": {"role": "assistant", "content": text or ""},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", **delta}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def whole(self, choices: list[ChoiceResult], usage: dict) -> dict:
        """The non-streamed response (each choice carries its statistics in ``specserve``)."""
        body = self._base("chat.completion" if self.chat else "text_completion")
        body["choices"] = []
        for c in choices:
            choice = self._choice(
                c.index,
                c.text,
                FINISH_REASONS.get(c.final.finish_reason, "stop"),
                whole=True,
                logprobs=None if c.logprobs is None else c.logprobs.body(),
            )
            choice[EXTENSION] = stats_extension(c.final, c.token_ids)
            body["choices"].append(choice)
        body["usage"] = usage
        if len(choices) == 1:
            body[EXTENSION] = body["choices"][0][EXTENSION]
        return body

    def chunk(
        self,
        text: str | None,
        finish: str | None = None,
        first: bool = False,
        usage=False,
        index: int = 0,
        logprobs: dict | None = None,
    ) -> dict:
        """One streamed chunk (``usage``: the field is there, null, when the request asked for usage)."""
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [self._choice(index, text, finish, first=first, logprobs=logprobs)]
        if usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage
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
