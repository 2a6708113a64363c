"""Which port each part of a local stack binds: `verst up --port-base N`'s layout, and the check
that every planned port is free before anything starts.

With a base N every port is N plus a fixed offset, so stacks on one host with bases at least a
span apart never meet (the span grows with the engines and trainers):

    N+0  api (HTTP, its /metrics too)      N+1  embedded Redis (unused when REDIS_URL is set)
    N+2  router gRPC     N+3  router /metrics
    N+4  reward gRPC     N+5  reward /metrics
    N+6  runner gRPC     N+7  runner /metrics
    N+8  controller gRPC N+9  controller /metrics (bound only with --separate-controller)
    N+10+3i               trainer-i gRPC, then its /metrics, then its weight-transport TCPStore
    N+10+3T+3j            engine-j gRPC, then its /metrics, then its SGLang server (sglang backend)

T is the number of trainers. The gloo groups of the distributed weight transport still bind
ports the kernel picks (torch offers no way to choose them).
"""

from __future__ import annotations

import socket

MAX_PORT = 65535
SERVICES = (
    "api", "redis", "router", "router metrics", "reward", "reward metrics",
    "runner", "runner metrics", "controller", "controller metrics",
)  # fmt: skip
"""The ports every stack has, in layout order from the base."""
PER_TRAINER = ("", " metrics", " weights")
"""Suffixes of each trainer's ports (``trainer-0``, ``trainer-0 metrics``, ``trainer-0 weights``)."""
PER_ENGINE = ("", " metrics", " sglang")
"""Suffixes of each engine's ports."""


class PortPlanError(ValueError):
    """A port plan that cannot work: out of range, or a port already taken; the message names it."""


def port_span(engines: int, trainers: int) -> int:
    """How many consecutive ports a stack with a base takes."""
    return len(SERVICES) + len(PER_TRAINER) * trainers + len(PER_ENGINE) * engines


def port_layout(base: int, *, engines: int, trainers: int) -> dict[str, int]:
    """Every port of a stack with ``engines`` and ``trainers`` laid out from ``base``, by what binds it."""
    span = port_span(engines, trainers)
    if base < 1 or base + span - 1 > MAX_PORT:
        raise PortPlanError(
            f"port_base (--port-base): {base} + {span} ports ({engines} engines, {trainers} trainers)"
            f" must stay within 1..{MAX_PORT}: use a base from 1 to {MAX_PORT - span + 1}"
        )
    names = list(SERVICES)
    names += [f"trainer-{i}{suffix}" for i in range(trainers) for suffix in PER_TRAINER]
    names += [f"engine-{j}{suffix}" for j in range(engines) for suffix in PER_ENGINE]
    return {name: base + offset for offset, name in enumerate(names)}


def check_free(ports: dict[str, int], host: str) -> None:
    """Raise PortPlanError naming the first port (and what would bind it) that something listens on.

    SO_REUSEADDR as the servers set it: a port that only has connections in TIME_WAIT is free.
    Without this check a second stack's gRPC servers could share the first's ports (gRPC sets
    SO_REUSEPORT) and answer each other's calls."""
    for name, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as err:
                raise PortPlanError(
                    f"port {port} ({name}) is taken on {host}: {err.strerror};"
                    " stop what holds it or choose another --port-base"
                ) from err
