"""Shared bootstrap of the three gRPC services (target, draft, gateway) and of their clients.

- grpc.aio server on uvloop, bound to TCP (``HOST:PORT``) and/or Unix-domain (``unix:/path``) addresses;
- grpc.health.v1 health (SERVING once bound, NOT_SERVING while draining) and server reflection;
- keepalive that keeps idle long-lived streams open, raised message-size limits (draft probs are MBs);
- what runs before any handler (runtime/grpc_guard.py): the bearer token checked before a request is read, the
  receive limit, connection caps per listen address;
- graceful SIGTERM/SIGINT: stop accepting, let in-flight calls finish within a grace period, then run
  the service's own shutdown (engine thread, tracing flush);
- optional TLS on every listen address (``TlsFiles``): with a CA the server requires and checks the
  client's certificate (mutual TLS); the same ``TlsFiles`` on the client side gives a secure channel
  (CA = the roots to trust; cert + key = the client's certificate for mutual TLS);
- ``lenient_adder`` (``registration``: a service's name and it): a servicer registration under which bytes that do not parse reach no handler
  and get INVALID_ARGUMENT (gRPC alone answers UNKNOWN); ``short`` cuts echoed input in messages
  (status details travel in metadata, limited to 16 KB).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from specserve.errors import SpecserveError
from specserve.runtime.grpc_guard import CLIENT_IDLE_S, BearerAuth, ConnectionLimits

MAX_MESSAGE_BYTES = 512 * 1024 * 1024

# Keepalive: clients ping every 30 s even without calls; servers accept that rate and never count
# pings without data against the peer, so an idle VerifyStream or ProposeStream survives for hours.
_KEEPALIVE_MS = 30_000
_KEEPALIVE_TIMEOUT_MS = 10_000


class AddressError(SpecserveError):
    """A listen or connect address that is neither HOST:PORT nor unix:/path."""


class TlsError(SpecserveError):
    """A TLS flag combination that cannot work, or a certificate / key file that cannot be read."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for one side of a TLS connection.

    Server: cert + key (required); ca -> clients must present a certificate signed by it (mTLS).
    Client: ca -> the roots that sign the server's certificate (None: the system roots);
    cert + key -> the client's own certificate, for servers that require one.
    """

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TlsError("give both a TLS certificate and its key, or neither")
        for path in (self.cert, self.key, self.ca):
            if path is not None and not Path(path).is_file():
                raise TlsError(f"TLS file {path} does not exist")

    @staticmethod
    def _read(path: Path | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise TlsError(f"cannot read TLS file {path}: {exc}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None:
            raise TlsError("a TLS server needs a certificate and key (--tls-cert, --tls-key)")
        ca = self._read(self.ca)
        return grpc.ssl_server_credentials(
            [(self._read(self.key), self._read(self.cert))], root_certificates=ca, require_client_auth=ca is not None
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca),
            private_key=self._read(self.key),
            certificate_chain=self._read(self.cert),
        )


MAX_DETAILS_CHARS = 1000  # of a status message: echoed input is cut to this


def short(text: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """``text`` cut to ``limit`` characters (with the full length said), for messages that echo input."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class MalformedMessage:
    """Request bytes that do not parse (what the lenient deserializer hands on instead of a message)."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.problem = f"request: not a valid {type_name} message ({type(error).__name__}: {str(error)[:200]})"


def _lenient_parse(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception as exc:  # noqa: BLE001 - any decode failure: answered INVALID_ARGUMENT
            return MalformedMessage(message_cls.DESCRIPTOR.full_name, exc)

    return parse


def _checked_unary(fn, streaming_reply: bool):
    if streaming_reply:

        async def handler(request, context):
            if isinstance(request, MalformedMessage):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)
            async with contextlib.aclosing(fn(request, context)) as replies:  # closed here when the call ends
                async for reply in replies:
                    yield reply
    else:

        async def handler(request, context):
            if isinstance(request, MalformedMessage):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)
            return await fn(request, context)

    return handler


def _checked_stream(fn):
    async def handler(request_iterator, context):
        async def requests():
            async for request in request_iterator:
                if isinstance(request, MalformedMessage):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)
                yield request

        async with contextlib.aclosing(fn(requests(), context)) as replies:  # closed here when the call ends
            async for reply in replies:
                yield reply

    return handler


def lenient_adder(service) -> Callable:
    """An ``add_XServicer_to_server(servicer, server)`` for a service descriptor (unary and
    bidi-streaming methods) under which unparseable request bytes get INVALID_ARGUMENT."""

    def add(servicer, server) -> None:
        handlers = {}
        for method in service.methods:
            parse = _lenient_parse(message_factory.GetMessageClass(method.input_type))
            out = message_factory.GetMessageClass(method.output_type).SerializeToString
            fn = getattr(servicer, method.name)
            if method.client_streaming and method.server_streaming:
                handlers[method.name] = grpc.stream_stream_rpc_method_handler(_checked_stream(fn), parse, out)
            elif not method.client_streaming and method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(_checked_unary(fn, True), parse, out)
            elif not method.client_streaming:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(_checked_unary(fn, False), parse, out)
            else:
                raise ValueError(f"{method.full_name}: client-streaming methods are not supported")
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
        server.add_registered_method_handlers(service.full_name, handlers)

    return add


def registration(pb2_module, service: str) -> tuple[str, Callable]:
    """A service's full name (health, reflection) and its ``lenient_adder`` (the servicer's registration)."""
    descriptor = pb2_module.DESCRIPTOR.services_by_name[service]
    return descriptor.full_name, lenient_adder(descriptor)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends for a service started with ``--auth-token token`` (none: ())."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def tls_or_none(cert=None, key=None, ca=None) -> TlsFiles | None:
    """TlsFiles from optional flag values; None when none is set (plaintext)."""
    if cert is None and key is None and ca is None:
        return None
    return TlsFiles(cert=cert, key=key, ca=ca)


def check_address(address: str) -> str:
    """Return address unchanged if it is ``HOST:PORT`` (port 0-65535) or ``unix:PATH``; else raise."""
    if address.startswith("unix:"):
        if len(address) <= len("unix:"):
            raise AddressError(f"address {address!r}: empty unix socket path")
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise AddressError(f"address {address!r}: expected HOST:PORT or unix:/path")
    return address


def check_free(addresses) -> None:
    """Refuse at once (one line, before any model loads) a TCP ``HOST:PORT`` another process listens on; port 0,
    unix sockets and hosts that do not resolve are left to the bind itself."""
    import socket

    for address in addresses:
        if address.startswith("unix:"):
            continue
        host, _, port = check_address(address).rpartition(":")
        if int(port) == 0:
            continue
        host = host.strip("[]")
        try:
            family = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][0]
        except OSError:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
            try:
                probe.bind((host, int(port)))
            except OSError as exc:
                raise AddressError(f"cannot listen on {address}: {exc.strerror or exc}") from None


def _limits_and_keepalive(max_message_bytes: int) -> list[tuple[str, int]]:
    """What server and client must agree on: message limits and keepalive pings."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", _KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES, max_receive_bytes: int | None = None
) -> list[tuple[str, int]]:
    """``max_receive_bytes``: a lower limit on the requests it reads (None: max_message_bytes)."""
    options = _limits_and_keepalive(max_message_bytes)
    if max_receive_bytes is not None:
        options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    return options + [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", _KEEPALIVE_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]


def channel_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES, max_receive_bytes: int | None = None
) -> list[tuple[str, int]]:
    """Client side: the same limits and keepalive, and a short reconnect backoff so that a restarted
    service is used again within about a second. ``max_receive_bytes``: a lower limit on what this
    channel reads (gRPC checks a message's length prefix against it before allocating)."""
    options = _limits_and_keepalive(max_message_bytes)
    if max_receive_bytes is not None:
        options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    return options + [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # transparent retries only (no retry policy is configured): a call that a server's GOAWAY refused unread is
        # sent again on a new connection. Servers close a connection idle for ConnectionLimits.idle_s; a call that
        # starts as that GOAWAY goes out failed UNAVAILABLE without them (1-2 calls in 300 timed at the edge, 0 in
        # 600); the client idle close below keeps this channel's connections from meeting it at all
        ("grpc.enable_retries", 1),
        ("grpc.client_idle_timeout_ms", int(CLIENT_IDLE_S * 1000)),  # before any server's idle close (grpc_guard)
    ]


UNIX_TLS_SERVER_NAME = "localhost"  # a TLS service on a unix socket must present a certificate for this name


def _secure_options(address: str, max_receive_bytes: int | None = None) -> list:
    options = channel_options(max_receive_bytes=max_receive_bytes)
    if address.startswith("unix:"):  # the authority would be the socket path: check the certificate for localhost
        options.append(("grpc.ssl_target_name_override", UNIX_TLS_SERVER_NAME))
    return options


def aio_channel(address: str, tls: TlsFiles | None = None, max_receive_bytes: int | None = None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(
            check_address(address), options=channel_options(max_receive_bytes=max_receive_bytes)
        )
    return grpc.aio.secure_channel(
        check_address(address), tls.channel_credentials(), options=_secure_options(address, max_receive_bytes)
    )


def sync_channel(address: str, tls: TlsFiles | None = None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(check_address(address), options=channel_options())
    return grpc.secure_channel(check_address(address), tls.channel_credentials(), options=_secure_options(address))


@dataclass(frozen=True)
class ServiceBinding:
    """One servicer to register: the generated ``add_XServicer_to_server`` and its full service name."""

    add_to_server: Callable
    servicer: object
    full_name: str  # e.g. target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


@dataclass(frozen=True)
class ServerConfig:
    addresses: tuple[str, ...]
    grace_s: float = 10.0
    max_message_bytes: int = MAX_MESSAGE_BYTES
    tls: TlsFiles | None = None  # None: plaintext
    auth_token: str | None = field(default=None, repr=False)  # None: no bearer token required
    # the largest request read (None: max_message_bytes); the services set their largest honest message's size
    max_receive_bytes: int | None = None
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)  # per listen address
    other_connections: int = 0  # descriptors an HTTP server beside it may hold (out of the listeners' budget)

    def __post_init__(self) -> None:
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("the auth token is empty")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_receive_bytes is not None and not 1024 <= self.max_receive_bytes <= self.max_message_bytes:
            raise ValueError(
                f"max_receive_bytes must be in [1024, {self.max_message_bytes}], got {self.max_receive_bytes}"
            )
        if self.tls is not None and self.tls.cert is None:
            raise TlsError("a TLS server needs a certificate and key (--tls-cert, --tls-key)")
        if not self.addresses:
            raise AddressError("no listen address given")
        for a in self.addresses:
            check_address(a)
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")


class RunningServer:
    """A started server: its bound addresses, health servicer, and a stop() that drains it."""

    def __init__(self, server: grpc.aio.Server, health: HealthServicer, names: Sequence[str], bound: list[str]):
        self.server = server
        self.health = health
        self.names = tuple(names)
        self.bound = bound  # addresses with the real port (port 0 resolved)
        self._stopping = False

    async def stop(self, grace_s: float) -> None:
        if self._stopping:
            return
        self._stopping = True
        for name in ("", *self.names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)


async def start_server(config: ServerConfig, bindings: Sequence[ServiceBinding]) -> RunningServer:
    """Register bindings + health + reflection, bind every address, start, and mark SERVING."""
    interceptors = [BearerAuth(config.auth_token)] if config.auth_token is not None else []
    options = server_options(config.max_message_bytes, config.max_receive_bytes)
    options += config.connections.options(len(config.addresses), config.other_connections)
    server = grpc.aio.server(options=options, interceptors=interceptors)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [b.full_name for b in bindings]
    for b in bindings:
        b.add_to_server(b.servicer, server)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    bound = []
    credentials = config.tls.server_credentials() if config.tls is not None else None
    for address in config.addresses:
        if address.startswith("unix:"):
            path = address[len("unix:") :].removeprefix("//")
            if os.path.exists(path):
                os.unlink(path)  # a stale socket left by a killed process
        try:
            if credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, credentials)
        except RuntimeError as e:
            raise AddressError(f"cannot listen on {address}: {e}") from None
        if address.startswith("unix:"):
            bound.append(address)
        else:
            bound.append(f"{address.rpartition(':')[0]}:{port}")
    await server.start()
    for name in ("", *names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, health, names, bound)


async def serve_until_signal(
    config: ServerConfig,
    bindings: Sequence[ServiceBinding],
    on_ready: Callable[[RunningServer], None] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    companions: Sequence = (),
) -> None:
    """Run a server until SIGTERM/SIGINT, then drain in-flight calls for grace_s and run on_stop.

    ``companions``: started servers beside it on the same loop (an HTTP server: ``stop(grace_s)``), stopped
    together with the gRPC server, before on_stop."""
    running = await start_server(config, bindings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if on_ready is not None:
            on_ready(running)
        await stop.wait()
    finally:
        await asyncio.gather(running.stop(config.grace_s), *(c.stop(config.grace_s) for c in companions))
        if on_stop is not None:
            await on_stop()


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task (None: nothing) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def exit_now(code: int) -> None:
    """End a service process after its graceful shutdown (calls drained, engine closed, traces
    flushed): flush stdio and skip interpreter finalization, which takes seconds once torch is loaded."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_async(main: Awaitable) -> None:
    """Run a coroutine on uvloop (the event loop every specserve service uses)."""
    import uvloop

    uvloop.run(main)
