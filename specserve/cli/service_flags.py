"""Flags of the commands that serve (target, draft, gateway, serve): where a service listens, its TLS, tokens and
/metrics port, the shared-memory data plane's offer, the gateway's request limits and its HTTP API's connection
limits; and the configs they make. The client's TLS flags are here too (add_tls_arguments, side="client")."""

from __future__ import annotations

import argparse
from pathlib import Path

from specserve.cli.common import positive_int
from specserve.errors import SpecserveError


def add_tls_arguments(parser: argparse.ArgumentParser, prefix: str = "tls", side: str = "server") -> None:
    """--{prefix}-cert/-key/-ca. Server side: CA given = clients must present a certificate it signed."""
    if side == "server":
        helps = (
            "PEM certificate this service presents (enables TLS)",
            "PEM private key of --tls-cert",
            "PEM CA bundle: require and verify client certificates (mutual TLS)",
        )
    else:
        helps = (
            "PEM client certificate (for servers that require one)",
            "PEM private key of the client certificate",
            "PEM CA bundle that signs the server's certificate (enables TLS)",
        )
    for part, text in zip(("cert", "key", "ca"), helps):
        parser.add_argument(f"--{prefix}-{part}", type=Path, default=None, help=text)


def tls_from_args(args: argparse.Namespace, prefix: str = "tls"):
    from specserve.runtime.servers_common import tls_or_none

    p = prefix.replace("-", "_")
    return tls_or_none(getattr(args, f"{p}_cert"), getattr(args, f"{p}_key"), getattr(args, f"{p}_ca"))


def add_listen_arguments(parser: argparse.ArgumentParser, default: str, max_message_bytes: int | None = None) -> None:
    from specserve.runtime.servers_common import MAX_MESSAGE_BYTES

    parser.add_argument(
        "--listen",
        action="append",
        default=None,
        help=f"HOST:PORT or unix:/path to listen on (repeatable; default {default}, loopback only)",
    )
    parser.add_argument("--grace-s", type=float, default=10.0, help="seconds in-flight calls get on SIGTERM")
    parser.add_argument(
        "--max-message-bytes",
        type=positive_int,
        default=max_message_bytes or MAX_MESSAGE_BYTES,
        help="largest gRPC message received or sent (bigger: RESOURCE_EXHAUSTED)",
    )
    add_tls_arguments(parser)
    parser.add_argument(
        "--auth-token",
        default=None,
        help=f"require 'authorization: Bearer TOKEN' on every call but health (default: ${SERVICE_TOKEN_ENV}; "
        "the gateway sends it with --downstream-auth-token)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve GET /metrics (Prometheus text) on 127.0.0.1 at this port (0 = any; default: off)",
    )
    parser.add_argument(
        "--no-shm",
        action="store_true",
        help="never offer a caller on this host the shared-memory data plane: every step over gRPC "
        "(also SPECSERVE_SHM=0)",
    )
    parser.add_argument(
        "--no-hidden-share",
        action="store_true",
        help="never keep (target) or map (draft) a session's hidden rows in a shared buffer: they go "
        "as bytes (also SPECSERVE_HIDDEN_SHARE=0)",
    )
    parser.add_argument(
        "--shm-abandon-s",
        type=float,
        default=30.0,
        help="a caller offered a shared-memory channel that neither attaches nor steps over gRPC "
        "within this many seconds is taken for gone and its session released",
    )


SERVICE_TOKEN_ENV = "SPECSERVE_SERVICE_TOKEN"


def metrics_http_from_args(args: argparse.Namespace):
    """The HttpConfig of --metrics-port (loopback), or None when it is off."""
    if args.metrics_port is None:
        return None
    from specserve.runtime.http_serving import HttpConfig

    if not 0 <= args.metrics_port <= 65535:
        raise SpecserveError(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    return HttpConfig(host="127.0.0.1", port=args.metrics_port, grace_s=0.0)


async def start_metrics_server(http, telemetry, role: str) -> list:
    """Start the /metrics server of a target or draft service (none without --metrics-port); returns
    the companions list for serve_until_signal."""
    if http is None:
        return []
    from specserve.runtime.http_serving import HttpServer, metrics_app

    server = HttpServer(metrics_app(telemetry), http)
    print(f"{role} metrics on {await server.start()}/metrics", flush=True)
    return [server]


def server_config_from_args(args: argparse.Namespace, addresses: tuple[str, ...]):
    import os

    from specserve.runtime.servers_common import ServerConfig, check_free

    token = args.auth_token if args.auth_token is not None else os.environ.get(SERVICE_TOKEN_ENV) or None
    config = ServerConfig(
        addresses=addresses,
        grace_s=args.grace_s,
        max_message_bytes=args.max_message_bytes,
        tls=tls_from_args(args),
        auth_token=token,
    )
    metrics = () if getattr(args, "metrics_port", None) is None else (f"127.0.0.1:{args.metrics_port}",)
    check_free((*addresses, *metrics))  # a busy port: one line now, not after the model loaded
    return config


_HTTP_LIMITS = (  # flag, HttpConfig field, type, help
    (
        "--http-read-timeout-s",
        "read_timeout_s",
        float,
        "a request's headers and body must arrive within this (408, closed)",
    ),
    ("--http-first-request-s", "first_request_s", float, "a new connection that sends nothing for this long is closed"),
    ("--http-keep-alive-s", "keep_alive_s", float, "an idle keep-alive connection closes after this"),
    ("--http-max-connections", "max_connections", int, "open HTTP connections at most; one more is closed at once"),
    ("--http-limit-concurrency", "limit_concurrency", int, "connections or requests past which a request gets 503"),
)


def add_request_limit_arguments(limits) -> None:
    """The gateway's request limits (gateway and serve), on an argument group."""
    limits.add_argument("--max-sessions", type=positive_int, default=64, help="requests running at once")
    limits.add_argument(
        "--max-queued", type=int, default=64, help="requests waiting for a running slot; more get RESOURCE_EXHAUSTED"
    )
    limits.add_argument("--max-prompt-tokens", type=int, default=0, help="prompt tokens (0 = the model's context)")
    limits.add_argument("--max-output-tokens", type=positive_int, default=4096, help="max_new_tokens of a request")


def add_http_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP API's connection limits (runtime/http_serving.HttpConfig's defaults)."""
    from specserve.runtime.http_serving import HttpConfig

    for flag, name, kind, text in _HTTP_LIMITS:
        default = getattr(HttpConfig, name)
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")


def http_limit_argv(args: argparse.Namespace) -> list[str]:
    """The same flags for a child process (serve -> gateway)."""
    return [a for flag, _, _, _ in _HTTP_LIMITS for a in (flag, str(getattr(args, _dest(flag))))]


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def http_config_from_args(args: argparse.Namespace, host: str, port: int, grace_s: float):
    from specserve.runtime.http_serving import HttpConfig

    try:
        return HttpConfig(
            host=host,
            port=port,
            grace_s=grace_s,
            **{name: getattr(args, _dest(flag)) for flag, name, _, _ in _HTTP_LIMITS},
        )
    except ValueError as exc:
        raise SpecserveError(str(exc)) from None


def shm_offer_from_args(args: argparse.Namespace):
    """The service's shared-memory offer (--no-shm / SPECSERVE_SHM=0: none; --no-hidden-share /
    SPECSERVE_HIDDEN_SHARE=0: no hidden-row buffers)."""
    import os

    from specserve.runtime.data_plane import ShmOffer, session_ring, shm_allowed
    from specserve.runtime.hidden_share import hidden_share_allowed

    if not args.shm_abandon_s > 0:
        raise SpecserveError(f"--shm-abandon-s must be > 0, got {args.shm_abandon_s}")

    return ShmOffer(
        enabled=shm_allowed(args.no_shm, os.environ),
        hidden_share=hidden_share_allowed(args.no_hidden_share, os.environ),
        ring=session_ring(args.max_message_bytes),  # a step's request: the gRPC stream's limit
        attach_timeout_s=min(ShmOffer.attach_timeout_s, args.shm_abandon_s),
        abandon_s=args.shm_abandon_s,
    )
