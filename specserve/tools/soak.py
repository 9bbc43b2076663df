"""The soak (bench/soak.py: what it runs and checks): `python -m specserve.tools.soak --seconds 60` (make soak)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from specserve.bench import soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specserve.tools.soak", description=soak.__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run the load")
    parser.add_argument("--model", type=Path, default=None, help="target checkpoint (default: the shipped demo)")
    parser.add_argument(
        "--draft-model",
        type=Path,
        default=None,
        help="`model` drafter checkpoint (default: the shipped demo drafter; none -> ngram only)",
    )
    parser.add_argument("--workers", type=int, default=12, help="client threads sending requests back to back")
    parser.add_argument("--max-sessions", type=int, default=8, help="gateway sessions (more queue)")
    parser.add_argument("--max-queued", type=int, default=2, help="gateway queue (more: RESOURCE_EXHAUSTED)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument(
        "--kill-every-s",
        type=float,
        default=12.0,
        help="SIGKILL (or, every other time, SIGSTOP) a draft service this often",
    )
    parser.add_argument("--freeze-s", type=float, default=4.0, help="how long a frozen draft stays stopped")
    parser.add_argument(
        "--hostile-workers", type=int, default=3, help="threads sending hang-ups, cancels and garbage bytes"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return soak.run(soak.SoakConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(soak.SoakConfig)}))


if __name__ == "__main__":
    sys.exit(main())
