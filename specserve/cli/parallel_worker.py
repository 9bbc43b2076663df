"""A worker rank (RANK >= 1) of a parallel target, started by hand or by torchrun on any host with the env://
variables set (target_service/parallel/worker.py: what it runs)::

    RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=host0 MASTER_PORT=29500 \\
        python -m specserve.cli.parallel_worker [--model /path/if/mounted/elsewhere]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from specserve.target_service.parallel import rendezvous as rv
    from specserve.target_service.parallel.worker import serve

    parser = argparse.ArgumentParser(description="a worker rank (RANK >= 1) of a parallel specserve target")
    parser.add_argument("--model", default=None, help="checkpoint folder on this host (default: rank 0's path)")
    args = parser.parse_args(argv)
    rdv = rv.Rendezvous.from_env()
    if rdv is None or rdv.rank == 0:
        print("set RANK (>= 1), WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK) for a worker", file=sys.stderr)
        return 2
    try:
        return serve(rdv, checkpoint=args.model)
    except rv.ParallelError as e:
        print(f"specserve worker rank {rdv.rank}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
