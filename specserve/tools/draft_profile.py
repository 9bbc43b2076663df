"""Where a drafter's time goes (bench/draft_profile.py: what it measures):

    python -m specserve.tools.draft_profile [--model demo|demo@NAME|DIR] [--drafters eagle3,model,dflash,ngram,mtp]

(`specserve bench draft` is the same with the bench's summary.json.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from specserve.bench import draft_profile


def _tree_spec(text: str):
    from specserve.contract.types import TreeSpec

    try:
        return TreeSpec(*(int(x) for x in text.split(",")))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"want NUM_NODES,TOP_K,DEPTH (positive integers), got {text!r}: {e}") from e


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specserve.tools.draft_profile", description=draft_profile.__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model",
        default="demo",
        help="the target: demo (the shipped demo), demo@NAME[:LAYERS] (the demo at a published shape, its "
        "drafters scaled to it) or a checkpoint folder",
    )
    p.add_argument(
        "--drafters",
        default=",".join(draft_profile.DEFAULT_DRAFTERS),
        help=f"comma-separated, of {', '.join(draft_profile.DRAFTERS)}",
    )
    p.add_argument("--k", type=int, default=4, help="drafted tokens per propose")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", default="bfloat16" if torch.cuda.is_available() else "float32", choices=("float32", "bfloat16")
    )
    p.add_argument("--top", type=int, default=15, help="host functions listed per drafter")
    p.add_argument(
        "--tree",
        type=_tree_spec,
        default=None,
        metavar="NUM_NODES,TOP_K,DEPTH",
        help="propose EAGLE-2 trees of this shape instead of chains (drafters that draft trees)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the rows here (JSON)")
    args = p.parse_args(argv)
    try:
        return draft_profile.run(
            draft_profile.ProfileConfig(
                model=args.model,
                drafters=tuple(f for f in args.drafters.split(",") if f),
                k=args.k,
                max_new_tokens=args.max_new_tokens,
                device=args.device,
                dtype=args.dtype,
                top=args.top,
                tree=args.tree,
                out=args.out,
            )
        )
    except draft_profile.DraftProfileError as exc:
        p.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
