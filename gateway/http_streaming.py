"""One HTTP request's generations, streamed: each choice's ``GatewayServicer.generate`` on a task of its own
(``Generation``), server-sent events that stop with the client (``EventStream``), and the waits that end when the
client goes (``until_disconnect``, ``gather_all``). gateway/http_api.py drives them."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
from starlette.responses import Response

from specserve.gateway.server import GatewayError


def sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n".encode()


async def disconnected(receive) -> None:
    """Return once the client has gone (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive, coro):
    """coro's result, or None (coro cancelled) when the client goes first."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    return None if work.cancelled() else work.result()


_END = object()


class Generation:
    """One request's GatewayServicer.generate, iterated by a task of its own (its spans and the OTel
    context they attach stay in one task, as under gRPC); messages reach the HTTP handler through a
    small queue (backpressure). ``close()`` waits for a request whose final message was taken to end
    (it releases its sessions), and cancels one that has not got there (which releases them too)."""

    def __init__(self, messages) -> None:
        self._final_taken = False
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=64)
        self._task = asyncio.get_running_loop().create_task(self._run(messages), name="http-generation")

    async def _run(self, messages) -> None:
        try:
            async with contextlib.aclosing(messages):
                async for msg in messages:
                    await self._queue.put(msg)
            await self._queue.put(_END)
        except GatewayError as exc:
            await self._queue.put(exc)
        except Exception as exc:  # noqa: BLE001 - a bug: the handler answers INTERNAL instead of waiting forever
            await self._queue.put(GatewayError(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"))

    async def next(self):
        """The next GenerateResponse; raises the request's GatewayError."""
        item = await self._queue.get()
        if isinstance(item, GatewayError):
            raise item
        if item is _END:
            raise GatewayError(grpc.StatusCode.INTERNAL, "the request ended without a final message")
        self._final_taken = item.HasField("final")
        return item

    async def close(self) -> None:
        if not self._task.done() and not self._final_taken:
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class EventStream(Response):
    """A server-sent-event response from an async iterator of bytes; a client that disconnects
    cancels it (and with it the request's generations)."""

    def __init__(self, events, generations: list[Generation], headers: dict | None = None) -> None:  # chunked
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        self.raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        self.events = events
        self.generations = generations

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            with contextlib.suppress(OSError):  # the client went away while a chunk was sent
                await until_disconnect(receive, stream())
        finally:
            await self.events.aclose()
            for generation in self.generations:
                await generation.close()


async def gather_all(coros: list):
    """Every coroutine's result, in order; the first to raise cancels the others and raises."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
