"""The adaptive chooser's verify cost model scored on steps it did not see (bench/cost_fit.py):

python -m specserve.tools.cost_fit OUT/steps.jsonl [--train-fraction 0.7]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specserve.bench.cost_fit import cost_model_error
from specserve.bench.result import read_jsonl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specserve.tools.cost_fit", description=__doc__.splitlines()[0])
    parser.add_argument("steps", type=Path, help="steps.jsonl of a bench run")
    parser.add_argument("--train-fraction", type=float, default=0.7)
    args = parser.parse_args(argv)
    if not args.steps.is_file():
        print(f"cost_fit: error: {args.steps} does not exist", file=sys.stderr)
        return 2
    steps = read_jsonl(args.steps)
    print(json.dumps(cost_model_error(steps, args.train_fraction), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
