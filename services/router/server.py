"""The router's gRPC server.

Today it serves health only; the Router service (Generate, ListEngines,
DrainEngine) is added with the end-to-end loop.
"""

from __future__ import annotations

import grpc


def register(server: grpc.aio.Server) -> list[str]:
    """Add the router's servicers to `server`; returns their service names for health checks."""
    return []
