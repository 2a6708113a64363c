"""The rollout engine's gRPC server.

Today it serves health only; the Rollout service (Generate, LoadWeights, Abort,
Pause, Resume, GetStatus) is added with the end-to-end loop.
"""

from __future__ import annotations

import grpc


def register(server: grpc.aio.Server) -> list[str]:
    """Add the engine's servicers to `server`; returns their service names for health checks."""
    return []
