"""Is a verst service up? For compose health checks and for `verst up` waiting on its children.

    python -m services.common.healthcheck grpc 127.0.0.1:50051
    python -m services.common.healthcheck http http://127.0.0.1:8000/healthz

Exits 0 when the service answers SERVING (gRPC health) or 200 (HTTP), 1 otherwise.
"""

from __future__ import annotations

import sys
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc


def grpc_serving(address: str, timeout_s: float = 2.0) -> bool:
    """True when ``address`` answers the standard gRPC health check with SERVING."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``url`` answers 200."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(check: str, target: str, deadline_s: float) -> bool:
    """Poll a check ("grpc" or "http") until it passes or the deadline passes."""
    probe = grpc_serving if check == "grpc" else http_ok
    end = time.monotonic() + deadline_s
    while True:
        if probe(target):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("grpc", "http"):
        print(__doc__, file=sys.stderr)
        return 2
    return 0 if wait_until(argv[0], argv[1], deadline_s=0) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
