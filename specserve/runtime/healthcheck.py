"""grpc.health.v1 probes: one check, and a wait until SERVING.

`python -m specserve.runtime.healthcheck ADDRESS [SERVICE]` exits 0 when the status at ADDRESS is SERVING,
else 1 (the container health probe of docker-compose.yml).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


def is_serving(channel, service: str = "", timeout_s: float = 2.0) -> bool:
    """One Check over an open (synchronous) channel; an RPC error propagates as grpc.RpcError."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def wait_serving(address: str, deadline: float, check_abort: Callable[[], None] = lambda: None) -> None:
    """Poll ADDRESS until SERVING; TimeoutError once time.monotonic() passes deadline. check_abort runs before each
    poll and raises to give up early (a child process died, a signal arrived)."""
    import grpc

    from specserve.runtime.servers_common import channel_options

    with grpc.insecure_channel(address, options=channel_options()) as channel:
        while True:
            check_abort()
            try:
                if is_serving(channel, timeout_s=1.0):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not become healthy in time")
            time.sleep(0.2)


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: python -m specserve.runtime.healthcheck ADDRESS [SERVICE]", file=sys.stderr)
        return 2
    import grpc

    with grpc.insecure_channel(argv[0]) as channel:
        try:
            serving = is_serving(channel, argv[1] if len(argv) > 1 else "")
        except grpc.RpcError as exc:
            print(f"{argv[0]}: {exc.code().name}", file=sys.stderr)
            return 1
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
