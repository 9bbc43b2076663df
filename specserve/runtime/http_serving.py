"""HTTP beside a service's gRPC server, on the same event loop: uvicorn serving a Starlette app.

The gateway serves its OpenAI-compatible API (gateway/http_api.py) this way; the target and draft
services serve only ``GET /metrics`` (``metrics_app``) on their ``--metrics-port``. uvicorn runs on the
running loop (uvloop, the one the grpc.aio server uses) and leaves signals to the service: SIGTERM
stops the gRPC server and the HTTP server together (``serve_until_signal``'s companions), each
draining its in-flight requests for the grace period.

Limits (``HttpConfig``), so that connections cost the service nothing they do not use: a request's
headers and body must arrive within ``read_timeout_s`` of its first byte; a connection that sends nothing
is closed after ``first_request_s`` (408, then the connection closes), an idle keep-alive connection after
``keep_alive_s``; past ``limit_concurrency`` connections or requests a new request gets 503 (uvicorn's own
limit). At most ``max_connections`` are open at once, and connections that have not yet sent an authorized
request (``HttpServer``'s ``authorized``: the gateway's bearer token; without one, any request) hold at most
half of the smaller of the two limits: past either, a new connection closes the oldest such connection that
has no request running (none: the new one is closed as soon as it is accepted). So idle or unauthenticated
sockets never take the places of clients that have shown their token, nor lock out a new client that sends
its request at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass

from specserve.errors import SpecserveError


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    grace_s: float = 10.0  # in-flight requests get this long on stop
    read_timeout_s: float = 30.0  # a request's headers and body, from its first byte
    first_request_s: float = 5.0  # a new connection's first byte
    keep_alive_s: float = 5.0  # an idle keep-alive connection closes after this
    max_connections: int = 1024  # open at once, keep-alive ones included; one more is closed at accept
    limit_concurrency: int = 512  # connections or requests past which a new request gets 503

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SpecserveError(f"HTTP port must be in [0, 65535], got {self.port}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        for name in ("read_timeout_s", "first_request_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise SpecserveError(f"HTTP {name} must be > 0, got {getattr(self, name)}")
        for name in ("max_connections", "limit_concurrency"):
            if getattr(self, name) < 1:
                raise SpecserveError(f"HTTP {name} must be >= 1, got {getattr(self, name)}")


def _bind(host: str, port: int) -> socket.socket:
    """A bound TCP socket (uvicorn listens on it), or one line saying why not."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise SpecserveError(f"cannot listen on http {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SpecserveError(f"cannot listen on http {host}:{port}: {exc}") from None
    return sock


_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def _limited(protocol_class: type, config: HttpConfig, authorized: Callable[[list], bool] | None) -> type:
    """uvicorn's HTTP protocol with a read timeout per request and caps on open connections."""
    unproven: dict = {}  # this server's connections without an authorized request yet, oldest first
    share = max(1, min(config.max_connections, config.limit_concurrency) // 2)

    class Limited(protocol_class):
        _read_timer = None
        _silent = True  # no byte received yet

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            unproven[self] = None
            if (len(unproven) > share or len(self.connections) > config.max_connections) and not self._evict():
                transport.close()  # connection_lost forgets it
                return
            self._arm(min(config.first_request_s, config.read_timeout_s))

        def _evict(self) -> bool:
            """Close the oldest connection without an authorized request and with none running; False: none."""
            for other in unproven:
                cycle = other.cycle
                if other is not self and (cycle is None or cycle.response_complete):
                    other.transport.close()
                    unproven.pop(other, None)
                    return True
            return False

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if self._silent:
                self._silent = False
                self._disarm()
            if self._read_timer is None and (cycle is None or cycle.response_complete):
                self._arm()  # a new request's first bytes
            reading = cycle is not None and cycle.more_body
            super().data_received(data)
            now = self.cycle
            if now is not None and now is not cycle and self in unproven:
                if authorized is None or authorized(now.scope["headers"]):
                    unproven.pop(self, None)
            if now is not None and not now.more_body and (now is not cycle or reading):
                self._disarm()  # its headers and body are in

        def connection_lost(self, exc) -> None:
            unproven.pop(self, None)
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, seconds: float | None = None) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(seconds or config.read_timeout_s, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # no response begun: say why, then close
                self.transport.write(_TIMED_OUT)
            self.transport.close()  # a handler waiting for the body sees the client gone

    return Limited


class HttpServer:
    """uvicorn on the running event loop; ``start()`` returns the bound URL, ``stop()`` drains."""

    def __init__(self, app, config: HttpConfig, authorized: Callable[[list], bool] | None = None) -> None:
        """``authorized(headers)``: whether a request's headers (lower-case byte pairs) show the clients' credential;
        a connection whose request does keeps its place (None: any request does)."""
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the service's own handlers stay in charge of SIGTERM/SIGINT
                yield

        self.config = config

        def uvicorn_config(http="auto") -> uvicorn.Config:
            return uvicorn.Config(
                app,
                log_config=None,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=config.grace_s,
                server_header=False,
                http=http,
                timeout_keep_alive=config.keep_alive_s,
                limit_concurrency=config.limit_concurrency,
            )

        base = uvicorn_config()
        base.load()  # picks the HTTP protocol (h11, or httptools where installed)
        self._server = _Server(uvicorn_config(_limited(base.http_protocol_class, config, authorized)))
        self._task: asyncio.Task | None = None
        self.url = ""

    async def start(self) -> str:
        sock = _bind(self.config.host, self.config.port)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]), name="http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise SpecserveError(f"the HTTP server on {self.url} stopped at start")
            await asyncio.sleep(0.01)
        return self.url

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let open requests finish (grace_s, default the config's), then close."""
        if self._task is None:
            return
        if grace_s is not None:
            self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None


def metrics_response(telemetry):
    """``GET /metrics``: the Prometheus text of the service's OpenTelemetry metrics."""
    from prometheus_client import CONTENT_TYPE_LATEST
    from starlette.responses import Response

    return Response(telemetry.prometheus_text(), headers={"content-type": CONTENT_TYPE_LATEST})


def metrics_app(telemetry):
    """A Starlette app serving only ``GET /metrics`` (the target's and draft's ``--metrics-port``)."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    async def metrics(_request):
        return metrics_response(telemetry)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])
