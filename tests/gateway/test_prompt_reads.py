"""A text prompt costs the gateway's event loop one decode of the request's field and no copy to measure it.

Each read of a protobuf string field (``request.prompt``) decodes the message's bytes into a new string
(about 2 ms for 4 MB of non-ASCII text here); ``GatewayServicer.generate`` read it 4 times (its check, the
tokenizer's argument, validation's two), then encoded it once more for the size check. The refusals are
the same as before, to the byte: a prompt that cannot fit is INVALID_ARGUMENT naming its bytes (over gRPC
and HTTP, with real processes: test_hostile_front_door.py)."""

from __future__ import annotations

import asyncio
import tracemalloc

import grpc
import pytest
from opentelemetry import context as otel_context

from specserve.gateway.config import GatewayConfig
from specserve.gateway.remote import RemoteTarget
from specserve.gateway.server import GatewayError, GatewayServicer
from specserve.gateway.validation import InvalidRequest, RequestLimits, check_prompt_bytes
from specserve.protos.specserve.v1 import gateway_pb2, target_pb2

INFO = target_pb2.TargetInfo(vocab_size=256, max_context=512, model_type="qwen3_moe")
BIG = ("def parse_args(argv):\n    return argv[1:]\n" * 100_000)[:4_000_000]  # 4 MB of ASCII text


def _refused(text: str, max_context: int, bytes_per_token: int, size: int) -> bool:
    """Whether check_prompt_bytes refuses the text (whose UTF-8 size is ``size``), naming that size."""
    try:
        check_prompt_bytes(text, target_pb2.TargetInfo(max_context=max_context), RequestLimits(), bytes_per_token)
    except InvalidRequest as exc:
        assert f"prompt: {size} bytes of text cannot fit in {max_context} tokens" in str(exc), str(exc)
        return True
    return False


@pytest.mark.parametrize("char", ["a", "\u00e9", "\u20ac", "\U0001f600", "\ud800"])  # 1, 2, 3, 4, 3 bytes
def test_the_size_check_refuses_exactly_the_texts_over_the_limit_in_bytes(char):
    """Around both bounds (a quarter of the limit in characters, and the limit in bytes), with 0..3 ASCII
    characters before: refused exactly when the UTF-8 bytes (surrogates passed) exceed the limit."""
    tokens, per_token = 25, 8  # 200 bytes
    width = len(char.encode("utf-8", "surrogatepass"))
    for n in {*range(200 // width - 3, 200 // width + 4), *range(47, 54)}:
        for prefix in range(4):
            text = "x" * prefix + char * n
            size = prefix + width * n
            assert size == len(text.encode("utf-8", "surrogatepass"))
            assert _refused(text, tokens, per_token, size) == (size > 200), (char, n, prefix)


@pytest.mark.parametrize(
    "text,max_context,refused",
    [
        (BIG, 1_000, True),  # over the limit
        (BIG, 1_500_000, False),  # within it, but not within a quarter of it in characters
        ("\u00e9" * 1_000_000, 1_500_000, False),  # 2 MB, within a quarter
    ],
    ids=["ascii-refused", "ascii-fits", "non-ascii-fits"],
)
def test_the_size_check_makes_no_copy(text, max_context, refused):
    """An ASCII text, and any text within a quarter of the limit in characters, is measured without
    encoding it (before: a bytes copy of the whole prompt, 2-4 MB here)."""
    size = len(text.encode("utf-8"))
    tracemalloc.start()
    try:
        assert _refused(text, max_context, 8, size) == refused
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak


class ReadCounting:
    """A GenerateRequest whose ``prompt`` reads are counted (every other field is the message's own)."""

    def __init__(self, request: gateway_pb2.GenerateRequest) -> None:
        self.request, self.prompt_reads = request, 0

    def __getattr__(self, name: str):
        if name == "prompt":
            self.prompt_reads += 1
        return getattr(self.request, name)


async def _refusal(tokenizer, request: ReadCounting) -> GatewayError:
    """generate's refusal of a request that is invalid before any service is asked (none runs here)."""
    target = RemoteTarget("unix:/nonexistent/target.sock")
    target.target_info = INFO
    servicer = GatewayServicer(GatewayConfig(target_address=target.address), target, tokenizer)
    try:
        with pytest.raises(GatewayError) as info:
            async for _ in servicer.generate(request, otel_context.get_current()):
                pass
        return info.value
    finally:
        await servicer.close()


@pytest.mark.parametrize(
    "fields,field,says",
    [
        (dict(prompt=BIG, max_new_tokens=4), "prompt", "4000000 bytes of text cannot fit in 512 tokens"),
        (dict(prompt="def f(x):", max_new_tokens=0), "max_new_tokens", "must be positive"),  # after tokenizing
        (dict(prompt="def f(x):", prompt_ids=[1], max_new_tokens=4), "prompt", "not both"),
    ],
)
def test_generate_reads_the_prompt_once(byte_tokenizer, fields, field, says):
    request = ReadCounting(gateway_pb2.GenerateRequest(draft="none", **fields))
    error = asyncio.run(_refusal(byte_tokenizer, request))
    assert (error.code, error.field) == (grpc.StatusCode.INVALID_ARGUMENT, field) and says in str(error), error
    assert request.prompt_reads == 1
