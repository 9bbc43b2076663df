"""The round-trip benchmark's peer (bench/ring_rtt.py starts it in its own process); the benchmark itself is
`specserve bench overhead --ring`."""

from __future__ import annotations

import argparse
import sys

from specserve.bench.ring_rtt import run_peer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specserve.tools.ring_rtt_peer", description=__doc__.splitlines()[0]
    )
    peer = parser.add_mutually_exclusive_group(required=True)
    peer.add_argument("--shm-peer", nargs=3, metavar=("NAME", "MODE", "SPIN_US"))
    peer.add_argument("--grpc-peer", metavar="ADDRESS")
    args = parser.parse_args(argv)
    run_peer(args.shm_peer, args.grpc_peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
