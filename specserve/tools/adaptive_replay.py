"""Offline replay of chain-length policies on a bench run's steps.jsonl (bench/adaptive_replay.py):

    python -m specserve.tools.adaptive_replay OUT/steps.jsonl --drafter model \\
        --draft-ms 1=5.14,2=8.02,3=10.45,4=14.07 [--steps 250 --seeds 20]
    python -m specserve.tools.adaptive_replay OUT/steps.jsonl --drafter all --draft-ms auto \\
        [--order recorded] [--prompts prose-]
"""

from __future__ import annotations

import argparse
import json
import sys

from specserve.bench.adaptive_replay import ORDERS, run


def _draft_ms(text: str) -> dict[int, float] | None:
    if text == "auto":  # the drafter's own fixed rows
        return None
    try:
        return {int(k): float(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected K=MS,K=MS,..., got {text!r}") from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specserve.tools.adaptive_replay", description=__doc__.splitlines()[0]
    )
    parser.add_argument("steps_jsonl", help="a bench's steps.jsonl (or steps.jsonl.gz)")
    parser.add_argument("--drafter", required=True, help="a drafter's name, or all (every drafter with fixed rows)")
    parser.add_argument(
        "--draft-ms",
        type=_draft_ms,
        required=True,
        help="mean draft ms by k, e.g. 1=5.1,2=8.0, or auto (the median call of the drafter's own fixed rows)",
    )
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--order", choices=ORDERS, default="drawn", help="steps drawn independently, or as recorded")
    parser.add_argument("--prompts", default=None, help="only the prompts whose name starts with this (e.g. prose-)")
    args = parser.parse_args(argv)
    if args.drafter == "all" and args.draft_ms is not None:
        parser.error("--drafter all reads each drafter's draft ms off its rows: give --draft-ms auto")
    try:
        result = run(args.steps_jsonl, args.drafter, args.draft_ms, args.steps, args.seeds, args.order, args.prompts)
    except (OSError, ValueError, KeyError) as e:
        print(f"adaptive_replay: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
