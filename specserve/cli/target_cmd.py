"""`specserve target`: the target gRPC service (one engine thread, batched verify steps)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specserve.cli.common import (
    add_engine_arguments,
    add_listen_arguments,
    checkpoint_errors_as_user_errors,
    engine_config_from_args,
    metrics_http_from_args,
    positive_int,
    server_config_from_args,
    shm_offer_from_args,
    start_metrics_server,
)

DEFAULT_LISTEN = "127.0.0.1:50052"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_listen_arguments(parser, DEFAULT_LISTEN)
    parser.add_argument("--max-sessions", type=positive_int, default=64,
                        help="open sessions; more Prefills wait in the admission queue")
    parser.add_argument("--max-queued", type=int, default=64,
                        help="Prefills waiting for a session or KV blocks; more get RESOURCE_EXHAUSTED")
    parser.add_argument("--max-draft-tokens", type=positive_int, default=256,
                        help="most tokens (chain or tree nodes) in one verified draft block")
    parser.add_argument("--session-idle-timeout-s", type=float, default=300.0,
                        help="release a session no call touched for this long")


def run(args: argparse.Namespace) -> int:
    from specserve.runtime.servers_common import exit_now, run_async
    from specserve.target_service.server import TargetLimits

    engine_config = engine_config_from_args(args)
    server_config = server_config_from_args(args, tuple(args.listen or [DEFAULT_LISTEN]))
    from specserve.errors import SpecserveError

    try:
        limits = TargetLimits(max_sessions=args.max_sessions, max_queued=args.max_queued,
                              max_draft_tokens=args.max_draft_tokens, session_idle_timeout_s=args.session_idle_timeout_s)
    except ValueError as exc:
        raise SpecserveError(f"target limits: {exc}") from None
    metrics_http = metrics_http_from_args(args)
    checkpoint_errors_as_user_errors(
        run_async, _serve(engine_config, server_config, args.tensor_parallel_size, limits, metrics_http,
                          shm_offer_from_args(args))
    )
    exit_now(0)
    return 0


async def _serve(
    engine_config, server_config, tensor_parallel_size: int, limits=None, metrics_http=None, shm=None
) -> None:
    from specserve.runtime.servers_common import ServiceBinding, serve_until_signal
    from specserve.runtime.tracing import setup_telemetry
    from specserve.target_service.factory import build_engine
    from specserve.target_service.server import (
        SERVICE_NAME,
        EngineWorker,
        TargetServicer,
        add_target_to_server,
        observe_worker,
    )

    telemetry = setup_telemetry("specserve-target", prometheus=metrics_http is not None)
    worker = await EngineWorker.build(lambda: build_engine(engine_config), limits=limits)
    worker.start()
    observe_worker(worker)
    companions = await start_metrics_server(metrics_http, telemetry, "target")
    servicer = TargetServicer(worker, model_name=Path(engine_config.model).name, tensor_parallel_size=tensor_parallel_size,
                               shm=shm)

    async def on_stop() -> None:
        await servicer.shm.close()
        await worker.close()
        telemetry.shutdown()

    def on_ready(running) -> None:
        print(f"target listening on {' '.join(running.bound)}", flush=True)

    await serve_until_signal(
        server_config,
        [ServiceBinding(add_target_to_server, servicer, SERVICE_NAME)],
        on_ready=on_ready,
        on_stop=on_stop,
        companions=companions,
    )
    print("target stopped", file=sys.stderr, flush=True)
