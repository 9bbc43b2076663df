"""`specserve target`: the target gRPC service (one engine thread, batched verify steps)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_LISTEN = "127.0.0.1:50052"


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The target engine's flags (shared with `serve`, which forwards them)."""
    parser.add_argument("--model", type=Path, default=None, help="target checkpoint folder (default: shipped demo)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--tensor-parallel-size", type=_positive_int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--num-kv-blocks", type=_positive_int, default=4096)
    parser.add_argument("--kv-block-size", type=_positive_int, default=16)


def add_listen_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--listen", action="append", default=None,
        help=f"HOST:PORT or unix:/path to listen on (repeatable; default {default})",
    )
    parser.add_argument("--grace-s", type=float, default=10.0, help="seconds in-flight calls get on SIGTERM")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_listen_arguments(parser, DEFAULT_LISTEN)


def run(args: argparse.Namespace) -> int:
    from specserve.gateway.servers_common import ServerConfig, exit_now, run_async
    from specserve.paths import demo_checkpoint
    from specserve.target_service.factory import EngineConfig

    model = args.model or demo_checkpoint("target")
    engine_config = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        num_kv_blocks=args.num_kv_blocks,
        kv_block_size=args.kv_block_size,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
    )
    server_config = ServerConfig(addresses=tuple(args.listen or [DEFAULT_LISTEN]), grace_s=args.grace_s)
    run_async(_serve(engine_config, server_config, args.tensor_parallel_size))
    exit_now(0)
    return 0


async def _serve(engine_config, server_config, tensor_parallel_size: int) -> None:
    from specserve.gateway.servers_common import ServiceBinding, serve_until_signal
    from specserve.gateway.tracing import setup_telemetry
    from specserve.protos.specserve.v1 import target_pb2_grpc
    from specserve.target_service.factory import build_engine
    from specserve.target_service.server import SERVICE_NAME, EngineWorker, TargetServicer

    telemetry = setup_telemetry("specserve-target")
    worker = await EngineWorker.build(lambda: build_engine(engine_config))
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
