"""`specserve draft`: a draft gRPC service (one drafter thread)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from specserve.cli.common import (
    add_denoise_argument,
    add_threads_argument,
    checkpoint_errors_as_user_errors,
    device_arg,
    positive_int,
)
from specserve.cli.service_flags import (
    add_listen_arguments,
    metrics_http_from_args,
    server_config_from_args,
    shm_offer_from_args,
    start_metrics_server,
)
from specserve.contract.speculation import DEFAULT_MAX_BLOCK_SIZE

DEFAULT_LISTEN = "127.0.0.1:50053"


def add_drafter_arguments(parser: argparse.ArgumentParser) -> None:
    """The drafter's flags (shared with `serve`, which forwards them)."""
    from specserve.draft_service.registry import PROPOSER_FACTORIES

    parser.add_argument("--draft", choices=tuple(PROPOSER_FACTORIES), default="ngram", help="drafter family")
    parser.add_argument("--draft-model", type=Path, default=None, help="drafter checkpoint folder")
    parser.add_argument(
        "--max-block-size", type=positive_int, default=DEFAULT_MAX_BLOCK_SIZE, help="most tokens one proposal may draft"
    )
    add_denoise_argument(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_drafter_arguments(parser)
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="the target: its checkpoint folder or demo@NAME[:LAYERS] (vocabulary, layers; default: the shipped demo)",
    )
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_listen_arguments(parser, DEFAULT_LISTEN)
    add_threads_argument(parser)
    parser.add_argument(
        "--max-draft-tokens",
        type=positive_int,
        default=256,
        help="most tokens (chain length or tree nodes) one proposal may ask for",
    )
    parser.add_argument("--max-tree-top-k", type=positive_int, default=16, help="most children per tree node")
    parser.add_argument(
        "--max-sessions", type=positive_int, default=64, help="open sessions; more StartSessions get RESOURCE_EXHAUSTED"
    )
    parser.add_argument(
        "--max-total-tokens",
        type=positive_int,
        default=262144,
        help="tokens held over all sessions (bounds the drafter's memory)",
    )
    parser.add_argument(
        "--session-idle-timeout-s", type=float, default=300.0, help="release a session no call touched for this long"
    )
    parser.add_argument(
        "--shm-spin-us",
        type=_spin_us,
        default=None,
        help="woken through shared memory: spin this long on a lone session's ring for its next request before "
        "blocking on the doorbell (default: 20 on hosts with >= 8 CPUs, 0 on fewer)",
    )
    parser.add_argument(
        "--propose-budget-s",
        type=float,
        default=5.0,
        help="a proposal still waiting for the drafter after this long is dropped (DEADLINE_EXCEEDED)",
    )


def drafter_config(args: argparse.Namespace):
    from specserve.cli.common import drafter_config_from_args, model_name

    target = Path(model_name(args.model).name)
    config = drafter_config_from_args(args, target_checkpoint=target)
    return dataclasses.replace(config, max_block_size=args.max_block_size)


def _spin_us(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected microseconds, got {text!r}") from None
    if not 0 <= value < 1e9:
        raise argparse.ArgumentTypeError(f"must be >= 0 microseconds (and finite), got {text}")
    return value


def drafter_shm_offer(args: argparse.Namespace):
    """The shared-memory offer, its session channels spinning --shm-spin-us for the next request (issue #42)."""
    from specserve.runtime.shm_layout import default_spin_us

    spin = default_spin_us() if args.shm_spin_us is None else args.shm_spin_us
    offer = shm_offer_from_args(args)
    return dataclasses.replace(offer, ring=dataclasses.replace(offer.ring, spin_us=spin))


def run(args: argparse.Namespace) -> int:
    from specserve.cli.common import apply_threads
    from specserve.runtime.servers_common import exit_now, run_async

    apply_threads(args.threads)

    offer = drafter_shm_offer(args)
    config = drafter_config(args)
    server_config = server_config_from_args(args, tuple(args.listen or [DEFAULT_LISTEN]))
    limits = draft_limits(args)
    checkpoint_errors_as_user_errors(
        run_async, _serve(config, server_config, limits, metrics_http_from_args(args), offer)
    )
    exit_now(0)
    return 0


def draft_limits(args: argparse.Namespace):
    from specserve.draft_service.drafter_worker import DraftLimits
    from specserve.errors import SpecserveError

    try:
        return DraftLimits(
            max_sessions=args.max_sessions,
            max_total_tokens=args.max_total_tokens,
            session_idle_timeout_s=args.session_idle_timeout_s,
            max_draft_tokens=args.max_draft_tokens,
            max_tree_top_k=args.max_tree_top_k,
            propose_budget_s=args.propose_budget_s,
        )
    except ValueError as exc:
        raise SpecserveError(f"draft limits: {exc}") from None


def _sized(server_config, worker, needs_hidden: bool):
    """The server's receive limit: the largest honest request at this drafter's sizes, within --max-message-bytes."""
    import dataclasses

    from specserve.runtime.grpc_guard import draft_receive_bytes

    honest = draft_receive_bytes(worker.limits.max_total_tokens, worker.proposer.hidden_width(), needs_hidden)
    if honest is None:
        return server_config
    return dataclasses.replace(server_config, max_receive_bytes=min(server_config.max_message_bytes, honest))


async def _serve(config, server_config, limits=None, metrics_http=None, shm=None) -> None:
    from specserve.draft_service.drafter_worker import DrafterWorker, observe_worker
    from specserve.draft_service.registry import build_proposer
    from specserve.draft_service.server import SERVICE_NAME, DraftServicer, add_draft_to_server
    from specserve.runtime.servers_common import ServiceBinding, serve_until_signal
    from specserve.runtime.tracing import setup_telemetry

    telemetry = setup_telemetry("specserve-draft", prometheus=metrics_http is not None)
    worker = await DrafterWorker.build(lambda: build_proposer(config), limits=limits)
    worker.start_expiry()
    observe_worker(worker)
    companions = await start_metrics_server(metrics_http, telemetry, "draft")
    servicer = DraftServicer(worker, shm=shm)
    server_config = _sized(server_config, worker, servicer.info.needs_hidden_states)

    async def on_stop() -> None:
        await servicer.shm.close()
        await worker.close()
        telemetry.shutdown()

    def on_ready(running) -> None:
        print(f"draft ({config.family}) listening on {' '.join(running.bound)}", flush=True)

    await serve_until_signal(
        server_config,
        [ServiceBinding(add_draft_to_server, servicer, SERVICE_NAME)],
        on_ready=on_ready,
        on_stop=on_stop,
        companions=companions,
    )
    print("draft stopped", file=sys.stderr, flush=True)
