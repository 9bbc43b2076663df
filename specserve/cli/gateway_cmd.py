"""`specserve gateway`: the front door; runs the spec loop over remote target and draft services."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specserve.cli.common import add_threads_argument, checkpoint_errors_as_user_errors, positive_int
from specserve.cli.service_flags import (
    add_http_limit_arguments,
    add_request_limit_arguments,
    add_tls_arguments,
    http_config_from_args,
    tls_from_args,
)
from specserve.errors import SpecserveError

AUTH_ENV = "SPECSERVE_AUTH_TOKEN"
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # requests are prompts: a few MB is plenty
DRAFT_CHECK_TIMEOUT_S = 5.0
HTTP_READY = "gateway http listening on "  # printed (with the URL) just before the gRPC ready line


def _named_address(text: str) -> tuple[str, str]:
    name, sep, address = text.partition("=")
    if not sep or not name or not address:
        raise argparse.ArgumentTypeError(f"expected NAME=ADDRESS, got {text!r}")
    return name, address


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target service address (HOST:PORT or unix:/path)")
    parser.add_argument(
        "--draft-service",
        type=_named_address,
        action="append",
        default=[],
        metavar="NAME=ADDRESS",
        help="a draft service requests can name (repeatable; the first is the default)",
    )
    parser.add_argument("--default-draft", default=None, help="draft name used when a request names none")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="the target's checkpoint folder or demo@NAME[:LAYERS]: whose tokenizer.json to use",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in responses and the HTTP API's model field (default: the target's "
        "checkpoint folder name)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--listen", action="append", default=[], help="extra HOST:PORT or unix:/path to listen on")
    add_threads_argument(parser)
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API and /metrics on --host at this port "
        "(0 = any free port; default: off)",
    )
    add_http_limit_arguments(parser)
    parser.add_argument(
        "--metrics-interval-s",
        type=float,
        default=5.0,
        help="GET /metrics asks the target and drafts for their state at most once this often (0: at "
        "each scrape; scrapes at once still share one ask)",
    )
    parser.add_argument(
        "--draft-step-timeout-s",
        type=float,
        default=5.0,
        help="a proposal slower than this drops the draft for that request",
    )
    parser.add_argument(
        "--draft-breaker-failures",
        type=positive_int,
        default=3,
        help="draft timeouts in a row after which a draft is not asked (probed each second) until it answers",
    )
    parser.add_argument(
        "--connect-timeout-s", type=float, default=600.0, help="seconds to wait for the target service at start"
    )
    parser.add_argument("--grace-s", type=float, default=10.0, help="seconds in-flight calls get on SIGTERM")
    parser.add_argument(
        "--no-shm",
        action="store_true",
        help="every verify / propose step over gRPC, never the shared-memory data plane with services "
        "on this host (also SPECSERVE_SHM=0)",
    )
    parser.add_argument(
        "--no-target-loop",
        action="store_true",
        help="drive every request's steps from the gateway (Prefill, VerifyStream, ProposeStream), even with a "
        "target that runs the step loop itself (its Run call, the default; also SPECSERVE_TARGET_LOOP=0)",
    )
    parser.add_argument(
        "--no-hidden-share",
        action="store_true",
        help="EAGLE-3 / DFlash hidden rows as bytes through the gateway, never a target buffer the "
        "draft maps (also SPECSERVE_HIDDEN_SHARE=0)",
    )
    limits = parser.add_argument_group("limits (beyond them: INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the limit)")
    add_request_limit_arguments(limits)
    limits.add_argument("--max-stop-strings", type=int, default=16, help="stop strings per request")
    limits.add_argument("--max-stop-length", type=int, default=256, help="characters per stop string")
    limits.add_argument(
        "--max-message-bytes",
        type=positive_int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest request message (bigger: RESOURCE_EXHAUSTED from gRPC)",
    )
    security = parser.add_argument_group("security")
    add_tls_arguments(security)
    add_tls_arguments(security, prefix="downstream-tls", side="client")
    security.add_argument(
        "--auth-token", default=None, help=f"require 'authorization: Bearer TOKEN' on every call (default: ${AUTH_ENV})"
    )
    security.add_argument(
        "--downstream-auth-token",
        default=None,
        help="bearer token sent to the target and draft services (their --auth-token; "
        "default: $SPECSERVE_DOWNSTREAM_TOKEN)",
    )
    security.add_argument(
        "--admin-token",
        default=None,
        help="allow SetDraft for calls carrying the metadata 'specserve-admin-token: TOKEN' (a "
        "credential apart from --auth-token; default: $SPECSERVE_ADMIN_TOKEN; unset: SetDraft off)",
    )
    security.add_argument(
        "--trust-draft-probs",
        action="append",
        default=[],
        metavar="NAME",
        help="verify this --draft-service with its probabilities q (more accepted tokens under "
        "sampling; lossless only if the drafter is honest). Others: proposal-only (repeatable)",
    )


TARGET_LOOP_ENV = "SPECSERVE_TARGET_LOOP"  # "0": the gateway drives every step (flag: --no-target-loop)


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def _flag_or_env(value: str | None, env: str) -> str | None:
    return value if value is not None else os.environ.get(env) or None


def run(args: argparse.Namespace) -> int:
    from specserve.cli.common import apply_threads

    apply_threads(args.threads)
    from specserve.gateway.config import GatewayConfig
    from specserve.gateway.validation import RequestLimits
    from specserve.loop.remote_draft import BreakerConfig
    from specserve.runtime.data_plane import shm_allowed
    from specserve.runtime.hidden_share import hidden_share_allowed
    from specserve.runtime.servers_common import ServerConfig, exit_now, run_async

    names = [n for n, _ in args.draft_service]
    if len(set(names)) != len(names):
        raise SpecserveError(f"--draft-service names repeat: {names}")
    config = GatewayConfig(
        target_address=args.target,
        drafts=dict(args.draft_service),
        default_draft=args.default_draft,
        draft_step_timeout_s=args.draft_step_timeout_s,
        max_sessions=args.max_sessions,
        max_queued=args.max_queued,
        limits=RequestLimits(
            max_prompt_tokens=args.max_prompt_tokens,
            max_new_tokens=args.max_output_tokens,
            max_stop_strings=args.max_stop_strings,
            max_stop_length=args.max_stop_length,
        ),
        auth_token=args.auth_token if args.auth_token is not None else os.environ.get(AUTH_ENV) or None,
        downstream_tls=tls_from_args(args, "downstream-tls"),
        trusted_drafts=frozenset(args.trust_draft_probs),
        draft_breaker=BreakerConfig(failures=args.draft_breaker_failures),
        downstream_token=_flag_or_env(args.downstream_auth_token, "SPECSERVE_DOWNSTREAM_TOKEN"),
        admin_token=_flag_or_env(args.admin_token, "SPECSERVE_ADMIN_TOKEN"),
        shm=shm_allowed(args.no_shm, os.environ),
        target_loop=not args.no_target_loop and _env_on(TARGET_LOOP_ENV),
        hidden_share=hidden_share_allowed(args.no_hidden_share, os.environ),
        served_model_name=args.served_model_name,
    )
    for flag, port in (("--port", args.port), ("--http-port", args.http_port)):
        if port is not None and not 0 <= port <= 65535:
            raise SpecserveError(f"{flag} must be in [0, 65535], got {port}")
    from specserve.runtime.servers_common import check_free

    check_free(
        (
            f"{args.host}:{args.port}",
            *args.listen,
            *([f"{args.host}:{args.http_port}"] if args.http_port is not None else []),
        )
    )
    server_config = ServerConfig(
        addresses=(f"{args.host}:{args.port}", *args.listen),
        grace_s=args.grace_s,
        max_message_bytes=args.max_message_bytes,
        tls=tls_from_args(args),
        auth_token=config.auth_token,  # checked before a request is read (the servicer checks it again)
        other_connections=args.http_max_connections if args.http_port is not None else 0,
    )
    tokenizer = chat_template = http = None
    if args.model is not None:
        from specserve.cli.common import model_name
        from specserve.gateway.chat_template import load_chat_template
        from specserve.models.loader import load_tokenizer

        folder = model_name(args.model).tokenizer_folder  # a demo@ model: the demo's tokenizer
        if folder is not None:
            tokenizer = checkpoint_errors_as_user_errors(load_tokenizer, folder)
            chat_template = load_chat_template(folder)
    if args.http_port is not None:
        http = http_config_from_args(args, args.host, args.http_port, args.grace_s)
    if not args.metrics_interval_s >= 0:
        raise SpecserveError(f"--metrics-interval-s must be >= 0, got {args.metrics_interval_s}")
    run_async(
        _serve(config, server_config, tokenizer, args.connect_timeout_s, http, chat_template, args.metrics_interval_s)
    )
    exit_now(0)
    return 0


async def _serve(
    config,
    server_config,
    tokenizer,
    connect_timeout_s: float,
    http=None,
    chat_template=None,
    metrics_interval_s: float = 5.0,
) -> None:
    import grpc

    from specserve.gateway.grpc_handlers import SERVICE_NAME, add_gateway_to_server
    from specserve.gateway.remote import RemoteTarget
    from specserve.gateway.server import GatewayServicer
    from specserve.runtime.servers_common import ServiceBinding, serve_until_signal
    from specserve.runtime.tracing import setup_telemetry

    telemetry = setup_telemetry("specserve-gateway", prometheus=http is not None)
    target = RemoteTarget(config.target_address, config.downstream_tls, config.downstream_token, shm=config.shm)
    try:
        await target.fetch_info(connect_timeout_s, wait_for_ready=True)
    except grpc.aio.AioRpcError as exc:
        await target.close()
        raise SpecserveError(
            f"target service at {config.target_address} not reachable: {exc.code().name}: {exc.details()}"
        ) from None
    servicer = GatewayServicer(config, target, tokenizer)
    servicer.observe()
    telemetry.zero_sources.append(servicer.metrics.zero_series)  # its histograms on /metrics from the start
    try:
        await _check_drafts(servicer)
    except SpecserveError:
        await servicer.close()
        raise

    companions = []
    if http is not None:  # the HTTP API, on this event loop, over the same servicer
        from specserve.gateway.http_api import HttpApi
        from specserve.runtime.http_serving import HttpServer

        api = HttpApi(servicer, telemetry, chat_template, server_config.max_message_bytes, metrics_interval_s)
        http_server = HttpServer(api.app(), http, authorized=api.authorized)
        try:
            await http_server.start()
        except SpecserveError:
            await servicer.close()
            raise
        companions.append(http_server)

    async def on_stop() -> None:
        await servicer.close()
        telemetry.shutdown()

    def on_ready(running) -> None:
        for server in companions:
            print(f"{HTTP_READY}{server.url}", flush=True)
        print(f"gateway listening on {running.bound[0]}", flush=True)

    await serve_until_signal(
        server_config,
        [ServiceBinding(add_gateway_to_server, servicer, SERVICE_NAME)],
        on_ready=on_ready,
        on_stop=on_stop,
        companions=companions,
    )
    print("gateway stopped", file=sys.stderr, flush=True)


async def _check_drafts(servicer) -> None:
    """Refuse to start with a draft service built for another vocabulary; a draft that does not answer
    yet is only reported (requests go target-only until it does)."""
    import grpc

    from specserve.loop.remote_draft import incompatible

    for name in list(servicer.drafts.addresses()):
        ep = servicer.drafts.acquire(name)
        try:
            info = await ep.fetch_info(DRAFT_CHECK_TIMEOUT_S, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            print(
                f"gateway: draft {name} at {ep.address} not reachable yet ({exc.code().name}); "
                "requests go target-only until it is",
                file=sys.stderr,
                flush=True,
            )
            continue
        finally:
            servicer.drafts.release(ep)
        problem = incompatible(info, servicer.target.target_info)
        if problem:
            raise SpecserveError(f"--draft-service {name}={ep.address}: {problem}")
