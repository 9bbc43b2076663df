"""`specserve gateway`: the front door; runs the spec loop over remote target and draft services."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specserve.errors import SpecserveError


def _named_address(text: str) -> tuple[str, str]:
    name, sep, address = text.partition("=")
    if not sep or not name or not address:
        raise argparse.ArgumentTypeError(f"expected NAME=ADDRESS, got {text!r}")
    return name, address


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target service address (HOST:PORT or unix:/path)")
    parser.add_argument(
        "--draft-service", type=_named_address, action="append", default=[], metavar="NAME=ADDRESS",
        help="a draft service requests can name (repeatable; the first is the default)",
    )
    parser.add_argument("--default-draft", default=None, help="draft name used when a request names none")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder whose tokenizer.json to use")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--listen", action="append", default=[], help="extra HOST:PORT or unix:/path to listen on")
    parser.add_argument("--draft-step-timeout-s", type=float, default=5.0,
                        help="a proposal slower than this drops the draft for that request")
    parser.add_argument("--connect-timeout-s", type=float, default=600.0,
                        help="seconds to wait for the target service at start")
    parser.add_argument("--grace-s", type=float, default=10.0, help="seconds in-flight calls get on SIGTERM")


def run(args: argparse.Namespace) -> int:
    from specserve.gateway.server import GatewayConfig
    from specserve.gateway.servers_common import ServerConfig, exit_now, run_async

    names = [n for n, _ in args.draft_service]
    if len(set(names)) != len(names):
        raise SpecserveError(f"--draft-service names repeat: {names}")
    config = GatewayConfig(
        target_address=args.target,
        drafts=dict(args.draft_service),
        default_draft=args.default_draft,
        draft_step_timeout_s=args.draft_step_timeout_s,
    )
    if not 0 <= args.port <= 65535:
        raise SpecserveError(f"--port must be in [0, 65535], got {args.port}")
    server_config = ServerConfig(addresses=(f"{args.host}:{args.port}", *args.listen), grace_s=args.grace_s)
    tokenizer = None
    if args.model is not None:
        from specserve.target_service.models.loader import load_tokenizer

        if not args.model.is_dir():
            raise SpecserveError(f"--model {args.model} is not a folder")
        tokenizer = load_tokenizer(args.model)
    run_async(_serve(config, server_config, tokenizer, args.connect_timeout_s))
    exit_now(0)
    return 0


async def _serve(config, server_config, tokenizer, connect_timeout_s: float) -> None:
    import grpc

    from specserve.gateway.remote import RemoteTarget
    from specserve.gateway.server import SERVICE_NAME, GatewayServicer
    from specserve.gateway.servers_common import ServiceBinding, serve_until_signal
    from specserve.gateway.tracing import setup_telemetry
    from specserve.protos.specserve.v1 import gateway_pb2_grpc

    telemetry = setup_telemetry("specserve-gateway")
    target = RemoteTarget(config.target_address)
    try:
        await target.fetch_info(connect_timeout_s, wait_for_ready=True)
    except grpc.aio.AioRpcError as exc:
        await target.close()
        raise SpecserveError(f"target service at {config.target_address} not reachable: {exc.code().name}") from None
    servicer = GatewayServicer(config, target, tokenizer)

    async def on_stop() -> None:
        await servicer.close()
        telemetry.shutdown()

    def on_ready(running) -> None:
        print(f"gateway listening on {running.bound[0]}", flush=True)

    await serve_until_signal(
        server_config,
        [ServiceBinding(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer, SERVICE_NAME)],
        on_ready=on_ready,
        on_stop=on_stop,
    )
    print("gateway stopped", file=sys.stderr, flush=True)
