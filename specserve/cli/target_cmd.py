"""`specserve target`: the target gRPC service (one engine thread, batched verify steps)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specserve.cli.common import (
    add_engine_arguments,
    add_threads_argument,
    checkpoint_errors_as_user_errors,
    engine_config_from_args,
    positive_int,
)
from specserve.cli.service_flags import (
    add_listen_arguments,
    metrics_http_from_args,
    server_config_from_args,
    shm_offer_from_args,
    start_metrics_server,
)

DEFAULT_LISTEN = "127.0.0.1:50052"
DRAFT_TOKEN_ENV = "SPECSERVE_DOWNSTREAM_TOKEN"  # the gateway's token for target and drafts: the target's for drafts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_listen_arguments(parser, DEFAULT_LISTEN)
    add_threads_argument(parser)
    parser.add_argument(
        "--max-sessions", type=positive_int, default=64, help="open sessions; more Prefills wait in the admission queue"
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=64,
        help="Prefills waiting for a session or KV blocks; more get RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--max-draft-tokens",
        type=positive_int,
        default=256,
        help="most tokens (chain or tree nodes) in one verified draft block",
    )
    parser.add_argument(
        "--session-idle-timeout-s", type=float, default=300.0, help="release a session no call touched for this long"
    )
    parser.add_argument(
        "--draft-auth-token",
        default=None,
        help="bearer token the target's own step loops (Run) send the draft services a gateway names (their "
        "--auth-token; default: $SPECSERVE_DOWNSTREAM_TOKEN, else the target's own --auth-token: the gateway sends "
        "target and drafts one token)",
    )
    parser.add_argument(
        "--graph-hidden-layers",
        type=_layer_list,
        default=(),
        help="comma-separated target layers whose hidden rows drafters read (EAGLE-3, DFlash): CUDA "
        "graphs are also captured returning them, so those sessions' steps replay graphs too",
    )


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated layer numbers, got {text!r}") from None
    if any(i < 0 for i in layers):
        raise argparse.ArgumentTypeError(f"layer numbers must be >= 0, got {text!r}")
    return layers


def run(args: argparse.Namespace) -> int:
    from specserve.cli.common import apply_threads
    from specserve.runtime.servers_common import exit_now, run_async
    from specserve.target_service.engine_worker import TargetLimits

    apply_threads(args.threads)

    engine_config = engine_config_from_args(args)
    server_config = server_config_from_args(args, tuple(args.listen or [DEFAULT_LISTEN]))
    from specserve.errors import SpecserveError

    try:
        limits = TargetLimits(
            max_sessions=args.max_sessions,
            max_queued=args.max_queued,
            max_draft_tokens=args.max_draft_tokens,
            session_idle_timeout_s=args.session_idle_timeout_s,
        )
    except ValueError as exc:
        raise SpecserveError(f"target limits: {exc}") from None
    metrics_http = metrics_http_from_args(args)
    checkpoint_errors_as_user_errors(
        run_async,
        _serve(
            engine_config,
            server_config,
            args.tensor_parallel_size,
            limits,
            metrics_http,
            shm_offer_from_args(args),
            args.graph_hidden_layers,
            _draft_token(args.draft_auth_token, server_config.auth_token),
        ),
    )
    exit_now(0)
    return 0


def _draft_token(flag: str | None, own: str | None) -> str | None:
    """The token the target's loops send drafts: the flag, the gateway's variable, else the target's own token."""
    if flag is not None:
        return flag
    return os.environ.get(DRAFT_TOKEN_ENV) or own


def _engine_with_graph_layers(engine_config, graph_layers: tuple[int, ...]):
    """The engine, with CUDA graphs that also return `graph_layers` (no-op without graphs)."""
    from specserve.errors import SpecserveError
    from specserve.target_service.engine.session import InvalidInput
    from specserve.target_service.factory import build_engine

    engine = build_engine(engine_config)
    try:
        engine.add_graph_layers(graph_layers)
    except InvalidInput as exc:
        raise SpecserveError(f"--graph-hidden-layers: {exc}") from None
    return engine


def _sized(server_config, info, max_draft_tokens: int):
    """The server's receive limit: the largest honest request at this model's sizes, within --max-message-bytes."""
    import dataclasses

    from specserve.runtime.grpc_guard import target_receive_bytes

    honest = target_receive_bytes(info.vocab_size, info.max_context, max_draft_tokens, info.num_layers)
    return dataclasses.replace(server_config, max_receive_bytes=min(server_config.max_message_bytes, honest))


async def _serve(
    engine_config,
    server_config,
    tensor_parallel_size: int,
    limits=None,
    metrics_http=None,
    shm=None,
    graph_layers: tuple[int, ...] = (),
    draft_token: str | None = None,
) -> None:
    from specserve.runtime.servers_common import ServiceBinding, serve_until_signal
    from specserve.runtime.tracing import setup_telemetry
    from specserve.target_service.engine_worker import EngineWorker, observe_worker
    from specserve.target_service.server import SERVICE_NAME, TargetServicer, add_target_to_server

    telemetry = setup_telemetry("specserve-target", prometheus=metrics_http is not None)
    worker = await EngineWorker.build(lambda: _engine_with_graph_layers(engine_config, graph_layers), limits=limits)
    worker.start()
    observe_worker(worker)
    companions = await start_metrics_server(metrics_http, telemetry, "target")
    servicer = TargetServicer(
        worker,
        model_name=Path(engine_config.model).name,
        tensor_parallel_size=tensor_parallel_size,
        shm=shm,
        draft_token=draft_token,
    )
    server_config = _sized(server_config, servicer.info, worker.limits.max_draft_tokens)

    async def on_stop() -> None:
        await servicer.shm.close()
        await servicer.loop_drafts.close()
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
