"""gRPC channel and server options, both sides of every connection from one place.

A client pings its server every ``ping_interval_ms`` while a call is open, also when no data
flows (a long Generate), so that a dead peer is noticed within ``ping_timeout_ms``. gRPC's
default server policy allows one ping without data per 5 minutes and answers the third
"early" one with GOAWAY ENHANCE_YOUR_CALM ``too_many_pings``, which kills every call on the
connection. So servers built here accept pings every ``ping_interval_ms / 2`` (a margin for
timer jitter), also on idle connections, and a call lives as long as its deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Large enough for a batch of long trajectories in one ScoreBatch or Generate reply."""
PING_STRIKES = 2
"""Pings closer than the server allows that it forgives before closing the connection."""

_SERVER_MIN_PING = "grpc.http2.min_ping_interval_without_data_ms"
"""The server's bound on the time between pings without data (GRPC_ARG_HTTP2_MIN_RECV_PING_
INTERVAL_WITHOUT_DATA_MS; the macro's name is not the option's)."""


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """One ping policy; ``client_options`` and ``server_options`` agree by construction."""

    ping_interval_ms: int = 20_000
    """How often a client pings while a call is open."""
    ping_timeout_ms: int = 10_000
    """How long a client waits for a ping's ack before it declares the connection dead."""

    def __post_init__(self) -> None:
        if self.ping_interval_ms < 2 or self.ping_timeout_ms < 1:
            raise ValueError("ping_interval_ms must be >= 2 and ping_timeout_ms >= 1")

    @property
    def server_min_ping_interval_ms(self) -> int:
        """The shortest gap between pings a server accepts: half the clients' interval."""
        return self.ping_interval_ms // 2

    def client_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", self.ping_interval_ms),
            ("grpc.keepalive_timeout_ms", self.ping_timeout_ms),
            ("grpc.http2.max_pings_without_data", 0),  # keep pinging through a long, quiet call
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2_000),
        ]

    def server_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            (_SERVER_MIN_PING, self.server_min_ping_interval_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_ping_strikes", PING_STRIKES),
        ]


KEEPALIVE = KeepAlive()
"""The policy of every verst channel (grpc_client.py) and server (grpc_server.py)."""
