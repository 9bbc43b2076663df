"""A gRPC service in-process on its own event-loop thread, as its `specserve` process runs it, with a
blocking client channel to it (tests drive it over a real unix socket)."""

from __future__ import annotations

import asyncio
import threading

import grpc

from specserve.runtime.servers_common import (
    ServerConfig,
    ServiceBinding,
    channel_options,
    start_server,
)


class InProcessServer:
    """Subclasses build their worker and its binding in ``_build``; ``call_timeout_s`` bounds each
    call made on the loop (start-up has its own ``start_timeout_s``)."""

    call_timeout_s = 60.0

    def __init__(self, address: str, stub_class, start_timeout_s: float | None = None) -> None:
        self.address = address
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.running = self._do(self._start(), start_timeout_s)
        self.channel = grpc.insecure_channel(address, options=channel_options())
        self.stub = stub_class(self.channel)

    async def _build(self) -> tuple[object, ServiceBinding]:  # (worker with an async close(), binding)
        raise NotImplementedError

    async def _start(self):
        self.worker, binding = await self._build()
        return await start_server(ServerConfig((self.address,)), [binding])

    def _do(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout or self.call_timeout_s)

    def close(self) -> None:
        self.channel.close()
        self._do(self.running.stop(5))
        self._do(self.worker.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


def assert_unparseable_bytes_refused(channel, service: str, unary_methods: tuple[str, ...], stream_method: str) -> None:
    """Bytes that are no request get INVALID_ARGUMENT (gRPC alone says UNKNOWN) on each unary method and on
    the stream of ``service`` (its full name)."""
    import pytest

    for method in unary_methods:
        call = channel.unary_unary(f"/{service}/{method}")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.details())
    stream = channel.stream_stream(f"/{service}/{stream_method}")
    with pytest.raises(grpc.RpcError) as info:
        list(stream(iter([b"\xff\xff\xff"]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
