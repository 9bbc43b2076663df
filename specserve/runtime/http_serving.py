"""HTTP beside a service's gRPC server, on the same event loop: uvicorn serving a Starlette app.

The gateway serves its OpenAI-compatible API (gateway/http_api.py) this way; the target and draft
services serve only ``GET /metrics`` (``metrics_app``) on their ``--metrics-port``. uvicorn runs on the
running loop (uvloop, the one the grpc.aio server uses) and leaves signals to the service: SIGTERM
stops the gRPC server and the HTTP server together (``serve_until_signal``'s companions), each
draining its in-flight requests for the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass

from specserve.errors import SpecserveError


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    grace_s: float = 10.0  # in-flight requests get this long on stop

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SpecserveError(f"HTTP port must be in [0, 65535], got {self.port}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")


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


class HttpServer:
    """uvicorn on the running event loop; ``start()`` returns the bound URL, ``stop()`` drains."""

    def __init__(self, app, config: HttpConfig) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the service's own handlers stay in charge of SIGTERM/SIGINT
                yield

        self.config = config
        self._server = _Server(
            uvicorn.Config(
                app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                timeout_graceful_shutdown=config.grace_s, server_header=False,
            )
        )
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
