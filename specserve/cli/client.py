"""`specserve client`: call a running gateway with the prompt and sampling flags of `generate`.

With --json it prints the JSON of `generate --json`. --set-draft NAME=ADDRESS and --list-drafts are the
gateway's admin calls (no prompt needed).
"""

from __future__ import annotations

import argparse
import json
import sys

from specserve.cli.common import add_prompt_arguments
from specserve.errors import SpecserveError


def _named_address(text: str) -> tuple[str, str]:
    name, sep, address = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=ADDRESS (empty ADDRESS removes NAME), got {text!r}")
    return name, address


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", default="127.0.0.1:50051", help="gateway address HOST:PORT or unix:/path")
    add_prompt_arguments(parser)
    # the prompt is required for a generation only; the admin calls below need none (checked in run)
    for group in parser._mutually_exclusive_groups:
        if any(a.dest == "prompt" for a in group._group_actions):
            group.required = False
    parser.add_argument(
        "--draft", default="", help='registered draft name ("none" = target only; default: the gateway\'s)'
    )
    parser.add_argument("--timeout", type=float, default=None, help="request deadline in seconds (default: none)")
    parser.add_argument(
        "--set-draft",
        type=_named_address,
        default=None,
        metavar="NAME=ADDRESS",
        help="point draft NAME at a draft service address (empty address removes it)",
    )
    parser.add_argument(
        "--list-drafts",
        action="store_true",
        help="print the gateway's drafts as JSON (their addresses only with --admin-token)",
    )
    from specserve.cli.service_flags import add_tls_arguments

    add_tls_arguments(parser, side="client")
    parser.add_argument(
        "--auth-token", default=None, help="bearer token the gateway requires (default: $SPECSERVE_AUTH_TOKEN)"
    )
    parser.add_argument(
        "--admin-token",
        default=None,
        help="the gateway's --admin-token, for --set-draft and --list-drafts' addresses "
        "(default: $SPECSERVE_ADMIN_TOKEN)",
    )


def _metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    import os

    token = args.auth_token if args.auth_token is not None else os.environ.get("SPECSERVE_AUTH_TOKEN")
    return (("authorization", f"Bearer {token}"),) if token else ()


def _call(fn, *args, **kw):
    import grpc

    try:
        return fn(*args, **kw)
    except grpc.RpcError as exc:
        raise SpecserveError(f"{exc.code().name}: {exc.details()}") from None


def run(args: argparse.Namespace) -> int:

    from specserve.cli.service_flags import tls_from_args
    from specserve.protos.specserve.v1 import gateway_pb2, gateway_pb2_grpc
    from specserve.runtime.servers_common import sync_channel

    if args.timeout is not None and not args.timeout > 0:
        raise SpecserveError(f"--timeout must be > 0, got {args.timeout}")
    md = _metadata(args)
    import os

    admin = args.admin_token if args.admin_token is not None else os.environ.get("SPECSERVE_ADMIN_TOKEN")
    admin_md = (("specserve-admin-token", admin),) if admin else ()  # SetDraft; ListDrafts' addresses
    with sync_channel(args.gateway, tls_from_args(args)) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        if args.set_draft is not None:
            name, address = args.set_draft
            resp = _call(
                stub.SetDraft,
                gateway_pb2.SetDraftRequest(name=name, address=address),
                timeout=args.timeout,
                metadata=md + admin_md,
            )
            print(json.dumps({"name": resp.name, "address": resp.address}))
            return 0
        if args.list_drafts:
            resp = _call(stub.ListDrafts, gateway_pb2.ListDraftsRequest(), timeout=args.timeout, metadata=md + admin_md)
            print(json.dumps(dict(resp.drafts), sort_keys=True))
            return 0
        if args.prompt is None and args.prompt_ids is None:
            raise SpecserveError("one of --prompt or --prompt-ids is required")
        return _generate(stub, build_request(args), args)


def build_request(args: argparse.Namespace):
    from specserve.cli.common import sampling_from_args, speculative_tokens
    from specserve.protos import convert
    from specserve.protos.specserve.v1 import gateway_pb2

    req = gateway_pb2.GenerateRequest(
        max_new_tokens=args.max_new_tokens,
        sampling=convert.sampling_to_proto(sampling_from_args(args)),
        draft=args.draft,
        num_speculative_tokens=speculative_tokens(args, "client") or 0,  # 0: the gateway's default
        stop=list(args.stop),
        speculation=gateway_pb2.SPECULATION_ADAPTIVE
        if args.speculation == "adaptive"
        else gateway_pb2.SPECULATION_FIXED,
        draft_ahead=args.draft_ahead == "on",
        tree_nodes=args.tree_nodes,
        tree_top_k=args.tree_top_k,
        tree_depth=args.tree_depth,
    )
    if args.prompt_ids is not None:
        req.prompt_ids.extend(args.prompt_ids)
    else:
        req.prompt = args.prompt
    return req


def stats_dict(s) -> dict:
    """The stats of `generate --json` from a SpecStats message."""
    return {
        "steps": s.steps,
        "mean_accepted_length": s.mean_accepted_length,
        "accepted_per_position": list(s.accepted_per_position),
        "tokens_per_s": s.tokens_per_s,
        "ttft_s": s.ttft_s,
        "draft_ms": s.draft_ms,
        "draft_hidden_ms": s.draft_hidden_ms,
        "draft_ahead_hits": s.draft_ahead_hits,
        "chosen_k": dict(sorted(s.chosen_k.items(), key=lambda kv: int(kv[0]))),
        "draft_fallback": s.draft_fallback,
    }


def _generate(stub, req, args: argparse.Namespace) -> int:
    import grpc

    from specserve.cli.common import result_json

    ids: list[int] = []
    final = None
    try:
        for msg in stub.Generate(req, timeout=args.timeout, metadata=_metadata(args)):
            if msg.HasField("final"):
                final = msg.final
                break
            ids.extend(msg.delta.token_ids)
            if not args.json and msg.delta.text:
                print(msg.delta.text, end="", flush=True)
    except grpc.RpcError as exc:
        raise SpecserveError(f"{exc.code().name}: {exc.details()}") from None
    if final is None:
        raise SpecserveError("the gateway ended the stream without a final message")
    stats = stats_dict(final.stats)
    if args.json:
        print(result_json(ids, final.text if final.has_text else None, final.finish_reason, stats))
        return 0
    if final.has_text:
        print(flush=True)  # the completion's newline out before the summary (stdout and stderr may be one pipe)
    else:
        print(",".join(map(str, ids)), flush=True)
    print(
        f"[{len(ids)} tokens, {stats['tokens_per_s']:.1f} tok/s, mean accepted length "
        f"{stats['mean_accepted_length']:.2f}, finish {final.finish_reason}"
        f"{', draft fell back to target-only' if stats['draft_fallback'] else ''}]",
        file=sys.stderr,
    )
    return 0
