"""`specserve draft`: a draft gRPC service (one drafter thread)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from specserve.cli.common import (
    add_denoise_argument,
    add_listen_arguments,
    checkpoint_errors_as_user_errors,
    metrics_http_from_args,
    positive_int,
    server_config_from_args,
    start_metrics_server,
)

DEFAULT_LISTEN = "127.0.0.1:50053"


def add_drafter_arguments(parser: argparse.ArgumentParser) -> None:
    """The drafter's flags (shared with `serve`, which forwards them)."""
    from specserve.draft_service.registry import PROPOSER_FACTORIES

    parser.add_argument("--draft", choices=tuple(PROPOSER_FACTORIES), default="ngram", help="drafter family")
    parser.add_argument("--draft-model", type=Path, default=None, help="drafter checkpoint folder")
    parser.add_argument("--max-block-size", type=positive_int, default=8, help="most tokens one proposal may draft")
    add_denoise_argument(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_drafter_arguments(parser)
    parser.add_argument("--model", type=Path, default=None, help="the target's checkpoint folder (vocabulary, layers)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_listen_arguments(parser, DEFAULT_LISTEN)
    parser.add_argument("--max-draft-tokens", type=positive_int, default=256,
                        help="most tokens (chain length or tree nodes) one proposal may ask for")


def drafter_config(args: argparse.Namespace):
    from specserve.cli.common import drafter_config_from_args
    from specserve.paths import demo_checkpoint

    target = args.model or demo_checkpoint("target")
    config = drafter_config_from_args(args, target_checkpoint=target)
    return dataclasses.replace(config, max_block_size=args.max_block_size)


def run(args: argparse.Namespace) -> int:
    from specserve.runtime.servers_common import exit_now, run_async

    config = drafter_config(args)
    server_config = server_config_from_args(args, tuple(args.listen or [DEFAULT_LISTEN]))
    checkpoint_errors_as_user_errors(
        run_async, _serve(config, server_config, args.max_draft_tokens, metrics_http_from_args(args))
    )
    exit_now(0)
    return 0


async def _serve(config, server_config, max_draft_tokens: int = 256, metrics_http=None) -> None:
    from specserve.draft_service.registry import build_proposer
    from specserve.draft_service.server import (
        SERVICE_NAME,
        DrafterWorker,
        DraftServicer,
        observe_worker,
    )
    from specserve.protos.specserve.v1 import draft_pb2_grpc
    from specserve.runtime.servers_common import ServiceBinding, serve_until_signal
    from specserve.runtime.tracing import setup_telemetry

    telemetry = setup_telemetry("specserve-draft", prometheus=metrics_http is not None)
    worker = await DrafterWorker.build(lambda: build_proposer(config))
    observe_worker(worker)
    companions = await start_metrics_server(metrics_http, telemetry, "draft")
    servicer = DraftServicer(worker, max_draft_tokens=max_draft_tokens)

    async def on_stop() -> None:
        await worker.close()
        telemetry.shutdown()

    def on_ready(running) -> None:
        print(f"draft ({config.family}) listening on {' '.join(running.bound)}", flush=True)

    await serve_until_signal(
        server_config,
        [ServiceBinding(draft_pb2_grpc.add_DraftServiceServicer_to_server, servicer, SERVICE_NAME)],
        on_ready=on_ready,
        on_stop=on_stop,
        companions=companions,
    )
    print("draft stopped", file=sys.stderr, flush=True)
