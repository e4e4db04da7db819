"""Container health probe: exit 0 only if gpufeed answers SERVING to the gRPC health check.

Docker's HEALTHCHECK runs this inside the server's container. It uses the
standard gRPC health protocol (grpc.health.v1.Health/Check), the same one
Kubernetes' grpc probe and grpc_health_probe speak, so an orchestrator and
Docker agree on what "healthy" means; a draining server answers NOT_SERVING
and turns unhealthy at once.

Usage: python healthcheck.py [HOST:PORT [SERVICE]]
(defaults: $GPUFEED_HEALTH_ADDRESS or 127.0.0.1:50051, and gpufeed.v1.Feed).
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_TIMEOUT = 3.0


def main(argv: list[str]) -> int:
    address = argv[1] if len(argv) > 1 else os.environ.get("GPUFEED_HEALTH_ADDRESS",
                                                           "127.0.0.1:50051")
    service = argv[2] if len(argv) > 2 else "gpufeed.v1.Feed"
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=_TIMEOUT)
        except grpc.RpcError as e:
            print(f"unhealthy: {address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address} {service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
