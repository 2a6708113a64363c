"""The reward's gRPC server.

Today it serves health only; the Reward and Tools services are added with the
end-to-end loop.
"""

from __future__ import annotations

import grpc


def register(server: grpc.aio.Server) -> list[str]:
    """Add the reward's servicers to `server`; returns their service names for health checks."""
    return []
