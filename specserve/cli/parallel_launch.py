"""One command line for every rank of a parallel target (torchrun, or by hand on each host).

    python -m specserve.cli.parallel_launch target --model DIR --device cuda \\
        --tensor-parallel-size 16 --listen 0.0.0.0:50052

Rank 0 (RANK unset or 0) runs that `specserve` command and serves callers; ranks >= 1 ignore it and
become workers (their shard spec comes from rank 0). Used with torchrun, whose variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are the env:// ones this package reads.
"""

from __future__ import annotations

import sys

from specserve.target_service.parallel.rendezvous import Rendezvous


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rdv = Rendezvous.from_env()
    if rdv is None or rdv.rank == 0:
        from specserve.cli.main import main as specserve_main

        return specserve_main(argv)
    from specserve.cli.parallel_worker import main as worker_main

    return worker_main([])


if __name__ == "__main__":
    sys.exit(main())
