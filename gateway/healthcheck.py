"""`python -m specserve.gateway.healthcheck ADDRESS [SERVICE]`: exit 0 when the grpc.health.v1 status
at ADDRESS is SERVING, else 1 (the container health probe of docker-compose.yml)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: python -m specserve.gateway.healthcheck ADDRESS [SERVICE]", file=sys.stderr)
        return 2
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(argv[0]) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=argv[1] if len(argv) > 1 else ""), timeout=2.0
            )
        except grpc.RpcError as exc:
            print(f"{argv[0]}: {exc.code().name}", file=sys.stderr)
            return 1
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
