"""`specserve target`: the target gRPC service (one engine thread, batched verify steps)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specserve.cli.common import add_engine_arguments, engine_config_from_args, positive_int

DEFAULT_LISTEN = "127.0.0.1:50052"


def add_tls_arguments(parser: argparse.ArgumentParser, prefix: str = "tls", side: str = "server") -> None:
    """--{prefix}-cert/-key/-ca. Server side: CA given = clients must present a certificate it signed."""
    if side == "server":
        helps = ("PEM certificate this service presents (enables TLS)", "PEM private key of --tls-cert",
                 "PEM CA bundle: require and verify client certificates (mutual TLS)")
    else:
        helps = ("PEM client certificate (for servers that require one)", "PEM private key of the client certificate",
                 "PEM CA bundle that signs the server's certificate (enables TLS)")
    for part, text in zip(("cert", "key", "ca"), helps):
        parser.add_argument(f"--{prefix}-{part}", type=Path, default=None, help=text)


def tls_from_args(args: argparse.Namespace, prefix: str = "tls"):
    from specserve.gateway.servers_common import tls_or_none

    p = prefix.replace("-", "_")
    return tls_or_none(getattr(args, f"{p}_cert"), getattr(args, f"{p}_key"), getattr(args, f"{p}_ca"))


def add_listen_arguments(parser: argparse.ArgumentParser, default: str, max_message_bytes: int | None = None) -> None:
    from specserve.gateway.servers_common import MAX_MESSAGE_BYTES

    parser.add_argument(
        "--listen", action="append", default=None,
        help=f"HOST:PORT or unix:/path to listen on (repeatable; default {default}, loopback only)",
    )
    parser.add_argument("--grace-s", type=float, default=10.0, help="seconds in-flight calls get on SIGTERM")
    parser.add_argument("--max-message-bytes", type=positive_int, default=max_message_bytes or MAX_MESSAGE_BYTES,
                        help="largest gRPC message received or sent (bigger: RESOURCE_EXHAUSTED)")
    add_tls_arguments(parser)


def server_config_from_args(args: argparse.Namespace, addresses: tuple[str, ...]):
    from specserve.gateway.servers_common import ServerConfig

    return ServerConfig(addresses=addresses, grace_s=args.grace_s, max_message_bytes=args.max_message_bytes,
                        tls=tls_from_args(args))


def checkpoint_errors_as_user_errors(fn, *args):
    """Run fn; a corrupt or unreadable checkpoint becomes one SpecserveError line naming the file."""
    from specserve.errors import SpecserveError
    from specserve.target_service.models.errors import CheckpointError

    try:
        return fn(*args)
    except CheckpointError as exc:
        raise SpecserveError(f"checkpoint: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_listen_arguments(parser, DEFAULT_LISTEN)
    parser.add_argument("--max-sessions", type=positive_int, default=64,
                        help="open sessions; more Prefills wait in the admission queue")
    parser.add_argument("--max-queued", type=int, default=64,
                        help="Prefills waiting for a session or KV blocks; more get RESOURCE_EXHAUSTED")
    parser.add_argument("--max-draft-tokens", type=positive_int, default=256,
                        help="most tokens (chain or tree nodes) in one verified draft block")


def run(args: argparse.Namespace) -> int:
    from specserve.gateway.servers_common import exit_now, run_async
    from specserve.target_service.server import TargetLimits

    engine_config = engine_config_from_args(args)
    server_config = server_config_from_args(args, tuple(args.listen or [DEFAULT_LISTEN]))
    limits = TargetLimits(max_sessions=args.max_sessions, max_queued=args.max_queued,
                          max_draft_tokens=args.max_draft_tokens)
    checkpoint_errors_as_user_errors(run_async, _serve(engine_config, server_config, args.tensor_parallel_size, limits))
    exit_now(0)
    return 0


async def _serve(engine_config, server_config, tensor_parallel_size: int, limits=None) -> None:
    from specserve.gateway.servers_common import ServiceBinding, serve_until_signal
    from specserve.gateway.tracing import setup_telemetry
    from specserve.protos.specserve.v1 import target_pb2_grpc
    from specserve.target_service.factory import build_engine
    from specserve.target_service.server import SERVICE_NAME, EngineWorker, TargetServicer

    telemetry = setup_telemetry("specserve-target")
    worker = await EngineWorker.build(lambda: build_engine(engine_config), limits=limits)
    worker.start()
    servicer = TargetServicer(worker, model_name=Path(engine_config.model).name, tensor_parallel_size=tensor_parallel_size)

    async def on_stop() -> None:
        await worker.close()
        telemetry.shutdown()

    def on_ready(running) -> None:
        print(f"target listening on {' '.join(running.bound)}", flush=True)

    await serve_until_signal(
        server_config,
        [ServiceBinding(target_pb2_grpc.add_TargetServiceServicer_to_server, servicer, SERVICE_NAME)],
        on_ready=on_ready,
        on_stop=on_stop,
    )
    print("target stopped", file=sys.stderr, flush=True)
